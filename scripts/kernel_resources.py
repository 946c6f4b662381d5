"""Registers, spills and shared memory of our Triton kernels on sm_90 (H100 / H200), with no GPU.

Each kernel is compiled for ``GPUTarget("cuda", 90, 32)`` at the benchmark shapes and its PTX is
assembled by the ``ptxas`` that ships with Triton (``ptxas -v``), which reports registers per
thread, spill stores/loads and stack; Triton reports the shared memory. A kernel that spills
kilobytes per thread is slow whatever else is right: this is how the exact-fp32 (``ieee``) dots
of the delta rule's state kernels were seen to spill 16-27 KB per thread (they ran ~30x too slow on
an H200), which is why float32 inputs now use 3xTF32 dots.

    python scripts/kernel_resources.py            # the table below, about a minute on one core
    python scripts/kernel_resources.py --all      # every kernel of both ops at the largest head
                                                  # sizes, bf16 and fp32: shared memory must fit
    python scripts/kernel_resources.py --all --varlen   # the delta rule's kernels in their
                                                  # packed-documents form (IS_VARLEN), the same way
    python scripts/kernel_resources.py --spills   # the conv, selective-scan and norm kernels at
                                                  # every launch setting they may run with: no spills
                                                  # (beyond the allowance named in SPILL_ALLOWED)
    python scripts/kernel_resources.py --fingerprint BEFORE.json   # a hash of each kernel's PTX
    python scripts/kernel_resources.py --fingerprint AFTER.json --compare BEFORE.json
    python scripts/kernel_resources.py --loops "selective_scan _bwd"   # SASS of each matching
                                                  # setting's main loop, by instruction class

``--loops PATTERN`` disassembles (the wheel's ``nvdisasm``) every setting of the table, ``--all``
and ``--spills`` whose name contains PATTERN and counts the instructions of its longest loop (the
time-block loop of the scans) by class: FP32 arithmetic, shuffles, special functions (``MUFU``:
exp, reciprocal), global and shared memory, and the rest. Where a kernel is bound by issue
latency rather than bandwidth, as the selective scan's backward is, these counts per tile element
are what a change has to lower.

``--fingerprint`` covers the kernels of the table and of ``--all`` and ``--spills``; line and debug
information is left out of the hash, so a refactor whose kernels all keep their PTX (argument
order, helper extraction, comments) is shown to change no launch on any GPU (``_cols_block``'s arguments were aligned with
``_rows_block``'s this way, with no GPU run).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hybridzoo.kernels.triton.delta_rule as delta_rule  # noqa: E402
import hybridzoo.kernels.triton.delta_rule_bwd as delta_rule_bwd  # noqa: E402
import hybridzoo.kernels.triton.delta_rule_split as delta_rule_split  # noqa: E402
import hybridzoo.kernels.triton.linear_attn as linear_attn  # noqa: E402
import hybridzoo.kernels.triton.linear_attn_common as linear_attn_common  # noqa: E402
from hybridzoo.kernels.triton import launch  # noqa: E402



def sm90_ptxas() -> Path:
    """The ptxas that Triton itself assembles sm_90 code with: Triton 3.9 emits PTX 9.x for
    sm_90 and assembles it with its newer ``ptxas-blackwell`` (its plain ``ptxas``, CUDA 12.9,
    rejects that PTX); Triton 3.6 and 3.7 use ``ptxas``."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(90).path)
    except Exception:  # noqa: BLE001 - an older layout: the wheel's plain ptxas
        return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


PTXAS = sm90_ptxas()


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3):
    """``kernel`` compiled for sm_90; ``types`` gives every runtime argument's Triton type
    (``"*bf16"``, ``"*fp32"``, ``"i32"``, ``"fp32"``), ``constexprs`` the rest; a ``"maxnreg"``
    entry of ``constexprs`` (no kernel argument) caps the registers a thread, as a launch's
    ``maxnreg`` does."""
    constexprs = dict(constexprs)
    maxnreg = constexprs.pop("maxnreg", None)
    signature = {name: "constexpr" if name in constexprs else types[name] for name in kernel.arg_names}
    source = ASTSource(kernel, signature,
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       **({} if maxnreg is None else {"maxnreg": maxnreg})))


