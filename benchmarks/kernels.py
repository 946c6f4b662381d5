"""Kernels: our Triton kernels beside fla / mamba_ssm (GPU); --cpu: reference delta rule vs transformers.

GPU (the default): each row times forward and forward+backward of ours (autotuned, and with the
fixed launch settings: ``ours_fixed``) and of the anchor in the same process (bf16 inputs, fp32
decays, medians of ``triton.testing.do_bench``), with the ratio ours/anchor, the HBM byte floor
of the forward (inputs read once + output written once over the measured copy bandwidth) and the
relative error of our output against the anchor's. Prints a table last; writes JSON to --out
after every row.

    python -m benchmarks kernels --out results/kernels.json [--only delta,per-key] [--append] [--no-anchor]

``--no-anchor`` times our side only (no anchor timing or autotuning): an A/B of our own settings.

fla's and mamba_ssm's autotuners take minutes on an empty cache. Their choices are cached with
Triton's compiled kernels (``TRITON_CACHE_AUTOTUNING=1`` unless set), ``--all-compile-threads N``
compiles every autotuner's candidates on N threads before it times them (the anchors' too:
``benchmarks/precompile.py``; the timings after tuning do not change), and ``--resume`` keeps the
rows already in ``--out`` and skips the cases they finished, so a table cut by a time limit is
completed by running the same command again:

    python -m benchmarks kernels --out results/kernels.json --all-compile-threads 8 --resume

``--cpu``: the gated delta rule, forward + backward in float32 (B1 T2048 H4 D64, chunk 64), our
reference ``chunk_delta_rule`` against transformers' ``torch_chunk_gated_delta_rule`` (called
unwrapped: the module-level name dispatches to fla when fla is installed), runs interleaved,
medians after warm-up. Needs transformers.

    python -m benchmarks kernels --cpu --out results/cpu-delta-rule.json [--runs 5 --seq-len 2048]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # before Triton is imported: keep autotuning results

import torch  # noqa: E402

import hybridzoo.kernels as K  # noqa: E402
from benchmarks.fla_backward import allow_fla_gated_backward  # noqa: E402
from benchmarks.meta import run_metadata, write_json  # noqa: E402
from benchmarks.precompile import add_compile_threads_argument, every_autotuner_precompiled  # noqa: E402
from benchmarks.transformers_torch_path import torch_function  # noqa: E402
from hybridzoo.kernels.reference.delta_rule import chunk_delta_rule  # noqa: E402
from hybridzoo.utils import rel_err  # noqa: E402

DEV = "cuda"


def fwd_bwd_step(fn, grads, inputs):
    """A closure running one forward (``fn()``) + backward (with ``grads``), then clearing the
    ``.grad`` of ``inputs``."""
    def step():
        out = fn()
        torch.autograd.backward(out, grads)
        for x in inputs:
            x.grad = None

    return step


def bench(fn, grads=None, inputs=()):
    """(fwd ms, fwd+bwd ms) medians; fwd+bwd only when grads is given."""
    from triton.testing import do_bench

    with torch.no_grad():
        fwd = do_bench(fn, warmup=25, rep=100)
    if grads is None:
        return fwd, None
    return fwd, do_bench(fwd_bwd_step(fn, grads, inputs), warmup=25, rep=100)


def copy_bandwidth() -> float:
    from triton.testing import do_bench

    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=10, rep=50)
    return 2 * x.numel() / (ms * 1e-3)  # bytes read + written per second


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def rand(*shape, dtype=torch.bfloat16, requires_grad=True, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype).requires_grad_(requires_grad)


def case_linear_attn(B, T, H, D, per_key, V=None):
    from fla.ops.gla import chunk_gla
    from fla.ops.simple_gla import chunk_simple_gla

    allow_fla_gated_backward()
    V = V or D
    q, k, v = rand(B, T, H, D), rand(B, T, H, D), rand(B, T, H, V)
    shape = (B, T, H, D) if per_key else (B, T, H)
    log_a = (-torch.rand(*shape, device=DEV) * 0.1).requires_grad_(True)
    do = torch.randn(B, T, H, V, device=DEV, dtype=torch.bfloat16)
    ours = lambda: K.chunk_linear_attn(q, k, v, log_a, backend="triton")[0]  # noqa: E731
    anchor_fn = chunk_gla if per_key else chunk_simple_gla
    anchor = lambda: anchor_fn(q, k, v, log_a)[0]  # noqa: E731
    return ours, anchor, (do,), (q, k, v, log_a), nbytes(q, k, v, log_a) + nbytes(do)


def case_delta_rule(B, T, H, D, V=None):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    allow_fla_gated_backward()
    V = V or D
    q, v = rand(B, T, H, D), rand(B, T, H, V)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=DEV), dim=-1).to(torch.bfloat16).requires_grad_(True)
    log_a = (-torch.rand(B, T, H, device=DEV) * 0.1).requires_grad_(True)
    beta = torch.rand(B, T, H, device=DEV).to(torch.bfloat16).requires_grad_(True)
    do = torch.randn(B, T, H, V, device=DEV, dtype=torch.bfloat16)
    ours = lambda: K.chunk_delta_rule(q, k, v, log_a, beta, backend="triton")[0]  # noqa: E731
    anchor = lambda: chunk_gated_delta_rule(q, k, v, log_a, beta)[0]  # noqa: E731
    return ours, anchor, (do,), (q, k, v, log_a, beta), nbytes(q, k, v, log_a, beta, do)


def case_ssd(B, T, H, P, N, G, chunk):
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    x = rand(B, T, H, P)
    dt = (torch.rand(B, T, H, device=DEV) * 0.1 + 0.01).requires_grad_(True)
    A = (-torch.rand(H, device=DEV) - 0.5).requires_grad_(True)
    Bm, Cm = rand(B, T, G, N), rand(B, T, G, N)
    do = torch.randn(B, T, H, P, device=DEV, dtype=torch.bfloat16)

    def ours():  # SSD as chunk_linear_attn: q = C, k = B, v = dt x, log_a = dt A
        v = (x * dt[..., None]).to(x.dtype)
        return K.chunk_linear_attn(Cm, Bm, v, dt * A, scale=1.0, chunk_size=chunk, backend="triton")[0]

    anchor = lambda: mamba_chunk_scan_combined(x, dt, A, Bm, Cm, chunk_size=chunk)  # noqa: E731
    return ours, anchor, (do,), (x, dt, A, Bm, Cm), nbytes(x, dt, Bm, Cm, do)


def case_selective_scan(B, T, Dm, N):
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

    u, z = rand(B, T, Dm), rand(B, T, Dm)
    delta = rand(B, T, Dm, scale=0.5)
    A = (-torch.rand(Dm, N, device=DEV) - 0.5).requires_grad_(True)
    Bm, Cm = rand(B, T, N), rand(B, T, N)
    D = torch.randn(Dm, device=DEV).requires_grad_(True)
    bias = (torch.randn(Dm, device=DEV) * 0.1).requires_grad_(True)
    do = torch.randn(B, T, Dm, device=DEV, dtype=torch.bfloat16)
    ours = lambda: K.selective_scan(u, delta, A, Bm, Cm, D, z, bias, True, backend="triton")[0]  # noqa: E731

    def anchor():
        t = lambda x: x.transpose(1, 2)  # noqa: E731  (mamba_ssm is channel-first [B, D, L])
        return t(selective_scan_fn(t(u), t(delta), A, t(Bm), t(Cm), D=D, z=t(z), delta_bias=bias,
                                   delta_softplus=True))

    return ours, anchor, (do,), (u, delta, A, Bm, Cm, D, z, bias), nbytes(u, z, delta, Bm, Cm, do)


def case_conv(B, T, Dm, W):
    from causal_conv1d import causal_conv1d_fn

    x = rand(B, T, Dm)
    weight = (torch.randn(Dm, W, device=DEV) * 0.5).to(torch.bfloat16).requires_grad_(True)
    bias = torch.randn(Dm, device=DEV).to(torch.bfloat16).requires_grad_(True)
    do = torch.randn(B, T, Dm, device=DEV, dtype=torch.bfloat16)
    ours = lambda: K.causal_conv1d(x, weight, bias, activation="silu", backend="triton")[0]  # noqa: E731
    # causal_conv1d is channel-first [B, D, L]; a channel-last view of our layout is what it reads fastest
    anchor = lambda: causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation="silu").transpose(1, 2)  # noqa: E731
    return ours, anchor, (do,), (x, weight, bias), nbytes(x, weight, bias, do)


CASES = [
    ("chunk_linear_attn scalar vs fla chunk_simple_gla*", "B2 T16384 H16 D128", lambda: case_linear_attn(2, 16384, 16, 128, False)),
    ("chunk_linear_attn scalar vs fla chunk_simple_gla*", "B8 T4096 H16 D128", lambda: case_linear_attn(8, 4096, 16, 128, False)),
    ("chunk_linear_attn per-key vs fla chunk_gla", "B2 T16384 H16 D128", lambda: case_linear_attn(2, 16384, 16, 128, True)),
    ("chunk_linear_attn per-key vs fla chunk_gla", "B8 T4096 H16 D128", lambda: case_linear_attn(8, 4096, 16, 128, True)),
    ("chunk_delta_rule vs fla chunk_gated_delta_rule*", "B2 T16384 H16 D128", lambda: case_delta_rule(2, 16384, 16, 128)),
    ("chunk_delta_rule vs fla chunk_gated_delta_rule*", "B8 T4096 H16 D128", lambda: case_delta_rule(8, 4096, 16, 128)),
    ("SSD (chunk_linear_attn) vs mamba_chunk_scan_combined", "B2 T16384 H32 P64 N128 G1 c256", lambda: case_ssd(2, 16384, 32, 64, 128, 1, 256)),
    ("selective_scan vs mamba_ssm selective_scan_fn", "B2 T16384 D2048 N16", lambda: case_selective_scan(2, 16384, 2048, 16)),
    ("causal_conv1d vs causal_conv1d_fn (mamba_ssm's)", "B2 T16384 D4096 W4 silu", lambda: case_conv(2, 16384, 4096, 4)),
    # the packaged recipes' own head shapes, at the model table's B8 T2048
    ("chunk_linear_attn scalar vs fla chunk_simple_gla* (retnet-340m)", "B8 T2048 H4 K256 V512",
     lambda: case_linear_attn(8, 2048, 4, 256, False, V=512)),
    ("chunk_linear_attn per-key vs fla chunk_gla (gla-340m)", "B8 T2048 H4 K128 V256",
     lambda: case_linear_attn(8, 2048, 4, 128, True, V=256)),
    ("chunk_linear_attn scalar vs fla chunk_simple_gla* (retnet-340m)", "B2 T8192 H4 K256 V512",
     lambda: case_linear_attn(2, 8192, 4, 256, False, V=512)),
    ("chunk_linear_attn per-key vs fla chunk_gla (gla-340m)", "B2 T8192 H4 K128 V256",
     lambda: case_linear_attn(2, 8192, 4, 128, True, V=256)),
    ("chunk_delta_rule vs fla chunk_gated_delta_rule* (gated-deltanet-340m)", "B8 T2048 H6 K128 V256",
     lambda: case_delta_rule(8, 2048, 6, 128, V=256)),
    ("chunk_delta_rule vs fla chunk_gated_delta_rule* (qwen35-0.8b)", "B8 T2048 H16 K128 V128",
     lambda: case_delta_rule(8, 2048, 16, 128)),
]


def selected_cases(only: str | None) -> list[tuple]:
    """The :data:`CASES` whose name holds one of the comma-separated substrings ``only`` (None: all)."""
    return [case for case in CASES if not only or any(part in case[0] for part in only.split(","))]


def results_header(bandwidth: float) -> dict:
    """The JSON's fields before ``rows``: date, commit, device, versions, copy bandwidth, notes."""
    meta = run_metadata(("fla", "mamba_ssm", "causal_conv1d"))
    return {
        **meta, "copy_bandwidth_GBps": bandwidth / 1e9, "dtype": "bf16 inputs, fp32 decays",
        "note": "* fla 0.6 gated backward timed with fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True "
                "(its guard bypassed; its gradients may be wrong on this Triton)",
    }


