"""SeCO: one training step of a long sequence, SeCO vs SeCO + kv_offload vs full backprop (GPU).

For each recipe (default: ``qwen35-0.8b``, the 3:1 Gated DeltaNet : attention hybrid of ~0.75B
parameters, and ``gated-deltanet-340m``, pure recurrent) and each length (default 32k, 128k,
256k, 512k and 1M tokens, 2**15 ... 2**20: seed 001's "131k, 262k, 524k"; plus 16k, a second
point for full backprop; batch 1), one training step per mode:

* ``seco``: :func:`hybridzoo.training.seco_engine.seco_step` (chunks of ``--chunk-size``),
* ``seco_offload``: the same with ``kv_offload=True`` (K/V stores and chunk-boundary states in
  pinned host memory),
* ``full``: full backprop, one forward + backward of the whole sequence, no activation
  checkpointing; the loss is the chunked cross-entropy (``--loss-slice`` slices of the final hidden
  states, as SeCO's loss; each slice's logits recomputed in backward), so whole-sequence logits never exist, as
  in SeCO (whole logits of a 248k vocabulary would take 15 GiB in bf16 at 32k tokens, and twice
  that again in float32 for the loss).

Settings: fp32 weights, bf16 autocast (``--dtype``), fp32 matmuls at ``--fp32-matmul`` precision
(default ``high`` = TF32, which SeCO's fp32 prefix-attention backward uses), random tokens, no
activation checkpointing inside SeCO's chunks either.

**The fused AdamW step is excluded from ``step_s``** (forward + backward only) and timed
separately as ``optim_s``; it *is* inside the peak-memory window, and its states (allocated in the
warm-up) are part of ``static_bytes``. It runs with ``lr=0``, so it costs a real update but leaves
the weights unchanged: every row sees the same model and the gradients of different modes at one
length can be compared (``grad_rel_err``).

Per row (written to ``--out`` after every row): status (``ok`` / ``did not fit`` = out of memory /
``refused`` = the 40% host-RAM guard of kv_offload / ``skipped`` / ``error``), ``step_s``,
``optim_s``, ``peak_bytes`` (``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``), ``static_bytes`` (weights + AdamW states + inputs before the step),
the loss, the gradient's relative error against the first mode that ran at that length, and the
memory model's prediction. At the end (and after every row): per recipe and mode, a least-squares
line of peak memory against tokens, whose slope is compared with the K/V accounting
(:func:`memory_model`), the time ratios SeCO / full backprop, the 1M-token target (1M tokens fit,
at <= 1.5x full backprop's time per token), and a PNG plot of peak memory against tokens
(``--plot``, default ``--out`` with ``.png``).

The memory model (bytes per token that stay on the device for the whole step, batch 1)::

    K/V      = Σ over full-attention layers of 2 · n_kv_heads · head_dim · itemsize(activation dtype)
    seco     = K/V (store) + K/V · itemsize(grad) / itemsize(store) (gradient buffer)
               + one chunk boundary of every other layer's state / chunk_size
    offload  = the gradient buffer only (stores and boundary states are in host memory)
    host     = the RNG states saved per chunk / chunk_size (+ stores and boundaries with offload)

SeCO's gradient buffers are float32 whatever the activation dtype (``seco_engine``), so under bf16
autocast ``seco`` is 3x the K/V bytes (2x in fp32) and ``offload`` 2x (1x in fp32); the "2x the
K/V, 1x with offload" rule of seed 001 (``kv_formula`` in the JSON) holds when the gradient has
the store's dtype. A pure recurrent model has K/V = 0: only its boundary states grow.

Usage (one process; every configuration in its own try/except)::

    python -m benchmarks seco --out results/seco.json
    python -m benchmarks seco --recipes qwen35-0.8b --lengths 32k,128k --chunk-size 16384
    python -m benchmarks seco --plot-only benchmarks/results/<date>-seco.json
    python -m benchmarks seco --cpu-smoke          # tiny models on the CPU, < 60 s

A row whose time, extrapolated from the shorter lengths of its recipe and mode, exceeds
``--max-step-s`` (default 540) is recorded as skipped; a mode that did not fit at one length is not
tried at longer ones. ``--resume`` keeps the finished rows of ``--out`` and runs only the others,
so the work can be split over several processes with one ``--out``, e.g. ``--recipes qwen35-0.8b
--lengths 32k,128k,256k``, then ``--recipes qwen35-0.8b --lengths 512k,1M --resume``.

``--cpu-smoke`` runs every code path (the check, SeCO, SeCO + offload without pinning, full
backprop, the fits, the summary) on a tiny hybrid with full attention and a tiny pure recurrent
model; peak memory on the CPU is taken from the PyTorch profiler's allocation events.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import statistics
import time
import traceback
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from hybridzoo import HybridLM  # noqa: E402
from hybridzoo.layers import chunk_attention  # noqa: E402
from hybridzoo.layers.attention import Attention  # noqa: E402
from hybridzoo.training.seco_engine import (  # noqa: E402
    LOSS_SLICE,
    ProgressLog,
    SeCOError,
    SeCOOffloadError,
    _get_rng,
    _loss_sum,
    check_chunked_forward,
    host_ram_bytes,
    offload_bytes,
    seco_step,
)
from benchmarks.meta import run_metadata  # noqa: E402

MODES = ("seco", "seco_offload", "full")
DEFAULT_RECIPES = "qwen35-0.8b,gated-deltanet-340m"
# 2**15 ... 2**20 (seed 001's "131k, 262k, 524k" are 128k, 256k, 512k here), and 16k: a second
# point for full backprop, which may fit only at the shortest lengths
DEFAULT_LENGTHS = "16k,32k,128k,256k,512k,1M"
TARGET_TOKENS = 2**20
TARGET_TIME_RATIO = 1.5
# --cpu-smoke models: (recipe, HybridConfig overrides). Full attention (window None), so the K/V
# store path runs; the recurrent one has only Markov states.
SMOKE_RECIPES = {
    "tiny-hybrid-full-attn": ("tiny-hybrid", dict(layers="gdn mamba2 attn", n_layers=3, attn={"window": None})),
    "tiny-recurrent": ("tiny-hybrid", dict(layers="gdn mamba2", n_layers=2)),
}
SMOKE_LENGTHS = "512,1024,2048"
SMOKE_CHUNK = 128


# ---- small helpers -----------------------------------------------------------------------------
def parse_tokens(text: str) -> int:
    """``"32k"`` -> 32768, ``"1M"`` -> 1048576, ``"5000"`` -> 5000 (k = 2**10, M = 2**20)."""
    text = text.strip()
    scale = {"k": 2**10, "K": 2**10, "m": 2**20, "M": 2**20}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"--lengths: {text!r} is not a token count like 4096, 32k or 1M") from None
    if value < 1 or value != int(value):
        raise ValueError(f"--lengths: {text!r} must be a positive whole number of tokens")
    return int(value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- the memory model ------------------------------------------------------------------------------
def kv_bytes_per_token(model: nn.Module, dtype: torch.dtype) -> int:
    """K/V bytes one token adds to the stores: Σ over full-attention layers of
    ``2 · n_kv_heads · head_dim · dtype.itemsize`` (batch 1): :func:`offload_bytes` of one token
    in one chunk counts exactly that (no chunk boundary)."""
    return offload_bytes(model, 1, 1, 1, dtype)


def boundary_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of one saved chunk boundary (every layer's state but full attention's), batch 1:
    :func:`offload_bytes` of 2 chunks over 0 tokens counts exactly one boundary and no K/V."""
    return offload_bytes(model, 1, 0, 2, dtype)