def resources(kernel, types: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3) -> dict:
    """Registers, spills, stack and shared memory of ``kernel`` compiled by :func:`compile_sm90`."""
    compiled = compile_sm90(kernel, types, constexprs, num_warps, num_stages)
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
    for dt, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        ptr, prec = f"*{dt}", launch.dot_precision(torch_dtype)  # the precision the ops use
        # the delta rule's own settings (its _Config on shape-only tensors; the state kernels'
        # fixed launch, which the autotuner's candidates vary)
        cfg = delta_rule._Config(torch.empty(1, 1, 6, 128, device="meta", dtype=torch_dtype),
                                 torch.empty(1, 1, 6, 256, device="meta", dtype=torch_dtype), 64).consts()
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        yield (f"delta_rule _state_fwd_kernel {dt}", delta_rule._state_fwd_kernel,
               {"k_ptr": ptr, "w_ptr": ptr, **{n: "*fp32" for n in ("u_ptr", "la_ptr", "h0_ptr", "h_ptr", "vn_ptr",
                                                                     "ht_ptr")}, "T": "i32", "N": "i32",
                "cu_ptr": "*i32", "co_ptr": "*i32"},
               dict(cfg, HAS_H0=False, N_INTERP=0), warps, stages)
        yield (f"delta_rule _state_bwd_kernel {dt}", delta_rule_bwd._state_bwd_kernel,
               {"q_ptr": ptr, "k_ptr": ptr, "do_ptr": ptr, "w_ptr": ptr, **{n: "*fp32" for n in (
                   "la_ptr", "dv_ptr", "dht_ptr", "dh_ptr", "dh0_ptr")}, "scale": "fp32", "T": "i32",
                "N": "i32", "cu_ptr": "*i32", "co_ptr": "*i32"},
               dict(cfg, HAS_DHT=False, N_INTERP=0), warps, stages)
        la = dict(H=16, HK=16, K=128, V=128, C=64, BK=64, BV=64, DECAY=1, PREC=prec)
        yield (f"linear_attn _fwd_h_kernel {dt}", linear_attn._fwd_h_kernel,
               {"k": ptr, "v": ptr, "b": "*fp32", "h": ptr, "h0": "*fp32", "hT": "*fp32", "T": "i32",
                "NT": "i32"},
               dict(la, HAS_H0=False, STORE_H=True, STORE_HT=False, NT_LOOP=0, **not_varlen(linear_attn._fwd_h_kernel)),
               launch.warps(64, 64), 3)
        yield (f"linear_attn _fwd_o_kernel {dt}", linear_attn._fwd_o_kernel,
               {"q": ptr, "k": ptr, "v": ptr, "b": "*fp32", "h": ptr, "A": "*fp32", "o": ptr,
                "scale": "fp32", "T": "i32", "NT": "i32"}, dict(la, **not_varlen(linear_attn._fwd_o_kernel)),
               launch.warps(64, 64), 3)


# the packed-documents (varlen) tables of the linear-attention kernels: int32 pointers in a varlen
# launch, None (constexpr) with IS_VARLEN False, as the ops launch them without cu_seqlens
VARLEN_TABLES = ("cu", "chunk_idx", "chunk_off")


def not_varlen(kernel) -> dict:
    """The constexprs of ``kernel``'s launch without packed documents: IS_VARLEN False, no tables."""
    return {"IS_VARLEN": False, **{p: None for p in VARLEN_TABLES if p in kernel.arg_names}}


INPUTS = {"q", "k", "v", "do", "o", "beta", "dv", "w", "tm"}  # tensors in the inputs' dtype (the rest: float32;
# linear attention also keeps its chunk states h, dh in the inputs' dtype for 16-bit inputs)
SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)