def write_results(path: str, header: dict, rows: list[dict]) -> None:
    write_json(path, {**header, "rows": rows})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks kernels", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--out", default=None, help="JSON results (default benchmarks/results/<date>-kernels.json, "
                        "or <date>-cpu-delta-rule.json with --cpu)")
    parser.add_argument("--cpu", action="store_true", help="the CPU benchmark (reference delta rule vs transformers)")
    parser.add_argument("--only", default=None, help="GPU: comma-separated substrings; run the cases whose name holds one")
    parser.add_argument("--append", action="store_true", help="GPU: keep the rows already in --out (same case and "
                        "shape rows are replaced)")
    parser.add_argument("--resume", action="store_true", help="GPU: keep the rows already in --out and skip "
                        "the cases they finished (a row without an error, with the anchor timed unless "
                        "--no-anchor); the rest run as usual")
    add_compile_threads_argument(parser, "the anchors'")
    parser.add_argument("--no-anchor", action="store_true", help="GPU: time hybridzoo's side only (the anchor "
                        "is built but never run or tuned: a quick A/B of one of our kernel settings)")
    parser.add_argument("--runs", type=int, default=5, help="--cpu: timed runs of each side")
    parser.add_argument("--warmup", type=int, default=1, help="--cpu: untimed runs first")
    parser.add_argument("--seq-len", type=int, default=2048, help="--cpu: T")
    return parser.parse_args(argv)