def rng_bytes(device: torch.device) -> int:
    """Bytes of the RNG states SeCO saves per chunk (host tensors, also for a CUDA device)."""
    return sum(state.numel() for state in _get_rng(device))


def memory_model(model: nn.Module, dtype: torch.dtype, chunk_size: int, offload: bool,
                 grad_dtype: torch.dtype | None = None, rng_bytes_per_chunk: int = 0) -> dict:
    """Bytes per token that SeCO keeps for the whole step (batch 1), on the device and on the host.

    Args:
        dtype: the activation dtype (the autocast dtype), which the K/V stores and conv tails have.
        grad_dtype: dtype of the K/V gradient buffers; None = the engine's rule,
            ``promote_types(dtype, float32)``.
        rng_bytes_per_chunk: the RNG states saved per chunk (:func:`rng_bytes`; host memory).

    Returns a dict of bytes per token: ``kv`` (the K/V of one token), ``kv_store``, ``kv_grad``,
    ``boundary`` (one chunk boundary of every other layer's state / ``chunk_size``), ``rng``,
    ``device`` and ``host`` (the totals on each side: the K/V stores and boundary states go to the
    host with offload), and ``kv_formula`` = ``kv · (1 if offload else 2)``, seed 001's rule
    (gradient in the store's dtype, boundary states not counted).
    """
    grad_dtype = grad_dtype or torch.promote_types(dtype, torch.float32)
    kv = kv_bytes_per_token(model, dtype)
    kv_grad = kv * grad_dtype.itemsize // dtype.itemsize
    boundary = boundary_bytes(model, dtype) / chunk_size
    rng = rng_bytes_per_chunk / chunk_size
    movable = kv + boundary  # K/V stores and boundary states: host with offload, else device
    return {"kv": kv, "kv_store": kv, "kv_grad": kv_grad, "boundary": boundary, "rng": rng,
            "device": kv_grad + (0 if offload else movable), "host": rng + (movable if offload else 0),
            "kv_formula": kv * (1 if offload else 2)}


def step_flops(model: nn.Module, tokens: int) -> float:
    """The model's FLOPs of one forward + backward of ``tokens`` tokens (batch 1), the work that any
    training step of this sequence does (SeCO's recomputation not counted): ``6 · tokens`` per
    weight of every ``nn.Linear`` (the LM head included, the embedding lookup not), plus, per
    attention layer, ``7 · n_heads · head_dim · pairs`` for its ``pairs`` visible (query, key)
    pairs (``tokens² / 2`` causal, ``tokens · window`` with a window): ``2 · 2`` for QKᵀ and PV
    forward, 2.5x that backward, the FlashAttention papers' convention. Recurrent mixers' scans
    are not counted (qwen35-0.8b's 18 Gated DeltaNet layers: ~2% of the linear layers' FLOPs)."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    attention = 0.0
    for block in model.blocks:
        mixer = block.mixer
        if isinstance(mixer, Attention):
            window = mixer.config.window
            pairs = tokens * (tokens + 1) / 2 if window is None or window >= tokens else tokens * window
            attention += 7 * mixer.n_heads * mixer.head_dim * pairs
    return 6.0 * linear * tokens + attention


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of ``y = slope · x + intercept``; needs two distinct x
    (else :class:`statistics.StatisticsError`, a ValueError)."""
    return tuple(statistics.linear_regression(xs, ys))