def all_kernels(dtypes: tuple[str, ...] = ("bf16", "fp32"), varlen: bool = False):
    """Every Triton kernel of the linear-attention and delta-rule ops, with the largest head sizes
    the ops take (K = V = 256) and the launch settings the ops use, for bf16 and fp32 inputs
    (``dtypes``: a subset of those); the linear-attention kernels also in their packed-documents
    form (``VARLEN``: IS_VARLEN with int32 chunk tables)."""
    import inspect

    import hybridzoo.kernels.triton.linear_attn_bwd as linear_attn_bwd
    import hybridzoo.kernels.triton.prefix_attention_bwd as prefix_bwd

    for dt, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        if dt not in dtypes:
            continue
        prec = launch.dot_precision(torch_dtype)
        values = dict(H=4, G=2, HK=2, K=256, V=256, KD=256, C=64, BC=16, BK=64, BV=64, BKD=64, BKW=64, NC=4,
                      DECAY=2, PREC=prec, LOG_MIN=linear_attn.LOG_A_MIN, HAS_H0=True, HAS_DHT=True, STORE_H=True,
                      STORE_HT=True, STORE_DG=True, STORE_DH0=True, HAS_TM=False, N_INTERP=0, NT_LOOP=0,
                      D=256, DV=256, BM=64, BN=32, BD=256, BDV=256, NM_LOOP=0, NN_LOOP=0,
                      DIAG_DOT=True, SPAN=linear_attn_common.DIAG_SPAN, IS_VARLEN=varlen)
        # the delta rule's own settings at K = V = 256 (its _Config on shape-only tensors)
        dr = delta_rule._Config(torch.empty(1, 1, 2, 256, device="meta", dtype=torch_dtype),
                                torch.empty(1, 1, 4, 256, device="meta", dtype=torch_dtype), 64)
        la_warps = launch.warps(values["BK"], values["BV"])
        for module, warps, stages in ((linear_attn, la_warps, 3), (linear_attn_bwd, la_warps, 3),
                                      (delta_rule, dr.warps, dr.stages), (prefix_bwd, None, None),
                                      (delta_rule_bwd, dr.warps, dr.stages), (delta_rule_split, None, None)):
            for name, kernel in vars(module).items():
                if (type(kernel).__name__ != "JITFunction" or kernel.__module__ != module.__name__
                        or not name.endswith("_kernel")):
                    continue
                params = inspect.signature(kernel.fn).parameters
                constexprs = {p: values[p] for p in params if "constexpr" in str(params[p].annotation)}
                launch_warps = 4 if name == "_chunk_cumsum_kernel" else warps  # launched with the default
                if name in ("_intra_A_kernel", "_bwd_intra_dqk_kernel"):  # their launchers' own settings
                    launch_warps = 4
                    if name == "_intra_A_kernel":
                        constexprs["BK"] = min(constexprs["BK"], linear_attn_common.INTRA_A_BK)
                if module in (delta_rule, delta_rule_bwd, delta_rule_split):
                    constexprs.update(BK=dr.BK, BV=dr.BV) if "BK" in constexprs else None
                    # the WY and _bwd_qk kernels' own launches, as the op makes them
                    own = {"_wy_fwd_kernel": dr.wy_consts, "_bwd_wy_kernel": dr.wy_consts,
                           "_bwd_qk_kernel": dr.qk_consts}.get(name)
                    if own is not None:
                        consts = own()
                        constexprs.update({k: consts[k] for k in ("BK", "BV", "BKW") if k in constexprs})
                        launch_warps = consts["num_warps"]
                    constexprs = {k: v for k, v in constexprs.items() if k in params}
                tables = [p for p in VARLEN_TABLES if p in params]
                constexprs.update({p: None for p in tables})  # not varlen: None, as the ops pass
                inputs = ({"q", "k", "v", "do"} if module is prefix_bwd
                          else INPUTS | {"h", "dh"} if module in (linear_attn, linear_attn_bwd) else INPUTS)
                if varlen and module not in (delta_rule, delta_rule_bwd, delta_rule_split):
                    continue  # --varlen: the packed-documents (IS_VARLEN) forms of the delta rule's kernels
                types = {p: ("i32" if p in ("T", "N", "NT", "S", "NM", "NN", "stride_kb", "stride_vb")
                             else "*i32" if p in ("cu_ptr", "ci_ptr", "co_ptr")
                             else "fp32" if p == "scale"
                             else f"*{dt}" if p.removesuffix("_ptr") in inputs else "*fp32")
                         for p in params if p not in constexprs}
                if module is delta_rule_bwd and name in ("_dv_local_kernel", "_state_bwd_kernel"):
                    types["dv_ptr"] = "*fp32"  # there dv_ptr is the float32 dVn buffer, not dv
                if module is prefix_bwd:  # the op's own tile choice for 256-wide heads
                    bm, bn, warps, stages = prefix_bwd._tiles(256, 256, torch_dtype)
                    constexprs.update(BM=bm, BN=bn)
                    launch_warps = warps
                label = f"{module.__name__.rsplit('.', 1)[-1]}.{name}" + (" VARLEN" if varlen else "")
                if module is delta_rule_split:  # every candidate the prune keeps at K = 256
                    types["dv_ptr"] = "*fp32"
                    kept = delta_rule_split.prune_split_configs(delta_rule_split.SPLIT_CONFIGS, {}, K=256)
                    for c in kept:
                        yield (f"{label} BV={c.kwargs['BV']} warps={c.num_warps} stages={c.num_stages} {dt}",
                               kernel, types, dict(constexprs, BV=c.kwargs["BV"]), c.num_warps, c.num_stages)
                    continue
                yield f"{label} {dt}", kernel, types, constexprs, launch_warps, stages
                if "IS_VARLEN" in constexprs and module in (linear_attn, linear_attn_bwd):
                    # the linear-attention kernels' packed-documents form too: int32 tables read
                    yield (f"{label} VARLEN {dt}", kernel, dict(types, **{p: "*i32" for p in tables}),
                           {k: v for k, v in dict(constexprs, IS_VARLEN=True).items() if k not in tables},
                           launch_warps, stages)
                if "HAS_TM" in constexprs:  # the backward's variant too: Tm read, not computed
                    yield (f"{label} HAS_TM {dt}", kernel, types, dict(constexprs, HAS_TM=True), launch_warps,
                           stages)