def finished(row: dict, no_anchor: bool) -> bool:
    """Whether a results row is complete: timed without an error, the anchor too unless ``no_anchor``."""
    if any(key == "error" or key.endswith("_error") for key in row) or not row.get("ours_fwdbwd_ms"):
        return False
    return no_anchor or bool(row.get("anchor_fwdbwd_ms"))


def run_cases(cases: list[tuple], rows: list[dict], args: argparse.Namespace, header: dict,
              bandwidth: float) -> list[dict]:
    """Time each of ``cases`` (see the module docstring), replacing any row of the same case and
    shape in ``rows``; writes ``args.out`` after every side of every row (a job cut by a time limit
    keeps what was measured) and returns the rows."""
    from hybridzoo.kernels.triton import launch

    for name, shape, build in cases:
        rows = [r for r in rows if (r["case"], r["shape"]) != (name, shape)]
        row = {"case": name, "shape": shape}
        try:
            ours, anchor, grads, inputs, floor_bytes = build()
            row["fwd_floor_ms"] = floor_bytes / bandwidth * 1e3
            # ours first, the anchor (whose autotuning can take minutes) last, the row written
            # after each: a job that times out keeps what was measured
            sides = (("ours", ours), ("ours_fixed", ours)) + ((("anchor", anchor),) if not args.no_anchor else ())
            for who, fn in sides:
                try:  # ours_fixed: our kernels with autotuning off (launch.run's fixed settings)
                    launch.AUTOTUNE = who != "ours_fixed"
                    if who == "anchor":
                        with torch.no_grad():
                            row["rel_err_vs_anchor"] = rel_err(ours().float(), anchor().float())
                    row[f"{who}_fwd_ms"], row[f"{who}_fwdbwd_ms"] = bench(fn, grads, inputs)
                except Exception as error:  # one side failing must not hide the other
                    row[f"{who}_error"] = f"{type(error).__name__}: {error}"[:300]
                finally:
                    launch.AUTOTUNE = True
                write_results(args.out, header, rows + [row])
            row["tuned_configs"] = {name: sorted({str(c) for c in tuner.cache.values()})
                                    for name, tuner in launch.TUNED.items() if tuner.cache}
            for tuner in launch.TUNED.values():
                tuner.cache.clear()  # the next case's choices only
            for kind in ("fwd", "fwdbwd"):
                if row.get(f"ours_{kind}_ms") and row.get(f"anchor_{kind}_ms"):
                    row[f"ratio_{kind}"] = row[f"ours_{kind}_ms"] / row[f"anchor_{kind}_ms"]
            if row.get("ours_fwd_ms"):
                row["fwd_over_floor"] = row["ours_fwd_ms"] / row["fwd_floor_ms"]
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"[:300]
            traceback.print_exc()
        rows.append(row)
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        write_results(args.out, header, rows)  # after every row: a timeout keeps the finished ones
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    today = datetime.date.today().isoformat()
    if args.cpu:
        return cpu_delta_rule(args.out or f"benchmarks/results/{today}-cpu-delta-rule.json",
                              args.runs, args.warmup, args.seq_len)
    if not torch.cuda.is_available():
        print("kernels: no CUDA device; use --cpu for the CPU benchmark", file=sys.stderr)
        return 2
    args.out = args.out or f"benchmarks/results/{today}-kernels.json"
    bandwidth = copy_bandwidth()
    header = results_header(bandwidth)
    rows = []
    if (args.append or args.resume) and Path(args.out).is_file():
        earlier = json.loads(Path(args.out).read_text())
        rows = earlier.get("rows", [])
        differ = [key for key in ("commit", "device", "versions") if earlier.get(key) != header.get(key)]
        if args.resume and differ:
            print(f"kernels: --resume: {args.out} was written with another {', '.join(differ)} "
                  f"({', '.join(f'{k}={earlier.get(k)!r}' for k in differ)}); its rows are not this run's. "
                  "Write to a new --out, or use --append to mix them knowingly", file=sys.stderr)
            return 2
    cases = selected_cases(args.only)
    if args.resume:
        done = {(r["case"], r["shape"]) for r in rows if finished(r, args.no_anchor)}
        skipped = [case for case in cases if case[:2] in done]
        cases = [case for case in cases if case[:2] not in done]
        print(f"kernels: --resume: {len(skipped)} case(s) already in {args.out}, {len(cases)} to run", flush=True)
    with every_autotuner_precompiled(args.all_compile_threads):
        rows = run_cases(cases, rows, args, header, bandwidth)
    if not cases:
        write_results(args.out, header, rows)

    def fmt(x):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"

    print(f"\n{'case':72s} {'shape':24s} {'ours fwd':>9s} {'anc fwd':>9s} {'ours f+b':>9s} {'fixed f+b':>9s} {'anc f+b':>9s} {'ratio f+b':>9s} {'floor':>7s} {'err':>8s}")
    for r in rows:
        print(f"{r['case'][:72]:72s} {r['shape'][:24]:24s} {fmt(r.get('ours_fwd_ms')):>9s} {fmt(r.get('anchor_fwd_ms')):>9s} "
              f"{fmt(r.get('ours_fwdbwd_ms')):>9s} {fmt(r.get('ours_fixed_fwdbwd_ms')):>9s} {fmt(r.get('anchor_fwdbwd_ms')):>9s} {fmt(r.get('ratio_fwdbwd')):>9s} "
              f"{fmt(r.get('fwd_floor_ms')):>7s} {r.get('rel_err_vs_anchor', float('nan')):8.1e}"
              + (f"  [{(r.get('error') or r.get('ours_error') or r.get('anchor_error'))[:60]}]"
                 if r.get('error') or r.get('ours_error') or r.get('anchor_error') else ""))
    print(f"wrote {args.out}")
    return 0