# ---- peak memory ---------------------------------------------------------------------------------
class MemoryProbe:
    """Peak memory of a region: CUDA's allocator statistics, or on the CPU the PyTorch profiler's
    allocation events (the live bytes allocated inside the region, at their highest).

    After the ``with`` block: ``static`` (bytes allocated before it; None on the CPU), ``peak``
    (absolute peak; None on the CPU) and ``above_static`` (peak minus static), or all None when
    nothing could be measured (``error`` says why).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.static = self.peak = self.above_static = None
        self.error = None
        self._profiler = None

    def __enter__(self):
        if self.device.type == "cuda":
            _sync(self.device)
            self.static = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu":
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            _sync(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.above_static = self.peak - self.static
        elif self._profiler is not None:
            self._profiler.__exit__(*exc)
            if exc[0] is None:
                try:  # every allocation (+) and free (-) of the CPU allocator, in time order
                    events = sorted((e.start_ns(), e.nbytes()) for e in self._profiler.profiler.kineto_results.events()
                                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
                    live = high = 0
                    for _, nbytes in events:
                        live += nbytes
                        high = max(high, live)
                    self.above_static = high
                except Exception as error:  # the profiler's internals moved: measure nothing
                    self.error = f"CPU memory not measured: {type(error).__name__}: {error}"
            self._profiler = None
        return False


# ---- the steps ------------------------------------------------------------------------------------
def full_backprop_step(model: HybridLM, batch: dict, loss_chunk: int) -> torch.Tensor:
    """Forward + backward of the whole sequence (gradients into ``.grad``); the mean loss is the
    sum of per-slice cross-entropies, each slice's logits recomputed in backward. Returns the loss."""
    ids, targets, head = batch["input_ids"], batch["targets"], model.lm_head
    hidden, _ = model(input_ids=ids, return_hidden=True)  # final-norm hidden states, no LM head
    count = (targets != -100).sum().clamp(min=1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, ids.shape[1], loss_chunk):
        end = start + loss_chunk
        total = total + checkpoint(lambda h, t: _loss_sum(head(h), t), hidden[:, start:end],
                                   targets[:, start:end], use_reentrant=False)
    loss = total / count
    loss.backward()
    return loss.detach()


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def train_step(model, optimizer, batch: dict, mode: str, chunk_size: int, device: torch.device,
               autocast_dtype: torch.dtype | None, block_size: int | None = None,
               loss_slice: int | None = LOSS_SLICE, progress=None) -> dict:
    """One measured training step: forward + backward (``step_s``), then ``optimizer.step()``
    (``optim_s``), peak memory over both. Raises what the step raises (out of memory included)."""
    model.zero_grad(set_to_none=True)
    _free(device)
    with MemoryProbe(device) as probe:
        _sync(device)
        start = time.perf_counter()
        with _autocast(device, autocast_dtype):
            if mode == "full":
                loss, num_chunks = full_backprop_step(model, batch, loss_slice or chunk_size), 1
            else:
                result = seco_step(model, batch, chunk_size, kv_offload=mode == "seco_offload",
                                   block_size=block_size, loss_slice=loss_slice, progress=progress)
                loss, num_chunks = result.loss, result.num_chunks
        _sync(device)
        middle = time.perf_counter()
        optimizer.step()
        _sync(device)
        end = time.perf_counter()
    return {"step_s": middle - start, "optim_s": end - middle, "loss": float(loss), "num_chunks": num_chunks,
            "static_bytes": probe.static, "peak_bytes": probe.peak, "growth_bytes": probe.above_static,
            **({"memory_note": probe.error} if probe.error else {})}


def make_batch(vocab_size: int, tokens: int, device: torch.device, seed: int) -> dict:
    """Random token ids ``[1, tokens]`` and their next-token targets (the last one ignored)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (1, tokens), generator=generator)
    targets = F.pad(ids[:, 1:], (0, 1), value=-100)
    return {"input_ids": ids.to(device), "targets": targets.to(device)}


# ---- gradient comparison --------------------------------------------------------------------------
def _grads(model: nn.Module) -> list[torch.Tensor]:
    """A host copy of every parameter's gradient (float32)."""
    return [p.grad.detach().float().cpu() if p.grad is not None else torch.zeros(p.shape)
            for p in model.parameters()]


def _grad_rel_err(model: nn.Module, reference: list[torch.Tensor]) -> float:
    """``‖g − ref‖ / ‖ref‖`` over all parameters, one parameter at a time on its device."""
    num = den = 0.0
    for p, ref in zip(model.parameters(), reference):
        ref = ref.to(p.device)
        grad = p.grad.detach().float() if p.grad is not None else torch.zeros_like(ref)
        num += float((grad - ref).double().square().sum())
        den += float(ref.double().square().sum())
    if not math.isfinite(num):
        return float("inf")
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


# ---- models ---------------------------------------------------------------------------------------------
def build_model(spec: str, device: torch.device) -> HybridLM:
    """A recipe name / YAML path, or one of :data:`SMOKE_RECIPES`, in float32 on ``device``."""
    if spec in SMOKE_RECIPES:
        recipe, overrides = SMOKE_RECIPES[spec]
        model = HybridLM.from_recipe(recipe, **overrides)
    else:
        model = HybridLM.from_recipe(spec)
    return model.to(device=device, dtype=torch.float32)


