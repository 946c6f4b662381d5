"""Models: a training step of each packaged recipe beside its peer model (tokens/s, peak memory, first step).

Each pair runs in this one process on one GPU: hybridzoo's model and the peer of the same shape
(fla's GLA, GatedDeltaNet and RetNet models; mamba_ssm's Mamba-1 and Mamba-2; transformers' Llama
with SDPA against an all-attention hybridzoo model; Samba and Qwen3.5 against transformers'
implementations where the installed transformers has them). Settings: fp32 weights, bf16 autocast,
fused AdamW, random tokens, at each of ``--lengths`` (2048, 8192) with ``--tokens-per-step`` (16384)
tokens per step: batch 8 at T 2048, batch 2 at T 8192 (``--batch`` fixes the batch instead).

The two models take turns, ours, peer, ours, peer, ... for ``--repeats`` (>= 3) repetitions. A
repetition builds the model, runs ``--warmup`` steps then ``--steps`` timed steps, and frees it;
it records tokens/s over the timed steps, the peak of ``torch.cuda.max_memory_allocated`` over the
whole repetition and, in the first repetition, the time from building the model to the end of
its first step (a cold start: compilation and autotuning included; keep ``TRITON_CACHE_DIR``
empty to measure it cold). ``--first-step`` runs each side once, to the end of its first step only:
the cold-start figure, and a way to fill Triton's cache before the timed run. Each ratio (ours / peer) is the median over repetitions, with its
minimum and maximum. A peer whose package is missing is skipped with a message naming it.
Autotuners' choices are cached with Triton's compiled kernels (``TRITON_CACHE_AUTOTUNING=1``
unless set), so a second run on the same machine skips fla's minutes of autotuning.

    python -m benchmarks models --out results/models.json
    python -m benchmarks models --pairs gla-340m,attn-340m --lengths 2048 --repeats 3
    python -m benchmarks models --first-step --pairs gla-340m --lengths 2048     # cold start only
    python -m benchmarks models --first-step --all-compile-threads 8 --pairs gla-340m  # fill the cache faster
    python -m benchmarks models --first-step --no-peer --pairs retnet-340m --lengths 2048  # ours' cold start
    python -m benchmarks models --cpu-smoke --out /tmp/models-smoke.json     # tiny shapes on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # before Triton is imported: keep autotuning results

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.meta import run_metadata, write_json  # noqa: E402
from benchmarks.precompile import add_compile_threads_argument, every_autotuner_precompiled  # noqa: E402
from hybridzoo import HybridConfig, HybridLM  # noqa: E402


class PeerMissing(RuntimeError):
    """The peer's package (or the model class in it) is not installed; the message says which."""


@dataclass
class Pair:
    """``ours(smoke) -> HybridConfig``; ``peer(config) -> (model, loss kind)`` of the same shape;
    ``peer_on_cpu``: the peer runs on a CPU (fla's and mamba_ssm's kernels need CUDA, and fla
    installed routes transformers' Gated DeltaNet layers to its kernels)."""
    name: str
    ours: Callable[[bool], HybridConfig]
    peer: Callable[[HybridConfig], tuple[nn.Module, str]]
    peer_name: str
    peer_on_cpu: bool = False