# ---- CPU: the reference delta rule beside transformers' --------------------------------------------
def time_fwd_bwd(fn, inputs, grad_out) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    """One forward + backward; returns (seconds, output, input gradients)."""
    for x in inputs:
        x.grad = None
    start = time.perf_counter()
    o = fn(*inputs)
    (o * grad_out).sum().backward()
    elapsed = time.perf_counter() - start
    return elapsed, o.detach(), [x.grad for x in inputs]


def cpu_delta_rule(out: str, runs: int, warmup: int, seq_len: int) -> int:
    """Time the gated delta rule's forward + backward, ours and transformers', interleaved; write JSON."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    theirs_fn = torch_function(modeling_qwen3_next.torch_chunk_gated_delta_rule)  # the pure-PyTorch path

    B, T, H, D, chunk_size = 1, seq_len, 4, 64, 64
    torch.manual_seed(0)
    q = torch.randn(B, T, H, D)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1)
    v = torch.randn(B, T, H, D)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H) + 3.0)  # log decays, mostly near 0
    beta = torch.rand(B, T, H)
    grad_out = torch.randn(B, T, H, D)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]

    def ours(q, k, v, g, beta):
        return chunk_delta_rule(q, k, v, g, beta, chunk_size=chunk_size)[0]

    def theirs(q, k, v, g, beta):
        return theirs_fn(q, k, v, g, beta, chunk_size=chunk_size, use_qk_l2norm_in_kernel=False)[0]

    times: dict[str, list[float]] = {"ours": [], "transformers": []}
    results = {}
    for i in range(warmup + runs):
        for name, fn in (("ours", ours), ("transformers", theirs)):  # interleaved: same noise for both
            elapsed, o, grads = time_fwd_bwd(fn, inputs, grad_out)
            if i >= warmup:
                times[name].append(elapsed)
            results[name] = (o, grads)

    out_err = rel_err(results["ours"][0], results["transformers"][0])
    grad_errs = {n: rel_err(a, b) for n, a, b in
                 zip(("q", "k", "v", "g", "beta"), results["ours"][1], results["transformers"][1])}
    ours_s = statistics.median(times["ours"])
    theirs_s = statistics.median(times["transformers"])
    ratio = theirs_s / ours_s

    print(f"gated delta rule fwd+bwd, float32, B={B} T={T} H={H} D={D} chunk={chunk_size}, "
          f"{torch.get_num_threads()} threads, median of {runs}")
    print(f"  ours (hybridzoo reference chunk_delta_rule): {ours_s * 1e3:8.2f} ms")
    print(f"  transformers torch_chunk_gated_delta_rule:   {theirs_s * 1e3:8.2f} ms")
    print(f"  speed-up (transformers / ours): {ratio:.2f}x")
    print(f"  rel err of outputs {out_err:.2e}; of gradients "
          + ", ".join(f"{n} {e:.1e}" for n, e in grad_errs.items()))

    run = run_metadata(("transformers",))
    record = {
        "benchmark": "cpu-delta-rule",
        "date": run["date"],
        "commit": run["commit"],
        "worktree_dirty": run["dirty"],
        "device": {"cpu": run["device"], "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "versions": run["versions"],
        "op": "gated delta rule, forward + backward (grads to q, k, v, g, beta), float32",
        "shapes": {"B": B, "T": T, "H": H, "K": D, "V": D, "chunk_size": chunk_size},
        "runs": runs,
        "warmup": warmup,
        "ours": {"impl": "hybridzoo.kernels.reference.delta_rule.chunk_delta_rule",
                 "median_s": ours_s, "times_s": times["ours"]},
        "anchor": {"impl": "transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule "
                           "(pure PyTorch, use_qk_l2norm_in_kernel=False, keys L2-normalised by the caller)",
                   "median_s": theirs_s, "times_s": times["transformers"]},
        "ratio_anchor_over_ours": ratio,
        "rel_err_output": out_err,
        "rel_err_grads": grad_errs,
    }
    print(f"wrote {write_json(out, record)}")
    if out_err > 1e-5:
        print(f"outputs disagree: rel err {out_err:.2e}", file=sys.stderr)
        return 1
    return 0