def _optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, str]:
    params = [p for p in model.parameters() if p.requires_grad]
    for kwargs, name in (({"fused": True}, "fused"), ({"foreach": True}, "foreach"), ({}, "for-loop")):
        try:
            return torch.optim.AdamW(params, lr=0.0, weight_decay=0.1, **kwargs), name
        except (RuntimeError, ValueError):
            continue
    raise RuntimeError("no AdamW implementation could be built")


# ---- the benchmark ---------------------------------------------------------------------------------------
def _meta(device: torch.device, args: dict) -> dict:
    run = run_metadata()
    meta = {
        "date": run["date"], "commit": run["commit"], "dirty": run["dirty"],
        "device": run["device"],
        "device_memory_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
        "host_ram_bytes": host_ram_bytes(),
        "versions": run["versions"],
        "settings": {
            **args,
            "weights": "float32", "batch_size": 1, "data": "random tokens",
            "fp32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "optimizer": "AdamW lr=0 (a full update that leaves the weights unchanged), weight_decay 0.1; "
                         "NOT in step_s (timed as optim_s), inside the peak-memory window; its states "
                         "are allocated in the warm-up and counted in static_bytes",
            "full_backprop": "one forward + backward of the whole sequence, no activation checkpointing, "
                             "chunked cross-entropy over ce_slice slices (rows without ce_slice: chunk_size "
                             "slices), logits recomputed in backward",
            "seco": "seco_engine.seco_step (block_size, loss_slice: see those; rows without loss_slice ran "
                    "before it existed, with each chunk's whole logits), no activation checkpointing in a chunk",
            "seco_attention_backward": ("PyTorch's flash backward per block (chunk_attention; the default)"
                                        if chunk_attention.FLASH_ON_CUDA or device.type == "cpu" else
                                        "hybridzoo's Triton prefix backward (prefix_attention; "
                                        "--triton-prefix-backward / HYBRIDZOO_SECO_FLASH=0)"),
            "memory": "torch.cuda.max_memory_allocated after reset_peak_memory_stats" if device.type == "cuda"
                      else "PyTorch profiler CPU allocation events (bytes allocated inside the step at their peak)",
        },
    }
    return meta


def setting(row: dict) -> tuple:
    """The configuration a row was measured in: ``(recipe, mode, chunk_size, loss_slice,
    flash_backward)`` (rows from before loss_slice / flash_backward were recorded: None / False)."""
    return (row["recipe"], row["mode"], row["chunk_size"], row.get("loss_slice"), row.get("flash_backward", False))


def _predict_seconds(rows: list[dict], row: dict, has_kv: bool) -> float | None:
    """Time of ``row`` (its setting, a longer length) from the rows of the same setting (a power
    law, exponent fitted to the last two lengths and clipped to [1, 2]; 2 for one length with
    attention, else 1)."""
    done = sorted({r["tokens"]: r["step_s"] + r.get("optim_s", 0.0) for r in rows
                   if setting(r) == setting(row) and r["status"] == "ok" and r["tokens"] < row["tokens"]}.items())
    if not done:
        return None
    (t1, s1), (t2, s2) = (done[-2] if len(done) > 1 else (None, None)), done[-1]
    exponent = (2.0 if has_kv else 1.0) if t1 is None else min(2.0, max(1.0, math.log(s2 / s1) / math.log(t2 / t1)))
    return s2 * (row["tokens"] / t2) ** exponent