# bytes of spill stores per thread a setting may have: the selective scan's backward candidates
# spill at N = 16 with Triton 3.6 (524, 540, 180 and 236 B; 3.7.1 and 3.9: 0 to 48 B) and stay
# candidates: they are the fastest measured on an H200 with Triton 3.6, spills included
# (benchmarks/results/investigations/2026-12-02-probe-scan-configs-h200.jsonl)
# The narrow backward tiles at N = 64 spill a few tens of bytes (2-wide on 4 warps: 40 B with 3.7.1,
# 68 B with 3.9; 4-wide on 8 warps: 24 and 12 B), where the N = 16 candidates would spill 3.7 to
# 33 KB there (they are pruned at N = 64: selective_scan._fitting). The 4-wide 1-warp backward
# capped at 168 registers spills 436 B (3.7.1; 408 B with 3.9) and is faster where the grid fills
# several waves (selective_scan.BWD_MAXNREG). With the time-segment axis (compiled SEGMENTED, the
# larger of its two forms) the backward holds a little more: capped 444 B (3.7.1) and 464 B (3.9),
# the 4-wide 8-warp tile at N = 64 0 and 92 B (3.9; 32 B before).
SPILL_ALLOWED = {"selective_scan _bwd_kernel BLOCK_T=16 BLOCK_D=4 warps=1": 560,
                 "selective_scan _bwd_kernel BLOCK_T=16 BLOCK_D=4 warps=1 maxnreg=168": 480,
                 "selective_scan _bwd_kernel BLOCK_T=16 BLOCK_D=8 warps=2": 576,
                 "selective_scan _bwd_kernel BLOCK_T=16 BLOCK_D=16 warps=4": 224,
                 "selective_scan _bwd_kernel BLOCK_T=16 BLOCK_D=32 warps=8": 256,
                 "selective_scan _fwd_kernel N=64 BLOCK_D=4 warps=2": 8,
                 # the 8-token backward with its inputs loaded a block ahead: 8 B with Triton 3.9,
                 # none with 3.7.1 (168 registers with both)
                 "selective_scan _bwd_kernel BLOCK_T=8 PREFETCH BLOCK_D=4 warps=1": 16,
                 # with z, dz, B and C read at their own token strides (a slice of a wider tensor):
                 # its 8-wide 2-warp candidate 4 B, and the 4-wide 8-warp tile at N = 64 12 B with
                 # Triton 3.7.1 (none with 3.6 and 3.9)
                 "selective_scan _bwd_kernel BLOCK_T=8 PREFETCH BLOCK_D=8 warps=2": 8,
                 # its 16-wide 4-warp candidate: 4 B with Triton 3.6 (168 registers), none with 3.7.1 and 3.9
                 "selective_scan _bwd_kernel BLOCK_T=8 PREFETCH BLOCK_D=16 warps=4": 8,
                 "selective_scan _bwd_kernel N=64 BLOCK_T=8 BLOCK_D=4 warps=8": 16,
                 # 16-token blocks with the inputs a block ahead (only where BWD_BLOCK_T = 16 and
                 # BWD_PREFETCH = True are set): 8 to 68 B uncapped, 516 and 488 B capped (Triton
                 # 3.7.1, 3.9; 52 B uncapped with 3.6), with the step sizes read as float32
                 # (selective_scan.BWD_DT_GIVEN)
                 "selective_scan _bwd_kernel BLOCK_T=16 PREFETCH BLOCK_D=4 warps=1": 56,
                 "selective_scan _bwd_kernel BLOCK_T=16 PREFETCH BLOCK_D=4 warps=1 maxnreg=168": 576,
                 "selective_scan _bwd_kernel BLOCK_T=16 PREFETCH BLOCK_D=8 warps=2": 72,
                 "selective_scan _bwd_kernel BLOCK_T=16 PREFETCH BLOCK_D=16 warps=4": 64,
                 "selective_scan _bwd_kernel BLOCK_T=16 PREFETCH BLOCK_D=32 warps=8": 48,
                 # the forward's segment pass (run only where SEGMENTS asks for more than one), with
                 # the entering state folded into its first token (selective_scan._block_states): a
                 # 16-byte stack frame at 96 registers with Triton 3.7.1 (12 B), none with 3.6 and 3.9
                 "selective_scan _fwd_carry_kernel BLOCK_D=8 warps=1": 12,
                 "selective_scan _fwd_carry_kernel N=64 BLOCK_D=4 warps=2": 12,
                 # packed documents (VARLEN): the N = 16 backward spilled 4 to 12 B with Triton 3.6
                 "selective_scan _bwd_kernel VARLEN BLOCK_T=8 BLOCK_D=4 warps=1": 16,
                 "selective_scan _bwd_kernel VARLEN BLOCK_T=8 PREFETCH BLOCK_D=4 warps=1": 16}


