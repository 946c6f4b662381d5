"""Registers, spills and shared memory of our Triton kernels on sm_90 (H100 / H200), with no GPU.

Each kernel is compiled for ``GPUTarget("cuda", 90, 32)`` at the benchmark shapes and its PTX is
assembled by the ``ptxas`` that ships with Triton (``ptxas -v``), which reports registers per
thread, spill stores/loads and stack; Triton reports the shared memory. A kernel that spills
kilobytes per thread is slow whatever else is right: this is how the exact-fp32 (``ieee``) dots
of the delta rule's state kernels were seen to spill 15 KB per thread (they ran 30x too slow).

    python scripts/kernel_resources.py            # the table below, about a minute on one core
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hybridzoo.kernels.triton.delta_rule as delta_rule  # noqa: E402
import hybridzoo.kernels.triton.delta_rule_bwd as delta_rule_bwd  # noqa: E402
import hybridzoo.kernels.triton.linear_attn as linear_attn  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def resources(kernel, types: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3) -> dict:
    """Compile ``kernel`` for sm_90; ``types`` gives every runtime argument's Triton type
    (``"*bf16"``, ``"*fp32"``, ``"i32"``, ``"fp32"``), ``constexprs`` the rest."""
    signature = {name: "constexpr" if name in constexprs else types[name] for name in kernel.arg_names}
    source = ASTSource(kernel, signature,
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        log = subprocess.run([str(PTXAS), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, log)) else None  # noqa: E731
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame"),
            "shared": compiled.metadata.shared}


def cases():
    """(name, kernel, types, constexprs, warps, stages) at the benchmark shapes (K 128, V 256 for
    the delta rule as in gated-deltanet-340m; K = V = 128 for linear attention)."""
    for dt, prec in (("bf16", "tf32"), ("fp32", "ieee")):
        ptr = f"*{dt}"
        cfg = dict(H=6, G=1, K=128, V=256, C=64, BK=128, BV=64, PREC=prec)
        warps, stages = 8, 1  # delta_rule._Config for BK = 128
        yield (f"delta_rule _state_fwd_kernel {dt}", delta_rule._state_fwd_kernel,
               {"k_ptr": ptr, **{n: "*fp32" for n in ("w_ptr", "u_ptr", "la_ptr", "h0_ptr", "h_ptr", "vn_ptr",
                                                      "ht_ptr")}, "T": "i32", "N": "i32"},
               dict(cfg, HAS_H0=False, N_INTERP=0), warps, stages)
        yield (f"delta_rule _state_bwd_kernel {dt}", delta_rule_bwd._state_bwd_kernel,
               {"q_ptr": ptr, "k_ptr": ptr, "do_ptr": ptr, **{n: "*fp32" for n in (
                   "w_ptr", "la_ptr", "dv_ptr", "dht_ptr", "dh_ptr", "dh0_ptr")}, "scale": "fp32", "T": "i32",
                "N": "i32"},
               dict(cfg, HAS_DHT=False, N_INTERP=0), warps, stages)
        la = dict(H=16, HK=16, K=128, V=128, C=64, BK=64, BV=64, DECAY=1, PREC=prec)
        yield (f"linear_attn _fwd_h_kernel {dt}", linear_attn._fwd_h_kernel,
               {"k": ptr, "v": ptr, "b": "*fp32", "h": "*fp32", "h0": "*fp32", "hT": "*fp32", "T": "i32",
                "NT": "i32"},
               dict(la, HAS_H0=False, STORE_H=True, STORE_HT=False, NT_LOOP=0), 4, 3)
        yield (f"linear_attn _fwd_o_kernel {dt}", linear_attn._fwd_o_kernel,
               {"q": ptr, "k": ptr, "v": ptr, "b": "*fp32", "h": "*fp32", "A": "*fp32", "o": ptr,
                "scale": "fp32", "T": "i32", "NT": "i32"}, la, 4, 3)


def main() -> int:
    print(f"{'kernel':42s} {'warps':>5s} {'regs':>5s} {'spill st':>9s} {'spill ld':>9s} {'stack':>6s} {'shared':>7s}")
    for name, kernel, types, constexprs, warps, stages in cases():
        try:
            r = resources(kernel, types, constexprs, warps, stages)
        except Exception as error:  # one kernel failing to compile must not hide the others
            print(f"{name:42s} error: {type(error).__name__}: {str(error)[:120]}")
            continue
        print(f"{name:42s} {warps:5d} {r['registers']!s:>5s} {r['spill_stores']!s:>9s} {r['spill_loads']!s:>9s} "
              f"{r['stack']!s:>6s} {r['shared']:7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