def benchmark(recipes: list[str], lengths: list[int], modes: list[str], chunk_size: int, device: torch.device,
              out: str | Path | None, *, autocast_dtype: torch.dtype | None = torch.bfloat16,
              max_step_s: float = 0.0, grad_check: bool = True, resume: bool = False, seed: int = 0,
              args_for_meta: dict | None = None, log=print, block_size: int | None = None,
              loss_slice: int | None = LOSS_SLICE) -> dict:
    """Run every (recipe, length, mode) row and return (and write to ``out`` after every row) the
    result dict: ``meta``, ``recipes`` (per recipe: parameters, memory model, startup check),
    ``rows``, ``summary`` (see :func:`summarize`)."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"modes: unknown {unknown}; choose from {list(MODES)}")
    dtype = autocast_dtype or torch.float32
    result = {"meta": _meta(device, args_for_meta or {}), "recipes": {}, "rows": [], "summary": {}}
    if resume and out is not None and Path(out).is_file():
        previous = json.loads(Path(out).read_text())
        result["recipes"] = previous.get("recipes", {})
        result["rows"] = [r for r in previous.get("rows", []) if r["status"] in ("ok", "did not fit", "refused")]
        log(f"resume: kept {len(result['rows'])} rows of {out}")
    rows = result["rows"]

    def write():
        result["summary"] = summarize(result)
        if out is not None:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(result, indent=2) + "\n")

    for spec in recipes:
        # rows of another chunk or loss slice are other rows (rows before loss_slice existed: None)
        # and of the other attention backward (rows before it was recorded: the Triton one)
        flash = chunk_attention.FLASH_ON_CUDA
        fields = {"recipe": spec, "chunk_size": chunk_size, "loss_slice": loss_slice, "flash_backward": flash}
        done = {(setting(r), r["tokens"]) for r in rows}
        todo = [(tokens, mode) for tokens in lengths for mode in modes
                if (setting(dict(fields, mode=mode)), tokens) not in done]
        if not todo:
            continue
        torch.manual_seed(seed)
        model = build_model(spec, device)
        model.train()
        optimizer, optimizer_kind = _optimizer(model)
        vocab = model.config.vocab_size
        info = {"parameters": model.num_parameters(), "layers": model.config.layer_kinds(),
                "optimizer": optimizer_kind,
                "memory_model": {mode: memory_model(model, dtype, chunk_size, mode == "seco_offload",
                                                    rng_bytes_per_chunk=rng_bytes(device))
                                 for mode in ("seco", "seco_offload")},
                "boundary_bytes": boundary_bytes(model, dtype)}
        has_kv = info["memory_model"]["seco"]["kv"] > 0
        # the startup check of the SeCO callback, on this model, in the benchmark's precision, on
        # two chunks (its float64 comparison of whole logits is large for a 248k vocabulary)
        check_tokens = min(2 * chunk_size, max(lengths))
        try:
            with _autocast(device, autocast_dtype):
                errors = check_chunked_forward(model, make_batch(vocab, check_tokens, device, seed), chunk_size,
                                               tokens=check_tokens)
            info["check"] = {"ok": True, "tokens": check_tokens, "max_rel_err": max(errors)}
        except SeCOError as error:
            info["check"] = {"ok": False, "tokens": check_tokens, "error": str(error)[:500]}
        except torch.OutOfMemoryError:
            info["check"] = {"ok": False, "tokens": check_tokens, "error": "out of memory"}
        _free(device)
        # warm-up: every mode once at a short length (kernels compiled, AdamW states allocated),
        # long enough that SeCO meets every prefix-block length it will use (chunk, 2 chunks, ...,
        # block_size): each new block length compiles flex_attention
        warm = min(max(2 * chunk_size, (block_size or chunk_size) + chunk_size), max(lengths))
        info["warmup_tokens"] = warm
        for mode in dict.fromkeys(m for _, m in todo):
            try:
                train_step(model, optimizer, make_batch(vocab, warm, device, seed), mode, chunk_size, device,
                           autocast_dtype, block_size, loss_slice)
            except (torch.OutOfMemoryError, SeCOError) as error:
                log(f"{spec}: warm-up of {mode} failed: {type(error).__name__}")
        model.zero_grad(set_to_none=True)
        _free(device)
        result["recipes"][spec] = info
        log(f"{spec}: {info['parameters']:,} parameters, check {info['check']}, "
            f"memory model {info['memory_model']['seco']}")

        reference: dict[int, tuple[str, list[torch.Tensor]]] = {}
        for tokens, mode in todo:
            row = {**fields, "mode": mode, "tokens": tokens,
                   **({"ce_slice": loss_slice or chunk_size} if mode == "full" else {}),
                   "model_flops": step_flops(model, tokens),
                   "predicted_bytes_per_token": info["memory_model"].get(mode, {}).get("device")}
            earlier = sorted((r for r in rows if setting(r) == setting(row) and r["tokens"] < tokens
                              and r["status"] != "ok"), key=lambda r: r["tokens"])
            predicted_s = _predict_seconds(rows, row, has_kv)
            if earlier and earlier[-1]["status"] in ("did not fit", "refused"):
                row.update(status=earlier[-1]["status"], note=f"a shorter length ({earlier[-1]['tokens']}) already "
                                                              f"{earlier[-1]['status']}; not run")
            elif earlier and earlier[-1]["status"] == "skipped":
                row.update(status="skipped", note=f"a shorter length ({earlier[-1]['tokens']}) was skipped")
            elif max_step_s and predicted_s is not None and predicted_s > max_step_s:
                row.update(status="skipped", note=f"predicted {predicted_s:.0f} s > --max-step-s {max_step_s:g}")
            else:
                if mode == "seco_offload":
                    row["host_bytes"] = offload_bytes(model, 1, tokens, math.ceil(tokens / chunk_size), dtype)
                failure = None
                try:
                    batch = make_batch(vocab, tokens, device, seed + tokens)
                    wall = time.perf_counter()
                    # a long step (1M tokens: minutes) logs its stage and chunk every 30 s, so a run
                    # cut short still shows how far it got
                    progress = ProgressLog(30.0, lambda line, tag=f"{spec} {mode} {tokens}": log(f"{tag}: {line}"))
                    row.update(train_step(model, optimizer, batch, mode, chunk_size, device, autocast_dtype,
                                          block_size, loss_slice, progress))
                    row["wall_s"] = time.perf_counter() - wall
                    row["status"] = "ok"
                    row["us_per_token"] = row["step_s"] / tokens * 1e6
                    if row["peak_bytes"] is not None:
                        row["peak_gib"] = row["peak_bytes"] / 2**30
                    if grad_check:
                        if tokens in reference:
                            row["grad_rel_err"] = _grad_rel_err(model, reference[tokens][1])
                            row["grad_rel_err_vs"] = reference[tokens][0]
                        else:
                            reference = {tokens: (mode, _grads(model))}  # keep one length's grads
                except torch.OutOfMemoryError as error:
                    failure = ("did not fit", f"out of memory: {str(error).splitlines()[0][:200]}")
                except SeCOOffloadError as error:
                    failure = ("refused", str(error)[:400])
                except Exception as error:  # one broken configuration must not stop the run
                    traceback.print_exc()
                    failure = ("error", f"{type(error).__name__}: {error}"[:400])
                if failure is not None:
                    row["status"], row["note"] = failure
                batch = None
                model.zero_grad(set_to_none=True)
                _free(device)
            if predicted_s is not None:
                row["predicted_s"] = predicted_s
            rows.append(row)
            log(json.dumps(row))
            write()
        del model, optimizer, reference
        _free(device)
    write()
    return result


# ---- summary --------------------------------------------------------------------------------------------
def _labels(rows: list[dict], spec: str) -> dict[tuple, str]:
    """A name per SeCO setting ``(chunk_size, loss_slice, flash_backward)`` of ``spec``'s rows: the
    recipe alone when its SeCO rows share one setting, else the recipe and the setting."""
    found = sorted({setting(r)[2:] for r in rows if r["recipe"] == spec and r["mode"] != "full"},
                   key=lambda s: (s[0], s[1] or 0, s[2]))
    if len(found) <= 1:
        return {key: spec for key in found}
    return {key: f"{spec} [chunk {key[0]}, loss_slice {key[1]}, {'flash' if key[2] else 'triton'} backward]"
            for key in found}


def summarize(result: dict) -> dict:
    """Per recipe, SeCO setting (see :func:`_labels`) and mode, the fitted memory growth per token
    against the memory model; per setting and length, SeCO / full backprop time ratios (full
    backprop's rows of the recipe, whatever their chunk); the 1M-token target, literally (time per
    token) and per unit of work (time per :func:`step_flops` FLOP, where the rows have it)."""
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    on_cpu = result["meta"].get("device_memory_bytes") is None
    measured = "growth_bytes" if on_cpu else "peak_bytes"
    fits, ratios, target = {}, {}, {}

    def fit_rows(name: str, mine: list[dict], model: dict | None) -> None:
        points = [(r["tokens"], r[measured]) for r in mine if r.get(measured) is not None]
        if len({t for t, _ in points}) < 2:
            return
        slope, intercept = fit_line([t for t, _ in points], [b for _, b in points])
        fit = {"tokens": [t for t, _ in points], "bytes_per_token": slope, "intercept_bytes": intercept,
               "fitted": measured}
        if model is not None:
            # on the CPU, host memory (offloaded stores, RNG states) is the measured memory
            predicted = model["device"] + (model["host"] if on_cpu else 0)
            fit["predicted_bytes_per_token"] = predicted
            fit["measured_over_predicted"] = slope / predicted if predicted else None
            fit["kv_formula_bytes_per_token"] = model["kv_formula"]
            fit["measured_over_kv_formula"] = slope / model["kv_formula"] if model["kv_formula"] else None
        fits[name] = fit

    for spec, info in result["recipes"].items():
        full = {r["tokens"]: r for r in rows if r["recipe"] == spec and r["mode"] == "full"}  # the last per length
        fit_rows(f"{spec}/full", sorted(full.values(), key=lambda r: r["tokens"]), None)
        for key, label in _labels(rows, spec).items():
            mine = [r for r in rows if r["recipe"] == spec and r["mode"] != "full" and setting(r)[2:] == key]
            for mode in ("seco", "seco_offload"):
                of_mode = sorted((r for r in mine if r["mode"] == mode), key=lambda r: r["tokens"])
                fit_rows(f"{label}/{mode}", of_mode, info["memory_model"].get(mode))
            by_length: dict[int, dict[str, dict]] = {}
            for r in mine:
                by_length.setdefault(r["tokens"], {})[r["mode"]] = r
            for tokens in by_length:
                if tokens in full:
                    by_length[tokens]["full"] = full[tokens]
            times = {t: {m: r["step_s"] for m, r in modes.items()} for t, modes in by_length.items()}
            ratios[label] = {str(t): {f"{m}_over_full": ts[m] / ts["full"]
                                      for m in ("seco", "seco_offload") if m in ts and "full" in ts}
                             | ({"offload_over_seco": ts["seco_offload"] / ts["seco"]}
                                if "seco" in ts and "seco_offload" in ts else {})
                             for t, ts in sorted(times.items()) if "seco" in ts or "seco_offload" in ts}
            seco = [r for r in mine if r["mode"] == "seco"]
            if not seco:
                continue
            longest = max(seco, key=lambda r: r["tokens"])
            entry = {"seco_longest_tokens": longest["tokens"], "seco_us_per_token": longest["us_per_token"],
                     "target_tokens": TARGET_TOKENS, "fits_target_tokens": longest["tokens"] >= TARGET_TOKENS}
            if full:
                base = full[max(full)]
                entry.update(full_longest_tokens=base["tokens"], full_us_per_token=base["us_per_token"],
                             time_per_token_ratio=longest["us_per_token"] / base["us_per_token"])
                entry["meets_target"] = entry["fits_target_tokens"] and entry["time_per_token_ratio"] <= TARGET_TIME_RATIO
                both = [t for t, ts in times.items() if "seco" in ts and "full" in ts]
                if both:
                    entry["same_length_tokens"] = max(both)
                    entry["same_length_ratio"] = times[max(both)]["seco"] / times[max(both)]["full"]
                if longest.get("model_flops") and base.get("model_flops"):
                    entry["seco_model_tflops"] = longest["model_flops"] / longest["step_s"] / 1e12
                    entry["full_model_tflops"] = base["model_flops"] / base["step_s"] / 1e12
                    entry["work_normalized_ratio"] = entry["full_model_tflops"] / entry["seco_model_tflops"]
                    entry["meets_target_work_normalized"] = (entry["fits_target_tokens"]
                                                             and entry["work_normalized_ratio"] <= TARGET_TIME_RATIO)
                entry["note"] = ("time_per_token_ratio: SeCO's time per token at its longest length over full "
                                 "backprop's at the longest length full backprop fits; with attention layers "
                                 "their quadratic cost makes it larger than same_length_ratio. "
                                 "work_normalized_ratio: the same with time per model FLOP (step_flops: linear "
                                 "layers and attention, SeCO's recomputation not counted) instead of per token")
            target[label] = entry
    return {"memory_fits": fits, "time_ratios": ratios, "target": target}


def _tokens_label(tokens: int) -> str:
    """1048576 -> "1M", 32768 -> "32k", 1000 -> "1000"."""
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if tokens >= size and tokens % (size // 8) == 0:
            return f"{tokens / size:g}{unit}"
    return str(tokens)


# ---- plot ----------------------------------------------------------------------------------------------
def plot(result: dict, path: str | Path) -> Path | None:
    """Peak memory (GiB) against tokens per recipe: SeCO, SeCO + offload, full backprop, the memory
    model's SeCO lines (dashed) and the device's memory; out-of-memory rows as crosses at the top."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed; rerun with --plot-only on a machine that has it")
        return None
    on_cpu = result["meta"].get("device_memory_bytes") is None
    measured = "growth_bytes" if on_cpu else "peak_bytes"
    capacity = result["meta"].get("device_memory_bytes")
    specs = list(result["recipes"])
    if not specs:
        return None
    fig, axes = plt.subplots(1, len(specs), figsize=(9.5 * len(specs), 4.8), squeeze=False)
    labels = {"seco": "SeCO", "seco_offload": "SeCO + kv_offload", "full": "full backprop"}
    colors = {"seco": "tab:blue", "seco_offload": "tab:green", "full": "tab:red"}
    for ax, spec in zip(axes[0], specs):
        info = result["recipes"][spec]
        top = capacity / 2**30 if capacity else None
        # one line per mode and SeCO setting (chunk, loss slice, attention backward)
        names = _labels(result["rows"], spec)
        series = [("full", None)] + [(mode, key) for key in names for mode in ("seco", "seco_offload")]
        styles = ["o-", "s-", "^-", "v-", "D-"]
        for mode, key in series:
            mine = sorted((r for r in result["rows"] if r["recipe"] == spec and r["mode"] == mode
                           and (key is None or setting(r)[2:] == key)), key=lambda r: r["tokens"])
            name = labels[mode] + ("" if key is None or len(names) == 1 else names[key].removeprefix(spec))
            style = styles[0 if key is None else list(names).index(key) % len(styles)]
            ok = [r for r in mine if r["status"] == "ok" and r.get(measured) is not None]
            if ok:
                xs, ys = [r["tokens"] for r in ok], [r[measured] / 2**30 for r in ok]
                ax.plot(xs, ys, style, color=colors[mode], label=name)
                if mode in info["memory_model"]:
                    model = info["memory_model"][mode]
                    slope = model["device"] + (model["host"] if on_cpu else 0)
                    ax.plot(xs, [ys[0] + slope * (x - xs[0]) / 2**30 for x in xs], "--", color=colors[mode],
                            alpha=0.6, label=f"{name}: K/V model ({slope / 1024:.1f} KiB/token)")
            fitted = {r["tokens"] for r in ok}  # a length may have fitted in another setting
            failed = [r["tokens"] for r in mine if r["status"] == "did not fit" and r["tokens"] not in fitted]
            if failed and top:
                ax.plot(failed, [top] * len(failed), "x", color=colors[mode], markersize=10,
                        label=f"{name}: did not fit")
        if top:
            ax.axhline(top, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["tokens"] for r in result["rows"] if r["recipe"] == spec})
        ax.set_xticks(ticks, [_tokens_label(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("tokens in the sequence (batch 1)")
        ax.set_ylabel("peak memory, GiB" + (" (allocated in the step)" if on_cpu else ""))
        ax.set_title(f"{spec} ({info['parameters'] / 1e6:.3g}M parameters)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    meta = result["meta"]
    fig.suptitle(f"SeCO one training step, {meta['device']}, chunk {meta['settings'].get('chunk_size')}, "
                 f"fp32 weights + {meta['settings'].get('dtype')} autocast", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_summary(result: dict) -> None:
    print(f"\n{'recipe':24s} {'mode':13s} {'tokens':>8s} {'status':12s} {'step s':>8s} {'optim s':>8s} "
          f"{'peak GiB':>9s} {'us/token':>9s} {'grad err':>9s}")
    for r in result["rows"]:
        peak = r.get("peak_bytes") or r.get("growth_bytes")  # growth: the CPU's in-step allocations
        peak = None if peak is None else peak / 2**30
        cells = [f"{r[k]:.3f}" if isinstance(r.get(k), float) else "-" for k in ("step_s", "optim_s")]
        print(f"{r['recipe'][:24]:24s} {r['mode']:13s} {r['tokens']:8d} {r['status']:12s} {cells[0]:>8s} "
              f"{cells[1]:>8s} {'-' if peak is None else f'{peak:.3f}':>9s} "
              f"{r['us_per_token'] if 'us_per_token' in r else float('nan'):9.2f} "
              f"{r.get('grad_rel_err', float('nan')):9.1e}")
    for name, fit in result["summary"]["memory_fits"].items():
        predicted = fit.get("predicted_bytes_per_token")
        print(f"memory growth {name}: {fit['bytes_per_token']:.0f} B/token measured"
              + (f", {predicted:.0f} predicted (ratio {fit['measured_over_predicted']:.2f})" if predicted else ""))
    for spec, entry in result["summary"]["target"].items():
        print(f"target {spec}: {entry}")


# ---- command line -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks seco", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default=None, help=f"comma-separated recipe names / YAML paths "
                                                        f"(default {DEFAULT_RECIPES})")
    parser.add_argument("--lengths", default=None, help=f"comma-separated token counts, k = 1024, M = 2**20 "
                                                        f"(default {DEFAULT_LENGTHS})")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    parser.add_argument("--chunk-size", type=int, default=None, help="SeCO chunk size, also full backprop's "
                                                                     "cross-entropy slices (default 4096)")
    parser.add_argument("--loss-slice", type=int, default=LOSS_SLICE,
                        help=f"SeCO's loss_slice: tokens of logits at a time (default {LOSS_SLICE}; 0 = the whole chunk)")
    parser.add_argument("--triton-prefix-backward", action="store_true",
                        help="SeCO's attention backward on CUDA by hybridzoo's Triton prefix backward "
                             "(hybridzoo.layers.prefix_attention; same as HYBRIDZOO_SECO_FLASH=0) instead of "
                             "PyTorch's flash backward per block (chunk_attention, the default)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="K/V prefix positions per attention call in SeCO (default: the chunk size); larger "
                             "blocks mean fewer calls at long lengths")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="autocast dtype (fp32 = no autocast)")
    parser.add_argument("--fp32-matmul", choices=("highest", "high", "medium"), default="high",
                        help="torch.set_float32_matmul_precision (high = TF32)")
    parser.add_argument("--out", default=None, help="JSON results, rewritten after every row "
                                                    "(default benchmarks/results/<date>-seco.json)")
    parser.add_argument("--plot", default=None, help="PNG plot path (default: --out with .png)")
    parser.add_argument("--resume", action="store_true", help="keep the finished rows of --out and run the rest")
    parser.add_argument("--max-step-s", type=float, default=540.0,
                        help="skip a row whose time, extrapolated from shorter lengths, exceeds this (0 = never)")
    parser.add_argument("--no-grad-check", action="store_true", help="do not compare gradients between modes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help=f"tiny models on the CPU ({', '.join(SMOKE_RECIPES)}), lengths {SMOKE_LENGTHS}, "
                             f"chunk {SMOKE_CHUNK}: every code path in < 60 s")
    parser.add_argument("--plot-only", metavar="JSON", default=None, help="only redraw the plot of a results file")
    args = parser.parse_args(argv)

    if args.plot_only:
        result = json.loads(Path(args.plot_only).read_text())
        path = plot(result, args.plot or Path(args.plot_only).with_suffix(".png"))
        print(f"wrote {path}" if path else "no plot written")
        return 0

    if args.cpu_smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # tiny ops: one thread is fastest, and steady on a shared CPU
        recipes = args.recipes or ",".join(SMOKE_RECIPES)
        lengths = args.lengths or SMOKE_LENGTHS
        chunk_size = args.chunk_size or SMOKE_CHUNK
        out = args.out or "/tmp/hybridzoo-bench-seco-smoke.json"
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: use --cpu-smoke on a CPU")
        device = torch.device("cuda")
        recipes = args.recipes or DEFAULT_RECIPES
        lengths = args.lengths or DEFAULT_LENGTHS
        chunk_size = args.chunk_size or 4096
        out = args.out or f"benchmarks/results/{datetime.date.today()}-seco.json"
    torch.set_float32_matmul_precision(args.fp32_matmul)
    if args.triton_prefix_backward:
        chunk_attention.FLASH_ON_CUDA = False
    recipes = [r.strip() for r in recipes.split(",") if r.strip()]
    lengths = sorted({parse_tokens(t) for t in lengths.split(",") if t.strip()})
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    settings = {"recipes": recipes, "lengths": lengths, "modes": modes, "chunk_size": chunk_size,
                "block_size": args.block_size or chunk_size, "loss_slice": args.loss_slice or None,
                "dtype": args.dtype, "cpu_smoke": args.cpu_smoke}
    start = time.perf_counter()
    result = benchmark(recipes, lengths, modes, chunk_size, device, out,
                       autocast_dtype=torch.bfloat16 if args.dtype == "bf16" else None,
                       max_step_s=args.max_step_s, grad_check=not args.no_grad_check, resume=args.resume,
                       seed=args.seed, args_for_meta=settings, block_size=args.block_size,
                       loss_slice=args.loss_slice or None)
    print_summary(result)
    try:
        path = plot(result, args.plot or Path(out).with_suffix(".png"))
        if path:
            print(f"wrote {path}")
    except Exception:  # a broken plot must not lose the run: the JSON is written
        traceback.print_exc()
    print(f"wrote {out} ({time.perf_counter() - start:.1f} s)")
    return 0