def elementwise_settings():
    """(name, kernel, types, constexprs, warps, stages) of the conv and selective-scan kernels at
    their benchmark shapes (bf16, silu / softplus, bias, D, z; N = 16) for every launch setting
    they may run with: the fixed one and each autotuning candidate; then :func:`norm_settings`."""
    import importlib

    conv = importlib.import_module("hybridzoo.kernels.triton.conv")
    scan = importlib.import_module("hybridzoo.kernels.triton.selective_scan")
    bf16 = {"x_ptr", "w_ptr", "bias_ptr", "s0_ptr", "dy_ptr", "dx_ptr", "ds0_ptr", "y_ptr", "u_ptr", "delta_ptr",
            "B_ptr", "C_ptr", "z_ptr", "du_ptr", "ddelta_ptr", "dz_ptr"}
    ints = {"T", "DM", "NTB", "SX", "SDX", "NCH", "N", "G", "PER_GROUP", "NB", "S", "BPS", "NBC", "ZS", "DZS", "BCS"}

    def types(kernel, constexprs):
        return {n: "i32" if n in ints else "*i32" if n in ("seq_ptr", "cu_ptr") else "*bf16" if n in bf16
                else "*fp32" for n in kernel.arg_names if n not in constexprs}

    flags = dict(W=4, HAS_BIAS=True, HAS_S0=True, SILU=True, VARLEN=False)
    for kind, kernel, configs in (("fwd", conv._fwd_kernel, conv.FWD_CONFIGS), ("bwd", conv._bwd_kernel, conv.BWD_CONFIGS)):
        settings = [conv.FIXED[kind]] + [dict(c.kwargs, num_warps=c.num_warps) for c in configs]
        for st in {tuple(sorted(x.items())) for x in settings}:
            st = dict(st)
            ce = dict(flags, BLOCK_T=st["BLOCK_T"], BLOCK_D=st["BLOCK_D"])
            yield (f"conv {kernel.__name__} BLOCK_T={st['BLOCK_T']} BLOCK_D={st['BLOCK_D']} warps={st['num_warps']}",
                   kernel, types(kernel, ce), ce, st["num_warps"], 3)
    seq = [conv.FIXED["seq"]] + [dict(c.kwargs, num_warps=c.num_warps) for c in conv.SEQ_CONFIGS]
    for st in sorted({tuple(sorted(x.items())) for x in seq}):
        st = dict(st)
        ce = dict(flags, CHUNK=st["CHUNK"], BLOCK_D=st["BLOCK_D"], UNROLL=st["UNROLL"])
        yield (f"conv _bwd_seq_kernel CHUNK={st['CHUNK']} BLOCK_D={st['BLOCK_D']} warps={st['num_warps']} "
               f"unroll={st['UNROLL']}", conv._bwd_seq_kernel, types(conv._bwd_seq_kernel, ce), ce, st["num_warps"], 3)
    for block_n in (16, 64):  # Mamba-1's d_state 16, and 64 (mqar-mamba1-l)
        flags = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, BLOCK_N=block_n, VARLEN=False)
        fixed = scan._config(training=True, block_n=block_n)
        label = "" if block_n == 16 else f"N={block_n} "
        # the forward at its fixed setting and the autotuner's candidates
        ce0 = dict(flags, HAS_H0=False, STORE_CKPT=True, STAGES=fixed["fwd_stages"], NB_LOOP=0,
                   CKPT_T=fixed["bwd_block_t"], SEGMENTED=True, DT_GIVEN=scan.FWD_DT_GIVEN)  # the segmented launch: the whole kernel's code
        kept = scan._fitting(scan.FWD_CONFIGS, fixed["block_t"], block_n, scan.TILE_PER_THREAD["fwd"])
        settings = {(fixed["fwd_block_d"], fixed["fwd_warps"], None)} | {
            (c.kwargs["BLOCK_D"], c.num_warps, c.maxnreg) for c in kept}
        for block_d, warps, cap in sorted(settings, key=lambda x: (x[0], x[1], x[2] or 0)):
            ce = dict(ce0, BLOCK_T=fixed["block_t"], BLOCK_D=block_d, **({} if cap is None else {"maxnreg": cap}))
            yield (f"selective_scan _fwd_kernel {label}BLOCK_D={block_d} warps={warps}"
                   f"{'' if cap is None else f' maxnreg={cap}'}", scan._fwd_kernel, types(scan._fwd_kernel, ce), ce,
                   warps, 3)
        # the backward at its time block (BWD_BLOCK_T, 8) and at the forward's 16, each plain and with
        # its inputs loaded a block ahead (BWD_PREFETCH; chosen by the grid): the fixed setting and
        # the candidates the autotuner keeps (its prune); N = 64 at the default block, plain
        for block_t in (fixed["bwd_block_t"], 16) if block_n == 16 else (fixed["bwd_block_t"],):
            kept = scan._prune("bwd")(scan.BWD_CONFIGS, {}, BLOCK_T=block_t, BLOCK_N=block_n)
            settings = {(fixed["bwd_block_d"], fixed["bwd_warps"], None)} | {
                (c.kwargs["BLOCK_D"], c.num_warps, c.maxnreg) for c in kept}
            for prefetch in (False, True) if block_n == 16 else (False,):
                for block_d, warps, cap in sorted(settings, key=lambda x: (x[0], x[1], x[2] or 0)):
                    ce = dict(flags, HAS_DY=True, HAS_DHT=False, HAS_H0=False, SEGMENTED=True, PREFETCH=prefetch,
                              DT_GIVEN=scan.BWD_DT_GIVEN, BLOCK_T=block_t,
                              BLOCK_D=block_d, **({} if cap is None else {"maxnreg": cap}))
                    yield (f"selective_scan _bwd_kernel {label}BLOCK_T={block_t}{' PREFETCH' if prefetch else ''} "
                           f"BLOCK_D={block_d} warps={warps}{'' if cap is None else f' maxnreg={cap}'}",
                           scan._bwd_kernel, types(scan._bwd_kernel, ce), ce, warps, 3)
        # the segments' first passes, at their fixed launches (those of the forward and backward)
        for kernel, kind, ce in (
                (scan._fwd_carry_kernel, "fwd", dict(HAS_BIAS=True, SOFTPLUS=True, NB_LOOP=0)),
                (scan._bwd_carry_kernel, "bwd", dict(HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, HAS_DY=True))):
            block_d, warps = fixed[f"{kind}_block_d"], fixed[f"{kind}_warps"]
            ce = dict(ce, BLOCK_T=fixed["bwd_block_t" if kind == "bwd" else "block_t"], BLOCK_N=block_n, BLOCK_D=block_d)
            label = "" if block_n == 16 else f"N={block_n} "
            yield (f"selective_scan {kernel.__name__} {label}BLOCK_D={block_d} warps={warps}", kernel,
                   types(kernel, ce), ce, warps, 3)
    yield from _varlen_settings(conv, scan, types)
    yield from norm_settings()