def _require(module: str, package: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise PeerMissing(f"{package} is not installed ({error}); pip install {package}") from None


def _recipe(name: str, **smoke: object) -> Callable[[bool], HybridConfig]:
    def build(tiny: bool) -> HybridConfig:
        from hybridzoo.zoo.recipes import load_recipe_config

        if not tiny:
            return load_recipe_config(name)
        # two layers, or one repetition of a longer pattern (every mixer kind of the recipe is built)
        n_layers = max(2, len(load_recipe_config(name).pattern))
        return load_recipe_config(name, vocab_size=256, d_model=64, n_layers=n_layers, d_mlp=128, **smoke)

    return build


def _attention(tiny: bool) -> HybridConfig:
    """Llama-340M's shape (d 1024, 24 layers, 16 heads, MLP 2816, vocab 32000, untied head)."""
    if tiny:
        return HybridConfig(vocab_size=256, d_model=64, n_layers=2, layers="attn", d_mlp=128, tie_embeddings=False,
                            norm_eps=1e-6, attn={"n_heads": 4})
    return HybridConfig(vocab_size=32000, d_model=1024, n_layers=24, layers="attn", d_mlp=2816, tie_embeddings=False,
                        norm_eps=1e-6, attn={"n_heads": 16})


def _llama(config: HybridConfig) -> tuple[nn.Module, str]:
    transformers = _require("transformers", "transformers")
    hf = transformers.LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.d_model,
                                  intermediate_size=config.mlp_width, num_hidden_layers=config.n_layers,
                                  num_attention_heads=config.attn.n_heads, num_key_value_heads=config.attn.n_heads,
                                  rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
                                  initializer_range=config.init_std, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(hf), "hf"


def _fla(model_class: str, config_class: str, fields: Callable[[HybridConfig], dict]):
    def build(config: HybridConfig) -> tuple[nn.Module, str]:
        models = _require("fla.models", "flash-linear-attention")
        from benchmarks.fla_backward import allow_fla_gated_backward

        allow_fla_gated_backward()  # the peer trains: its gated backward must run
        common = dict(vocab_size=config.vocab_size, hidden_size=config.d_model, num_hidden_layers=config.n_layers,
                      intermediate_size=config.mlp_width, norm_eps=config.norm_eps,
                      tie_word_embeddings=config.tie_embeddings, initializer_range=config.init_std)
        return getattr(models, model_class)(getattr(models, config_class)(**common, **fields(config))), "hf"

    return build


def _mamba_ssm(layer: str):
    def build(config: HybridConfig) -> tuple[nn.Module, str]:
        _require("causal_conv1d", "causal-conv1d")
        mixer = _require("mamba_ssm.models.mixer_seq_simple", "mamba-ssm")
        from mamba_ssm.models.config_mamba import MambaConfig

        block = config.mamba1 if layer == "Mamba1" else config.mamba2
        ssm = {"layer": layer, "d_state": block.d_state, "d_conv": block.d_conv, "expand": block.expand}
        if layer == "Mamba2":
            ssm.update(headdim=block.head_dim, ngroups=block.n_groups, chunk_size=block.chunk_size)
        mc = MambaConfig(d_model=config.d_model, n_layer=config.n_layers, d_intermediate=0,
                         vocab_size=config.vocab_size, ssm_cfg=ssm, rms_norm=True, fused_add_norm=True,
                         residual_in_fp32=True, tie_embeddings=config.tie_embeddings, pad_vocab_size_multiple=8)
        return mixer.MambaLMHeadModel(mc, initializer_cfg={"initializer_range": config.init_std}), "logits"

    return build


def _qwen35(config: HybridConfig) -> tuple[nn.Module, str]:
    transformers = _require("transformers", "transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        raise PeerMissing(f"transformers {transformers.__version__} has no Qwen3_5ForCausalLM; pip install -U transformers")
    try:  # with fla installed, transformers routes the Gated DeltaNet layers to fla's kernels
        from benchmarks.fla_backward import allow_fla_gated_backward

        allow_fla_gated_backward()
    except ImportError:
        pass
    attn, gdn = config.attn, config.gdn
    hf = transformers.Qwen3_5TextConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.mlp_width,
        num_hidden_layers=config.n_layers, num_attention_heads=attn.n_heads, num_key_value_heads=attn.n_kv_heads,
        head_dim=attn.head_dim, linear_num_key_heads=gdn.num_k_heads, linear_num_value_heads=gdn.num_v_heads,
        linear_key_head_dim=gdn.head_k_dim, linear_value_head_dim=gdn.head_v_dim, linear_conv_kernel_dim=gdn.conv_size,
        rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings, initializer_range=config.init_std,
        layer_types=["full_attention" if kind == "attn" else "linear_attention" for kind in config.layer_kinds()],
        rope_parameters={"rope_type": "default", "rope_theta": attn.rope_base,
                         "partial_rotary_factor": attn.partial_rotary_factor})
    return transformers.Qwen3_5ForCausalLM(hf), "hf"


def _samba(config: HybridConfig) -> tuple[nn.Module, str]:
    transformers = _require("transformers", "transformers")
    if not hasattr(transformers, "SambaForCausalLM"):
        raise PeerMissing(f"transformers {transformers.__version__} has no Samba model (SambaForCausalLM)")
    raise PeerMissing("a Samba peer mapping is not written yet")


PAIRS = {pair.name: pair for pair in [
    Pair("attn-340m", _attention, _llama, "transformers LlamaForCausalLM (SDPA)", peer_on_cpu=True),
    Pair("gla-340m", _recipe("gla-340m"), _fla("GLAForCausalLM", "GLAConfig", lambda c: dict(
        num_heads=c.gla.num_heads, expand_k=c.gla.expand_k, expand_v=c.gla.expand_v,
        use_short_conv=c.gla.use_short_conv, use_output_gate=c.gla.use_output_gate)), "fla GLAForCausalLM"),
    Pair("gated-deltanet-340m", _recipe("gated-deltanet-340m", gdn={"num_k_heads": 2, "num_v_heads": 2,
                                                                   "head_k_dim": 16, "head_v_dim": 32}),
         _fla("GatedDeltaNetForCausalLM", "GatedDeltaNetConfig", lambda c: dict(
             num_heads=c.gdn.num_k_heads, num_v_heads=c.gdn.num_v_heads, head_dim=c.gdn.head_k_dim,
             expand_v=c.gdn.head_v_dim / c.gdn.head_k_dim, conv_size=c.gdn.conv_size)), "fla GatedDeltaNetForCausalLM"),
    Pair("retnet-340m", _recipe("retnet-340m"), _fla("RetNetForCausalLM", "RetNetConfig", lambda c: dict(
        num_heads=c.retnet.num_heads, expand_k=c.retnet.expand_k, expand_v=c.retnet.expand_v)),
         "fla RetNetForCausalLM"),
    Pair("mamba-130m", _recipe("mamba-130m"), _mamba_ssm("Mamba1"), "mamba_ssm MambaLMHeadModel (Mamba-1)"),
    Pair("mamba2-130m", _recipe("mamba2-130m", mamba2={"head_dim": 16, "d_state": 16, "chunk_size": 32}),
         _mamba_ssm("Mamba2"), "mamba_ssm MambaLMHeadModel (Mamba-2)"),
    Pair("samba-421m", _recipe("samba-421m", attn={"n_heads": 4, "n_kv_heads": 4, "head_dim": 16, "window": 32}),
         _samba, "transformers Samba"),
    Pair("qwen35-0.8b", _recipe("qwen35-0.8b", gdn={"num_k_heads": 2, "num_v_heads": 2, "head_k_dim": 16,
                                                    "head_v_dim": 16}, attn={"n_heads": 4, "n_kv_heads": 2,
                                                                             "head_dim": 16}),
         _qwen35, "transformers Qwen3_5ForCausalLM"),
]}
SMOKE_PAIRS = "attn-340m,gla-340m,gated-deltanet-340m,retnet-340m,mamba-130m,mamba2-130m,qwen35-0.8b"


def loss_of(model: nn.Module, kind: str, ids: torch.Tensor) -> torch.Tensor:
    """The next-token loss of one batch: ``kind`` is hybridzoo, hf (``labels=`` in the call) or
    logits (cross-entropy of the returned logits, shifted)."""
    if kind == "hybridzoo":
        return model(ids, labels=ids)[2]
    if kind == "hf":
        return model(input_ids=ids, labels=ids).loss
    logits = model(ids).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(build: Callable[[], tuple[nn.Module, str]], batch: int, tokens: int, warmup: int, steps: int,
            device: torch.device, seed: int = 0) -> dict:
    """One repetition: build, warm up, time ``steps`` AdamW steps; free. Returns its figures."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    torch.manual_seed(seed)
    with device:  # parameters are made (and initialised) on the device itself
        model, kind = build()
    model = model.to(device=device, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch, tokens), generator=generator).to(device)  # ids < every vocabulary
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    first_step_s, times = None, []
    for step in range(warmup + steps):
        began = time.perf_counter()
        with autocast:
            loss = loss_of(model, kind, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if first_step_s is None:
            first_step_s = time.perf_counter() - start
        if step >= warmup:
            times.append(time.perf_counter() - began)
    record = {"params": sum(p.numel() for p in model.parameters()), "loss": loss.item(),
              "tokens_per_s": batch * tokens * steps / sum(times), "step_s": statistics.median(times),
              "first_step_s": first_step_s,
              "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    del model, optimizer, loss
    return record


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def batch_for(tokens: int, args: argparse.Namespace) -> int:
    """The batch at sequence length ``tokens``: ``--batch`` if given, else ``--tokens-per-step // tokens``."""
    if args.batch:
        return args.batch
    if tokens > args.tokens_per_step:
        raise ValueError(f"models: T {tokens} is longer than --tokens-per-step {args.tokens_per_step}; "
                         "raise --tokens-per-step or give --batch")
    return args.tokens_per_step // tokens


def run_pair(pair: Pair, tokens: int, args: argparse.Namespace, device: torch.device, log=print) -> dict:
    """Interleaved repetitions of ours and the peer at one length; the row of the JSON."""
    config = pair.ours(args.cpu_smoke)
    batch = batch_for(tokens, args)
    row = {"pair": pair.name, "tokens": tokens, "batch": batch, "peer": pair.peer_name,
           "ours_config": config.to_dict()}
    ours = lambda: (HybridLM(config), "hybridzoo")  # noqa: E731
    try:
        if args.no_peer:
            raise PeerMissing("--no-peer: hybridzoo's side only")
        if device.type == "cpu" and not pair.peer_on_cpu:
            raise PeerMissing(f"{pair.peer_name} runs on CUDA only")
        try:  # fail fast when the peer is missing (on the meta device: nothing allocated)
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pair.peer(config)
        except PeerMissing:
            raise
        except Exception:  # noqa: BLE001 - a peer that cannot be built on meta is built per repetition
            pass
        peer = lambda: pair.peer(config)  # noqa: E731
    except PeerMissing as error:
        log(f"models: {pair.name}: peer skipped: {error}")
        row["peer_skipped"], peer = str(error), None
    runs = {"ours": [], "peer": []}
    for repeat in range(args.repeats):
        for who, build in (("ours", ours), ("peer", peer)):
            if build is None:
                continue
            try:
                runs[who].append(measure(build, batch, tokens, args.warmup, args.steps, device, seed=repeat))
            except torch.OutOfMemoryError:
                runs[who].append({"error": "out of memory"})
            except Exception as error:  # one side failing must not lose the other
                runs[who].append({"error": f"{type(error).__name__}: {error}"[:300]})
            last = runs[who][-1]
            log(f"models: {pair.name} T{tokens} {who} #{repeat}: " + (last.get("error") or
                f"{last['tokens_per_s']:,.0f} tokens/s, first step {last['first_step_s']:.1f} s"))
    row["ours"], row["peer_runs"] = runs["ours"], runs["peer"]
    good = [(o, p) for o, p in zip(runs["ours"], runs["peer"]) if "error" not in o and "error" not in p]
    if good:
        row["ratio_tokens_per_s"] = _spread([o["tokens_per_s"] / p["tokens_per_s"] for o, p in good])
        if device.type == "cuda":
            row["ratio_peak_memory"] = _spread([o["peak_bytes"] / p["peak_bytes"] for o, p in good])
        row["ratio_first_step"] = good[0][0]["first_step_s"] / good[0][1]["first_step_s"]
    return row


def table(rows: list[dict]) -> str:
    """The short table printed last: medians of each side, the ratios (min-max), first steps."""
    def med(runs, key):
        values = [r[key] for r in runs if "error" not in r and r.get(key) is not None]
        return statistics.median(values) if values else float("nan")

    lines = [f"{'pair':20s} {'T':>5s} {'B':>2s} {'ours tok/s':>11s} {'peer tok/s':>11s} {'ratio (min-max)':>17s} "
             f"{'ours GiB':>8s} {'peer GiB':>8s} {'mem':>5s} {'1st step s':>11s}  peer"]
    for row in rows:
        ours, peer = row.get("ours", []), row.get("peer_runs", [])
        tps, mem = row.get("ratio_tokens_per_s"), row.get("ratio_peak_memory")
        text = f"{tps['median']:.2f} ({tps['min']:.2f}-{tps['max']:.2f})" if tps else "-"
        first = "/".join(f"{r['first_step_s']:.0f}" if "error" not in r else "x" for r in (ours[:1] + peer[:1]))
        lines.append(f"{row['pair']:20s} {row['tokens']:5d} {row['batch']:2d} {med(ours, 'tokens_per_s'):11,.0f} "
                     f"{med(peer, 'tokens_per_s'):11,.0f} {text:>17s} {med(ours, 'peak_bytes') / 2**30:8.1f} "
                     f"{med(peer, 'peak_bytes') / 2**30:8.1f} {mem['median'] if mem else float('nan'):5.2f} "
                     f"{first:>11s}  " + (row.get("peer_skipped") or row["peer"])
                     + "".join(f" [{who}: {r['error'][:80]}]" for who, runs in (("ours", ours), ("peer", peer))
                               for r in runs[:1] if "error" in r))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks models", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--pairs", default=None, help=f"comma-separated subset of {', '.join(PAIRS)} (default: all)")
    parser.add_argument("--lengths", default="2048,8192", help="comma-separated sequence lengths (default 2048,8192)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step at every length "
                        "(default: --tokens-per-step / T)")
    parser.add_argument("--tokens-per-step", type=int, default=16384, help="tokens per step when --batch is not "
                        "given (default 16384: B 8 x T 2048, B 2 x T 8192)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions of each side (>= 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per repetition")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    parser.add_argument("--out", default=None, help="JSON results (default benchmarks/results/<date>-models.json)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes of every pair on a CPU (B2 T64, "
                        "1 + 1 steps): every code path, no timing worth reading")
    parser.add_argument("--first-step", action="store_true", help="each side once, to the end of its first step "
                        "(the cold-start figure; also fills Triton's cache for a timed run)")
    parser.add_argument("--no-peer", action="store_true", help="hybridzoo's side only (with --first-step: "
                        "each recipe's own cold start, one recipe per process and empty cache)")
    add_compile_threads_argument(parser, "the peer's", "; the peer's first step is then not a user's cold start")
    args = parser.parse_args(argv)
    if args.first_step:
        args.repeats, args.warmup, args.steps = 1, 0, 1
    elif args.repeats < 3 and not args.cpu_smoke:
        parser.error(f"--repeats must be at least 3 (each ratio is a median over repetitions), got {args.repeats}")
    unknown = set((args.pairs or "").split(",")) - set(PAIRS) - {""}
    if unknown:
        parser.error(f"unknown pair(s) {sorted(unknown)}; choose from {', '.join(PAIRS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
        args.pairs = args.pairs or SMOKE_PAIRS
        args.lengths, args.batch, args.warmup, args.steps = "64", 2, 1, 1
        args.first_step = False
    elif not torch.cuda.is_available():
        print("models: no CUDA device; use --cpu-smoke on a CPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    out = args.out or f"benchmarks/results/{datetime.date.today()}-models.json"
    pairs = [PAIRS[name] for name in (args.pairs or ",".join(PAIRS)).split(",") if name]
    lengths = [int(t) for t in args.lengths.split(",") if t]
    header = {**run_metadata(("fla", "mamba_ssm", "causal_conv1d", "transformers")),
              "settings": {"batch": {t: batch_for(t, args) for t in lengths}, "lengths": lengths,
                           "first_step_only": args.first_step, "no_peer": args.no_peer,
                           "all_compile_threads": args.all_compile_threads,
                           "repeats": args.repeats, "warmup": args.warmup,
                           "steps": args.steps, "weights": "float32", "autocast": "bf16" if device.type == "cuda"
                           else None, "optimizer": "AdamW (fused on CUDA), lr 1e-4", "data": "random tokens",
                           "order": "ours, peer, ours, peer, ... (interleaved repetitions)", "cpu_smoke": args.cpu_smoke,
                           "fla": "gated backward allowed on Triton < 3.7 (fla.ops.common.chunk_o."
                                  "TRITON_ABOVE_3_7_1 = True)"}}
    rows = []
    with every_autotuner_precompiled(args.all_compile_threads if device.type == "cuda" else 0):
        for tokens in lengths:
            for pair in pairs:
                rows.append(run_pair(pair, tokens, args, device))
                write_json(out, {**header, "rows": rows})
    print(table(rows))
    print(f"wrote {out}")
    return 0