def _varlen_settings(conv, scan, types):
    """The packed-documents (``VARLEN``) variants of the conv and selective-scan kernels at their
    fixed GPU settings (per-document states and tails, their gradients; the backward at its time
    block, plain and loading a block ahead), N = 16 and 64."""
    flags = dict(W=4, HAS_BIAS=True, HAS_S0=True, SILU=True, VARLEN=True)
    for kernel, kind, span in ((conv._fwd_kernel, "fwd", "BLOCK_T"), (conv._bwd_kernel, "bwd", "BLOCK_T"),
                               (conv._bwd_seq_kernel, "seq", "CHUNK")):
        st = conv._fixed(kind, varlen=True)
        ce = dict(flags, **{k: v for k, v in st.items() if k != "num_warps"})
        yield (f"conv {kernel.__name__} VARLEN {span}={st[span]} BLOCK_D={st['BLOCK_D']} warps={st['num_warps']}",
               kernel, types(kernel, ce), ce, st["num_warps"], 3)
    for block_n in (16, 64):
        flags = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, BLOCK_N=block_n, VARLEN=True, HAS_H0=True)
        fixed = scan._config(training=True, block_n=block_n)
        label = "" if block_n == 16 else f"N={block_n} "
        block_d, warps = scan.VARLEN_FWD_TILE.get((fixed["fwd_block_d"], fixed["fwd_warps"]),
                                                  (fixed["fwd_block_d"], fixed["fwd_warps"]))
        ce = dict(flags, STORE_CKPT=True, STAGES=fixed["fwd_stages"], NB_LOOP=0, CKPT_T=fixed["bwd_block_t"],
                  SEGMENTED=False, DT_GIVEN=scan.FWD_DT_GIVEN, BLOCK_T=fixed["block_t"], BLOCK_D=block_d)
        yield (f"selective_scan _fwd_kernel VARLEN {label}BLOCK_D={block_d} warps={warps}",
               scan._fwd_kernel, types(scan._fwd_kernel, ce), ce, warps, 3)
        for prefetch in (False, True):
            ce = dict(flags, HAS_DY=True, HAS_DHT=True, SEGMENTED=False, PREFETCH=prefetch, DT_GIVEN=scan.BWD_DT_GIVEN,
                      BLOCK_T=fixed["bwd_block_t"], BLOCK_D=fixed["bwd_block_d"])
            yield (f"selective_scan _bwd_kernel VARLEN {label}BLOCK_T={fixed['bwd_block_t']}"
                   f"{' PREFETCH' if prefetch else ''} BLOCK_D={fixed['bwd_block_d']} warps={fixed['bwd_warps']}",
                   scan._bwd_kernel, types(scan._bwd_kernel, ce), ce, fixed["bwd_warps"], 3)


# (group, gated, norm_before_gate): RMSNorm at d_model 1024 / 4096 / 8192; the gated norm per
# 128-wide value head (GLA, Gated DeltaNet), over Mamba-2's d_inner 2048 and in 256-wide groups;
# Gated DeltaNet's per-head l2 normalisation of q and k (ungrouped kernel, 128-wide groups)
NORM_SHAPES = ((1024, False, True), (4096, False, True), (8192, False, True), (128, True, True),
               (2048, True, False), (256, True, False), (8192, True, False), (128, False, True))


def norm_settings():
    """(name, kernel, types, constexprs, warps, stages) of the fused norm kernels at the launch
    settings they take (no autotuning) for the widths of :data:`NORM_SHAPES`, bf16 and fp32."""
    import importlib

    norm = importlib.import_module("hybridzoo.kernels.triton.norm")
    ints = {"N", "D", "stride_x", "stride_z", "stride_dz", "stride_dy", "rows_per_program", "steps"}
    for dt in ("bf16", "fp32"):
        for group, gated, before in NORM_SHAPES:
            block_n, block_g, warps = norm._settings(group)
            for kernel in (norm._fwd_kernel, norm._bwd_kernel):
                ce = dict(G=group, HAS_Z=gated, NORM_BEFORE_GATE=before, ZERO_CENTERED=not gated,
                          BLOCK_N=block_n, BLOCK_G=block_g)
                if kernel is norm._bwd_kernel:
                    ce["STEPS_INTERP"] = 0
                types = {n: "i32" if n in ints else "fp32" if n == "eps" else
                         "*fp32" if n in ("w_ptr", "rstd_ptr", "dw_ptr") else f"*{dt}"
                         for n in kernel.arg_names if n not in ce}
                label = f"G={group}" + (f" gated{'' if before else ' gate-first'}" if gated else "")
                yield f"norm {kernel.__name__} {label} warps={warps} {dt}", kernel, types, ce, warps, 3


# The norm backward over 8192-wide gated groups (16 warps: 128 registers per thread at most)
# spills 68-104 B; Triton 3.9's ptxas spills 4 B in a few other norm backward settings (Triton
# 3.6: none). Both are allowed; 8 warps would hold twice the elements per thread.
SPILL_ALLOWED.update({name: 128 if "G=8192 gated" in name else 16
                      for name, *_ in norm_settings() if "_bwd_kernel" in name})


def fused_layer_settings():
    """(name, kernel, types, constexprs, warps, stages) of the layers' fused passes (SwiGLU,
    cross-entropy) at the settings they launch with on a GPU, bf16."""
    import importlib

    swiglu = importlib.import_module("hybridzoo.kernels.triton.swiglu")
    ce = importlib.import_module("hybridzoo.kernels.triton.cross_entropy")
    f32 = {"loss_ptr", "lse_ptr", "grad_ptr"}
    for kernel, consts, warps, ints, fp32 in (
            (swiglu._fwd_kernel, dict(BLOCK=swiglu.BLOCK), swiglu.WARPS, {"n"}, set()),
            (swiglu._bwd_kernel, dict(BLOCK=swiglu.BLOCK), swiglu.WARPS, {"n"}, set()),
            (ce._fwd_kernel, dict(IGNORE=ce.IGNORE_INDEX, BLOCK_V=ce.BLOCK_V, NV_LOOP=0), ce.WARPS,
             {"V", "stride"}, f32),
            (ce._bwd_kernel, dict(IGNORE=ce.IGNORE_INDEX, BLOCK_V=ce.BLOCK_V), ce.WARPS, {"V", "stride"}, f32)):
        types = {n: "i32" if n in ints else "*i64" if n == "targets_ptr" else "*fp32" if n in fp32 else "*bf16"
                 for n in kernel.arg_names if n not in consts}
        yield (f"{kernel.fn.__module__.rsplit('.', 1)[-1]} {kernel.__name__} warps={warps}", kernel, types, consts,
               warps, 3)
    rotary = importlib.import_module("hybridzoo.kernels.triton.rotary")
    types = {n: "i32" if n in {"T", "H", "D", "HALF"} else "*fp32" if n in {"cos_ptr", "sin_ptr"} else "*bf16"
             for n in rotary._kernel.arg_names if n not in {"SIGN", "BLOCK_H", "BLOCK_R", "BLOCK_REST"}}
    for heads, dim, rotated in ((4, 256, 256), (16, 64, 64), (8, 256, 64)):  # retnet, attention, qwen35
        block_h, warps = rotary.gpu_settings(heads, dim)
        rest = triton.next_power_of_2(dim - rotated) if dim > rotated else 0
        consts = dict(SIGN=1.0, BLOCK_H=block_h, BLOCK_R=triton.next_power_of_2(rotated // 2), BLOCK_REST=rest)
        yield f"rotary _kernel H{heads} D{dim} R{rotated} warps={warps}", rotary._kernel, types, consts, warps, 3


def check_spills() -> int:
    bad = 0
    for name, kernel, types, constexprs, warps, stages in (*elementwise_settings(), *fused_layer_settings()):
        try:
            r = resources(kernel, types, constexprs, warps, stages)
            allowed = SPILL_ALLOWED.get(name, 0)
            flag = f"SPILLS {r['spill_stores']} B > {allowed}" if (r["spill_stores"] or 0) > allowed else ""
        except Exception as error:
            r, flag = {}, f"error: {type(error).__name__}: {str(error)[:150]}"
        bad += bool(flag)
        print(f"{name:60s} regs {r.get('registers')!s:>4s} spills {r.get('spill_stores')!s:>6s} {flag}", flush=True)
    return 1 if bad else 0


def ptx_fingerprint(kernel, types: dict[str, str], constexprs: dict, num_warps: int = 4,
                    num_stages: int = 3) -> str:
    """A hash of ``kernel``'s sm_90 PTX (:func:`compile_sm90`) without its line and debug
    information (``.loc``, ``.file``, comments, ``.debug_*`` sections, label names, and the
    ``$L__tmp`` labels that only mark an inlined helper's scope for the debug sections: moving code
    into a ``@triton.jit`` helper moves them, not the instructions)."""
    import hashlib

    text = compile_sm90(kernel, types, constexprs, num_warps, num_stages).asm["ptx"]
    lines = [re.sub(r"\$L__\w+", "L", line) for line in text.split(".section\t.debug")[0].splitlines()
             if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp\d+:)", line)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


# SASS opcodes by class (the opcode's first dot-separated part)
SASS_CLASSES = {"fp32": {"FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK"}, "shuffle": {"SHFL"},
                "special": {"MUFU"}, "global": {"LDG", "STG", "RED", "REDG", "ATOMG", "ATOM", "LD", "ST"},
                "shared": {"LDS", "STS", "LDSM", "STSM", "ATOMS"}}


def sass_loop(cubin: bytes) -> dict:
    """The longest loop of ``cubin``'s code (the span from a backward branch's target to the
    branch): ``{"instructions": whole kernel, "loop": its length, "classes": {class: count}, "opcodes":
    {opcode: count}}`` by :data:`SASS_CLASSES` (``other`` for the rest); ``loop`` 0 without a loop."""
    import collections

    nvdisasm = PTXAS.parent / "nvdisasm"  # beside the wheel's ptxas
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    labels, pending, code = {}, [], []
    for line in sass.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            pending.append(m.group(1))
            continue
        if m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)", line):
            address = int(m.group(1), 16)
            labels.update((label, address) for label in pending)
            pending = []
            code.append((address, m.group(2), line))
    loops = [(labels[t.group(1)], address) for address, op, line in code if op == "BRA"
             if (t := re.search(r"(\.L_x_\d+)", line)) and labels.get(t.group(1), address + 1) <= address]
    start, end = max(loops, key=lambda span: span[1] - span[0]) if loops else (1, 0)
    ops = collections.Counter(op for address, op, _ in code if start <= address <= end)
    classes = collections.Counter()
    for op, n in ops.items():
        classes[next((c for c, members in SASS_CLASSES.items() if op in members), "other")] += n
    return {"instructions": len(code), "loop": sum(ops.values()), "classes": dict(classes), "opcodes": dict(ops)}


def loop_counts(pattern: str) -> int:
    """Print :func:`sass_loop` for every kernel setting whose name contains ``pattern``."""
    shown = 0
    for group in (cases(), all_kernels(), elementwise_settings()):
        for name, kernel, types, constexprs, warps, stages in group:
            if pattern not in name:
                continue
            r = sass_loop(compile_sm90(kernel, types, constexprs, warps or 4, stages or 3).asm["cubin"])
            top = ", ".join(f"{op} {n}" for op, n in sorted(r["opcodes"].items(), key=lambda x: -x[1])[:6])
            print(f"{name}: {r['instructions']} instructions, loop {r['loop']}: "
                  + " ".join(f"{c} {r['classes'].get(c, 0)}" for c in (*SASS_CLASSES, "other")) + f" ({top})",
                  flush=True)
            shown += 1
    if not shown:
        print(f"kernel_resources: no kernel setting's name contains {pattern!r}", file=sys.stderr)
    return 0 if shown else 1


def fingerprints(path: str, compare: str | None) -> int:
    """Write ``{kernel setting: PTX hash}`` to ``path``; with ``compare``, list the settings whose
    hash differs from that file's (or is new / gone) and return 1 if any does."""
    import json

    result = {}
    for group in (cases(), all_kernels(), elementwise_settings()):
        for name, kernel, types, constexprs, warps, stages in group:
            result[name] = ptx_fingerprint(kernel, types, constexprs, warps or 4, stages or 3)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(result)} kernel settings -> {path}")
    if compare is None:
        return 0
    before = json.loads(Path(compare).read_text())
    changed = sorted(k for k in before.keys() | result.keys() if before.get(k) != result.get(k))
    for name in changed:
        print(f"PTX differs: {name} ({before.get(name, 'new')} -> {result.get(name, 'gone')})")
    print("every kernel's PTX is identical" if not changed else f"{len(changed)} kernel settings differ")
    return 1 if changed else 0


def main() -> int:
    args = sys.argv[1:]
    if "--loops" in args:
        return loop_counts(args[args.index("--loops") + 1] if args.index("--loops") + 1 < len(args) else "")
    if "--fingerprint" in args:
        compare = args[args.index("--compare") + 1] if "--compare" in args else None
        return fingerprints(args[args.index("--fingerprint") + 1], compare)
    if "--spills" in sys.argv[1:]:
        return check_spills()
    if "--all" in sys.argv[1:]:
        bad = 0
        dtypes = tuple(args[args.index("--dtype") + 1].split(",")) if "--dtype" in args else ("bf16", "fp32")
        for name, kernel, types, constexprs, warps, stages in all_kernels(dtypes, "--varlen" in args):
            try:
                r = resources(kernel, types, constexprs, warps, stages)
                flag = "OVER THE SHARED-MEMORY LIMIT" if r["shared"] > SHARED_LIMIT else ""
            except Exception as error:
                r, flag = {}, f"error: {type(error).__name__}: {str(error)[:150]}"
            bad += bool(flag)
            print(f"{name:50s} shared {r.get('shared')!s:>7s} regs {r.get('registers')!s:>4s} "
                  f"spills {r.get('spill_stores')!s:>6s} {flag}", flush=True)
        return 1 if bad else 0
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
