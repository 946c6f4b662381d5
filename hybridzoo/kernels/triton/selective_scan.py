"""Mamba-1 selective scan in Triton: discretisation, scan and output fused on chip.

Same op as :func:`hybridzoo.kernels.reference.selective_scan` (the spec), sequence-first::

    Δ = softplus?(delta + delta_bias)
    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t u_t,    y_t = (C_t · h_t + D u_t) · silu(z_t)

Design (one program per (batch, group, block of ``BLOCK_D`` channels)):

* forward: a loop over time blocks of ``BLOCK_T`` tokens (software-pipelined when training: the
  next block's loads are issued during this one's scan); each block loads delta/u/z
  ``[BLOCK_T, BLOCK_D]`` and B/C ``[BLOCK_T, N]``, discretises on chip (``a = exp(Δ A)``,
  ``b = Δ B u``, tiles ``[BLOCK_T, N, BLOCK_D]``: Triton then lays channels and states across a
  warp's lanes and time in each thread's registers), runs the recurrence as an associative scan
  over the block's time axis (pairs ``(a, b)`` composed by multiplication, never divided) and
  folds the carried state in. Only ``y``, the final state and, when a gradient is needed, the
  state at the start of each of the backward's time blocks (``[B, ceil(T / bwd_block_t), Dm, N]``
  float32, one per block, not per token; :data:`BWD_BLOCK_T`) reach HBM.
* backward: the blocks in reverse; each block recomputes its states from its boundary state,
  runs the adjoint ``g_t = C_t dy0_t + exp(Δ_{t+1} A) g_{t+1}`` as an associative scan of the block
  flipped in time (``g`` after the last token is the gradient of the final state) and forms all
  gradients on chip; on a grid short of programs each block's inputs are loaded during the block
  before it (:data:`BWD_PREFETCH`); ``a_t h_{t-1}`` is the one-step difference ``h_t − Δ_t B_t u_t`` (as in
  mamba_ssm).
  dA, dD, d(delta_bias) are summed per program then over the batch in torch; dB and dC (sums
  over channels) are accumulated with float32 atomics, relaxed: with Triton's default
  (``acq_rel``) each of them compiles for sm_90 to an atomic that waits for its result, behind a
  ``MEMBAR.ALL.GPU`` that drains the thread's memory traffic and a ``CCTL.IVALL`` that empties
  the L1 cache the next block's loads hit (16 of each per time block at the 16 x 16 x 4 tile);
  relaxed, they are fire-and-forget reductions (``REDG``). The sums need no ordering: they are
  read after the kernel ends. The initial-state gradient is ``exp(Δ_0 A) g_0``.

* time segments: where one program per (sequence, channel block) would leave most of the GPU idle
  (a long T and a small batch), each direction runs its time blocks in ``S`` segments side by
  side (:func:`_segments`). A first pass (:func:`_fwd_carry_kernel`, :func:`_bwd_carry_kernel`)
  gives each segment's own contribution to the state after it (to the adjoint before it) and the
  sum of its step sizes, so that its decay is ``exp(A ΣΔ)``; each segment folds those of the
  segments before (after) it into its start, then runs as above.

States are float32 whatever the input dtype; inputs may be float16/bfloat16/float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.reference import selective_scan as _reference_scan
from hybridzoo.kernels.reference.selective_scan import _check
from hybridzoo.kernels.triton import launch
from hybridzoo.kernels.triton.fast_exp import LOG2E, _exp2
from hybridzoo.kernels.triton.varlen_rows import doc_block, doc_rows

__all__ = ["selective_scan", "selective_scan_grads", "selective_scan_saved"]


def _config(training: bool, block_n: int = 16) -> dict:
    """Fixed block sizes: tiny under the interpreter (``TRITON_INTERPRET=1``), else GPU sizes.

    A forward that will be differentiated stores the state entering every ``bwd_block_t`` tokens
    (:data:`BWD_BLOCK_T`, capped at its own ``block_t``), the backward's time block, which it
    restarts from; an inference-only forward picks its own block and stores nothing. GPU sizes:
    the fastest measured on one H200 (``scripts/probe_scan_configs.py`` in git at ee446cb, bf16, with D, z and a
    softplus bias: ``benchmarks/results/investigations/2026-12-03-probe-scan-configs-h200-5b0b482.jsonl``) at
    both B2 T16384 D2048 N16 (backward 10.57 ms at 4 channels on 1 warp) and Mamba-130m's B8
    T2048 D1536 N16 (4.02 ms). The training forward (8 channels on 1 warp) is pipelined over two
    stages (``fwd_stages``): 2.04 ms against 3.70 unpipelined at the first shape, 0.50 against
    0.57 at the second (``2026-12-03-probe-scan-variants-h200.jsonl``); the inference forward is
    not (unmeasured). The backward runs 8-token blocks (``bwd_block_t``, 2.15 against 2.76 ms at
    the second shape); whether it loads a block ahead comes from the grid (``bwd_prefetch`` None:
    :func:`_prefetched`), and its register cap, which binds only 16-token blocks, too
    (:func:`_capped`) unless ``bwd_maxnreg`` is given (0: none). On a GPU the channel block, warps and cap are autotuned
    (:data:`FWD_CONFIGS`, :data:`BWD_CONFIGS`); these are the settings with autotuning off.

    A wider state (``block_n``, the padded N, above 16) widens every ``[BLOCK_T, BLOCK_N,
    BLOCK_D]`` tile: a setting whose tile puts more elements on a thread than
    :data:`TILE_PER_THREAD` allows is replaced by the first candidate that fits (:func:`_fitting`);
    the measured settings stand wherever they fit (N up to 16)."""
    if BWD_BLOCK_T < 2 or BWD_BLOCK_T & (BWD_BLOCK_T - 1):
        raise ValueError(f"selective_scan (triton): BWD_BLOCK_T must be a power of two from 2, not {BWD_BLOCK_T}")
    if launch.interpret():
        return dict(block_t=8, bwd_block_t=min(BWD_BLOCK_T, 8), fwd_block_d=8, fwd_warps=1, fwd_stages=1,
                    bwd_block_d=8, bwd_warps=1, bwd_prefetch=BWD_PREFETCH)
    if not training:
        cfg = dict(block_t=32, fwd_block_d=16, fwd_warps=8, fwd_stages=1)
    else:
        cfg = dict(block_t=16, bwd_block_t=min(BWD_BLOCK_T, 16), fwd_block_d=8, fwd_warps=1, fwd_stages=2,
                   bwd_block_d=4, bwd_warps=1, bwd_prefetch=BWD_PREFETCH)
    for kind, configs in (("fwd", FWD_CONFIGS), ("bwd", BWD_CONFIGS)):
        if f"{kind}_block_d" in cfg:
            block_t = cfg["bwd_block_t" if kind == "bwd" else "block_t"]
            if _per_thread(block_t, cfg[f"{kind}_block_d"], block_n, cfg[f"{kind}_warps"]) > TILE_PER_THREAD[kind][1]:
                chosen = _fitting(configs, block_t, block_n, TILE_PER_THREAD[kind])[0]
                cfg[f"{kind}_block_d"], cfg[f"{kind}_warps"] = chosen.kwargs["BLOCK_D"], chosen.num_warps
    return cfg


# Autotuned channel blocks and warps (the time block is fixed by _config: the backward restarts
# from the forward's per-block states): the fastest few of the probe at both measured shapes, and
# narrower tiles on more warps for wider states. Compiled for sm_90 (scripts/kernel_resources.py
# --spills, its SPILL_ALLOWED checked by a CPU test), the N = 16 candidates spill at most 32 B a
# thread with Triton 3.7.1 and 3.9. At N = 64 (Mamba-1 with d_state 64, as mqar-mamba1-l) the
# N = 16 backward tiles would hold 128 elements a thread; the 2-wide tile on 8 warps holds 8 and
# does not spill, the 4-wide on 8 holds 16 and spills 16 to 32 B (the 2-wide on 4 warps spilled
# 460 B with Triton 3.9 and is no candidate).
FWD_CONFIGS = [triton.Config({"BLOCK_D": d}, num_warps=w) for d, w in ((8, 1), (8, 2), (16, 2), (4, 1), (4, 2), (4, 8))]
# The 4-wide 1-warp backward holds 255 registers a thread, so 8 programs share an SM. Capped at
# BWD_MAXNREG (it then spills some 440 B), 12 do: faster where the grid fills several such waves
# (B8 T2048 D1536: 3.40 against 3.97 ms), slower where it fills about one (B2 T16384 D2048: 12.15
# against 10.42 ms; benchmarks/results/investigations/2026-12-03-probe-scan-variants-h200.jsonl). Both are
# candidates; with autotuning off, the cap is taken from BWD_CAP_WAVES waves of uncapped programs.
BWD_MAXNREG, BWD_CAP_WAVES = 168, 2
# One-warp backward programs an SM holds at once uncapped: 255 registers x 32 threads each, of the
# SM's 64K registers (sm_90). The unit of BWD_CAP_WAVES.
WAVE_PROGRAMS_PER_SM = 8
BWD_CONFIGS = [triton.Config({"BLOCK_D": d}, num_warps=w)
               for d, w in ((4, 1), (8, 2), (16, 4), (32, 8), (2, 8), (4, 8))]
BWD_CONFIGS.insert(1, triton.Config({"BLOCK_D": 4}, num_warps=1, maxnreg=BWD_MAXNREG))
# Tile elements ([BLOCK_T, BLOCK_N, BLOCK_D] over 32 * num_warps threads) a setting may put on a
# thread, (fewest, most): the backward keeps about twice as many tiles live as the forward; fewer
# than 8 leaves threads idle (at N = 16 this keeps exactly the probe's candidates).
TILE_PER_THREAD = {"fwd": (8, 64), "bwd": (8, 32)}


def _per_thread(block_t: int, block_d: int, block_n: int, warps: int) -> int:
    return block_t * block_d * block_n // (32 * warps)


def _fitting(configs: list, block_t: int, block_n: int, bounds: tuple[int, int]) -> list:
    """The ``configs`` whose tile puts between ``bounds`` elements on a thread, in their order;
    if none does (a small state), those under the upper bound; if none is (a wide state), the one
    that puts the fewest (never an empty list)."""
    load = lambda c: _per_thread(block_t, c.kwargs["BLOCK_D"], block_n, c.num_warps)  # noqa: E731
    return ([c for c in configs if bounds[0] <= load(c) <= bounds[1]]
            or [c for c in configs if load(c) <= bounds[1]] or [min(configs, key=load)])


def _prune(kind: str):
    """The autotuner's ``early_config_prune`` of the ``kind`` kernel: :func:`_fitting` at the
    launch's ``BLOCK_T`` and ``BLOCK_N``, less the register-capped candidate below 16-token blocks
    (the 8-token tile holds 167 registers of the cap's 168: the same kernel tuned twice)."""
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        kept = _fitting(list(configs), args["BLOCK_T"], args["BLOCK_N"], TILE_PER_THREAD[kind])
        if args["BLOCK_T"] < 16:  # the register cap binds only the 16-token tile (255 registers uncapped)
            kept = [c for c in kept if not c.maxnreg] or kept
        return kept
    return prune


# The backward's time block (a power of two; at most the forward's block, 16 on a GPU and 8 under
# the interpreter). The forward stores the state entering every BWD_BLOCK_T tokens, so a shorter
# block costs memory ([B, T / 8, Dm, N] float32 at 8: twice the states of 16-token blocks) and buys
# a smaller backward tile: compiled for sm_90 (Triton 3.7.1), the 4-wide 1-warp backward holds 167
# registers a thread at 8 tokens against 255 at 16, so 12 programs share an SM instead of 8, for
# the same instructions per element in its loop (77 against 76 warp instructions per 32 tile
# elements). On an H200 (bf16, Triton 3.6; scripts/probe_scan_configs.py in git at ee446cb, two interleaved passes,
# benchmarks/results/investigations/2026-12-04-probe-scan-bwd-variants-h200-8199a1d.jsonl) the backward took
# 2.15 ms in 8-token blocks against 2.76 in 16 (2.95 capped) at Mamba-130m's B8 T2048 D1536 N16,
# and 3.64 against 3.79 at its B2 T8192.
BWD_BLOCK_T = 8
# Each backward time block's inputs (u, Δ, B, C, dy, z and the saved state) loaded during the block
# before it in the loop, into registers: at the 8-token 4-wide tile 168 registers a thread, no
# spills (sm_90, Triton 3.7.1). It pays where the grid leaves the SMs short of programs, whose
# latency it then hides, and costs where it fills them: 3.03 against 3.64 ms at B2 T8192 D1536
# (768 programs, under half a wave of 12 an SM on an H200), 2.31 against 2.15 at B8 T2048 (3072
# programs, about two waves; same file as above). None: prefetch where the grid fills less than
# BWD_PREFETCH_WAVES waves of BWD_PROGRAMS_PER_SM programs an SM (:func:`_prefetched`); True or
# False forces it. A backward whose loop Triton software-pipelines (tl.range num_stages 2, B and C
# through shared memory) was slower at both shapes (3.06 and 4.07 ms) and is gone.
BWD_PREFETCH = None
# One wave: 12 one-warp programs an SM, the 8-token 4-wide tile reading the step sizes
# (BWD_DT_GIVEN) holding 161 registers a thread with Triton 3.7.1 and 168 with 3.6 (computing them,
# 167 and 208: 9 an SM with 3.6, on which the figures above ran; the two measured grids lie on the
# same sides of either wave).
BWD_PREFETCH_WAVES, BWD_PROGRAMS_PER_SM = 1, 12

# The step sizes Δ = softplus(delta + delta_bias). The backward reads each token's twice (its own
# block's and, for the adjoint, one token on). With BWD_DT_GIVEN (FWD_DT_GIVEN: the training
# forward) a small kernel (_dt_kernel) computes Δ once, float32, into a [B, T, Dm] buffer that lives
# through that kernel, and its loop loads Δ instead of computing it. Compiled for sm_90 with Triton
# 3.6, the loops computed the softplus (an exponential, an accurate logarithm and a division) for
# every state lane of the tile rather than once per (token, channel): the backward's ran 2,006
# instructions an 8-token block against 1,246 with Triton 3.7.1 (scripts/kernel_resources.py --loops).
# Reading Δ, it runs 1,170 with 3.6 (168 registers a thread, was 208) and 1,168 with 3.7.1 (161, was
# 167). Reading Δ, the training forward (blocks of 16, 8 channels, 1 warp) runs fewer instructions
# a block with every version (3.6: 1,559 against 2,334; 3.7.1: 1,526 against 1,694; 3.9: 1,351
# against 1,507) and fewer registers with 3.6 and 3.9 (243 against 249, 190 against 228), but with
# 3.7.1 it holds 245 registers a thread instead of 186 (the pipelined next block's Δ, float32, on
# every state lane). Timed on an H200 with Triton 3.6 (scripts/probe_scan_configs.py in git at ee446cb, fixed launch
# settings, two interleaved passes, benchmarks/results/investigations/2026-12-04-probe-scan-dt-given-h200-1623309.jsonl):
# the backward with Δ read took 1.61 against 2.14 ms at Mamba-130m's B8 T2048 D1536 N16 and 2.12
# against 3.03 at B2 T8192 (loading a block ahead), the training forward 0.387 against 0.495 and
# 0.858 against 1.032. In the whole mamba-130m training step (autotuning on, two interleaved
# repetitions each, benchmarks/results/investigations/2026-12-04-models-mamba1-dt-given-ab-h200-090b17f.json) the
# backward's gain holds at T 2048 (151k tokens/s against 144k without either) and is within the
# spread at T 8192 (122k against 120k), but reading Δ in the forward as well made the step slower
# (143k and 110k), against what the kernel alone showed. With the exp2 and folded-state loops
# (benchmarks/results/2026-12-05-models-mamba1-h200-68b9182.md) it gave the same ratio to mamba_ssm
# at T 8192 as computing Δ (1.05x both), so the forward computes Δ itself.
BWD_DT_GIVEN = True
FWD_DT_GIVEN = False
# The training forward's fixed tiles on packed documents (VARLEN: each document's initial state read
# and last state stored at its tokens, decays reset at its first): the 8-wide 1-warp tile spills 68 B
# (sm_90, Triton 3.7.1; 8 channels on 2 warps: none), N = 64's 4-wide 2-warp one 44 B (3.7.1) to 596
# B (3.6; 4 channels on 8 warps: none). Unpacked launches keep the measured tiles.
VARLEN_FWD_TILE = {(8, 1): (8, 2), (4, 2): (4, 8)}
DT_BLOCK_R, DT_BLOCK_D = 32, 128

TUNE_KEY = ["DM", "N", "G", "PER_GROUP", "HAS_D", "HAS_Z", "HAS_BIAS", "SOFTPLUS", "BLOCK_T", "BLOCK_N", "VARLEN"]

# exp: fast_exp._exp2 (one ex2.approx.ftz.f32 on CUDA), with log2(e) folded into A once a program.


@triton.jit
def _combine(a1, b1, a2, b2):
    """Compose two steps ``h -> a h + b`` (first ``(a1, b1)``, then ``(a2, b2)``)."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _step_size(raw, SOFTPLUS: tl.constexpr):
    """``softplus(raw)`` (accurate log1p(exp(raw)), identity above 20) or ``raw``."""
    if SOFTPLUS:
        e = _exp2(tl.minimum(raw, 20.0) * LOG2E)
        w = 1.0 + e
        log1p = tl.where(w == 1.0, e, tl.log(w) * (e / tl.where(w == 1.0, 1.0, w - 1.0)))
        return tl.where(raw > 20.0, raw, log1p)
    else:
        return raw


@triton.jit
def _program(A_ptr, bias_ptr, N, PER_GROUP, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """What every kernel's program ``(b, channel block, s)`` starts from: ``(b (int64), s, group,
    d [BLOCK_D], its mask, n [BLOCK_N], its mask, dn [BLOCK_N, BLOCK_D] the offsets into a
    [Dm, N] tensor, their mask, A [BLOCK_N, BLOCK_D] float32, delta_bias [BLOCK_D] float32 (zeros
    when absent))``."""
    b = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    seg = tl.program_id(2)
    n_dblk = tl.cdiv(PER_GROUP, BLOCK_D)
    g = pid // n_dblk
    cols = (pid % n_dblk) * BLOCK_D + tl.arange(0, BLOCK_D)  # channel within the group
    dmask = cols < PER_GROUP
    d = g * PER_GROUP + cols
    n = tl.arange(0, BLOCK_N)
    nmask = n < N
    dn = d[None, :] * N + n[:, None]
    dn_mask = nmask[:, None] & dmask[None, :]
    A = tl.load(A_ptr + dn, mask=dn_mask, other=0.0).to(tl.float32)
    return b, seg, g, d, dmask, n, nmask, dn, dn_mask, A, _channel_values(bias_ptr, d, dmask, HAS_BIAS)


@triton.jit
def _channel_values(ptr, d, dmask, HAS: tl.constexpr):
    """``ptr[d]`` as float32 ``[BLOCK_D]`` (zeros when the tensor is absent)."""
    if HAS:
        return tl.load(ptr + d, mask=dmask, other=0.0).to(tl.float32)
    else:
        return tl.zeros(d.shape, dtype=tl.float32)


@triton.jit
def _rows_or_zeros(ptr, off, m2, HAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """A ``[BLOCK_T, BLOCK_D]`` float32 tile of a ``[B, T, Dm]`` tensor, or zeros when absent."""
    if HAS:
        return tl.load(ptr + off, mask=m2, other=0.0).to(tl.float32)
    else:
        return tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)


@triton.jit
def _biased(raw, bias, HAS_BIAS: tl.constexpr):
    """A loaded tile of ``delta`` ``[BLOCK_T, BLOCK_D]`` plus ``delta_bias``, float32."""
    raw = raw.to(tl.float32)
    if HAS_BIAS:
        raw += bias[None, :]
    return raw


@triton.jit
def _step_sizes(raw, bias, m2, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """``(Δ, raw + bias)`` float32 from a loaded tile of ``delta`` ``[BLOCK_T, BLOCK_D]``; Δ = 0
    outside ``m2``."""
    raw = _biased(raw, bias, HAS_BIAS)
    return tl.where(m2, _step_size(raw, SOFTPLUS), 0.0), raw


@triton.jit
def _block_inputs(u_ptr, delta_ptr, dt_ptr, B_ptr, bias, b, t, d, dmask, g, n, nmask, T, DM, N, BCS,
                  HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, DT_GIVEN: tl.constexpr):
    """Rows ``t`` of one time block: ``(mask, offsets, u, Δ, B's offsets, their mask, B)``,
    float32; Δ = 0 past T (a = 1, b = 0). With ``DT_GIVEN`` Δ is read from ``dt_ptr``
    (:func:`_dt_kernel`). ``BCS``: elements from one token of B (and C) to the next."""
    tmask = t < T
    m2 = tmask[:, None] & dmask[None, :]
    off = (b * T + t)[:, None] * DM + d[None, :]
    u = tl.load(u_ptr + off, mask=m2, other=0.0).to(tl.float32)
    if DT_GIVEN:
        dt = tl.load(dt_ptr + off, mask=m2, other=0.0)
    else:
        dt, _ = _step_sizes(tl.load(delta_ptr + off, mask=m2, other=0.0), bias, m2, HAS_BIAS, SOFTPLUS)
    bc_off = (b * T + t)[:, None] * BCS + (g * N + n)[None, :]
    bc_mask = tmask[:, None] & nmask[None, :]
    Bt = tl.load(B_ptr + bc_off, mask=bc_mask, other=0.0).to(tl.float32)
    return m2, off, u, dt, bc_off, bc_mask, Bt


@triton.jit
def _latest(v1, r1, v2, r2):
    """Reduction combine of ``(value, row)`` pairs: the pair of the later row."""
    return tl.where(r2 > r1, v2, v1), tl.maximum(r1, r2)


@triton.jit
def _row(x, rows, j):
    """Row ``j`` of a ``[BLOCK_T, BLOCK_N, BLOCK_D]`` tile, ``[BLOCK_N, BLOCK_D]``: the latest of
    the rows up to ``j`` (:func:`_latest`). Where time lies in each thread's registers (every launch
    setting the kernels take) the rows are constants of the compiled code and this selects
    registers, with no arithmetic (a masked sum would add BLOCK_T - 1 zeros to every lane)."""
    r = tl.broadcast_to(tl.where(rows <= j, rows, -1)[:, None, None], x.shape)
    picked, _ = tl.reduce((x, r), 0, _latest)
    return picked


@triton.jit
def _block_states(u, dt, Bt, A, h, rows):
    """The states of a block's tokens from the state ``h`` entering it, ``[BLOCK_T, BLOCK_N,
    BLOCK_D]`` (``a = exp(Δ A)``, ``x = Δ B u``, an associative scan over time), and ``x``.
    ``h`` is folded into the first token's ``x`` (``a_0 h + x_0``), so only the scan's second
    output is used and its running products of ``a`` compile away where time lies in registers."""
    a = _exp2(dt[:, None, :] * (A * LOG2E)[None, :, :])
    x = (dt * u)[:, None, :] * Bt[:, :, None]
    first = tl.where((rows == 0)[:, None, None], x + a * h[None, :, :], x)
    _, hs = tl.associative_scan((a, first), 0, _combine)
    return hs, x


@triton.jit
def _block_adjoint(delta_ptr, bias, b, t, d, dmask, T, DM, A, dy0, Ct, carry, rows,
                   HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """The adjoint over a block's rows ``t``: ``g_t = C_t dy0_t + a_{t+1} g_{t+1}`` with ``carry``
    the adjoint at the next block's first token. Returns ``(g [BLOCK_T, BLOCK_N, BLOCK_D], g at
    the block's first token, Δ_{t+1} [BLOCK_T, BLOCK_D])``, ``a_{t+1}`` from the next token's Δ
    (zero past T). The reverse scan runs as a forward scan of the block flipped in time: time lies
    in each thread's registers, where a flip is free, while Triton lowers ``reverse=True`` to warp
    shuffles (640 a block at the 16x4x16 tile with Triton 3.7.1, against none)."""
    t_next = t + 1
    m_next = (t_next < T)[:, None] & dmask[None, :]
    raw_next = tl.load(delta_ptr + (b * T + t_next)[:, None] * DM + d[None, :], mask=m_next, other=0.0)
    dt_next, _ = _step_sizes(raw_next, bias, m_next, HAS_BIAS, SOFTPLUS)
    gs, g_first = _adjoint_scan(dt_next, A, dy0, Ct, carry, rows)
    return gs, g_first, dt_next


@triton.jit
def _adjoint_scan(dt_next, A, dy0, Ct, carry, rows):
    """:func:`_block_adjoint`'s scan from the next tokens' step sizes ``dt_next``: ``(g, g at
    the block's first token)``."""
    a_next = _exp2(dt_next[:, None, :] * (A * LOG2E)[None, :, :])
    c = dy0[:, None, :] * Ct[:, :, None]
    # the carry folded into the last token's term, as the state into the forward's first
    c = tl.where((rows == rows.shape[0] - 1)[:, None, None], c + a_next * carry[None, :, :], c)
    _, g_b = tl.associative_scan((tl.flip(a_next, 0), tl.flip(c, 0)), 0, _combine)
    gs = tl.flip(g_b, 0)
    return gs, _row(gs, rows, 0)


@triton.jit
def _doc_block_states(u, dt, Bt, A, h, rows, start, h0_ptr, doc, dn, dn_mask, DMN, HAS_H0: tl.constexpr):
    """:func:`_block_states` in a packed row: at a document's first token (``start``) the state
    entering is that document's initial state (``h0 [N_docs, Dm, N]`` at row ``doc``; zeros
    without ``HAS_H0``) instead of the token before's (its decay ``a`` is set to 0 in the scan).
    Returns ``(hs, x, a)`` with ``a = exp(Δ A)`` as computed (not reset)."""
    a = _exp2(dt[:, None, :] * (A * LOG2E)[None, :, :])
    x = (dt * u)[:, None, :] * Bt[:, :, None]
    start3 = start[:, None, None]
    entering = tl.where((rows == 0)[:, None, None], h[None, :, :], 0.0)
    if HAS_H0:
        h0 = tl.load(h0_ptr + doc[:, None, None] * DMN + dn[None, :, :], mask=start3 & dn_mask[None, :, :],
                     other=0.0).to(tl.float32)
        entering = tl.where(start3, h0, entering)
    else:
        entering = tl.where(start3, 0.0, entering)
    _, hs = tl.associative_scan((tl.where(start3, 0.0, a), x + a * entering), 0, _combine)
    return hs, x, a


@triton.jit
def _doc_adjoint_scan(dt_next, A, dy0, Ct, carry, rows, end, dhT_ptr, doc, dn, dn_mask, DMN,
                      HAS_DHT: tl.constexpr):
    """:func:`_adjoint_scan` in a packed row: after a document's last token (``end``) the adjoint
    does not come back from the next token (its decay is 0) but from the gradient of that
    document's final state (``dhT [N_docs, Dm, N]`` at row ``doc``; zero without ``HAS_DHT``)."""
    end3 = end[:, None, None]
    a_next = tl.where(end3, 0.0, _exp2(dt_next[:, None, :] * (A * LOG2E)[None, :, :]))
    c = dy0[:, None, :] * Ct[:, :, None]
    if HAS_DHT:
        c += tl.load(dhT_ptr + doc[:, None, None] * DMN + dn[None, :, :], mask=end3 & dn_mask[None, :, :],
                     other=0.0).to(tl.float32)
    c = tl.where((rows == rows.shape[0] - 1)[:, None, None], c + a_next * carry[None, :, :], c)
    _, g_b = tl.associative_scan((tl.flip(a_next, 0), tl.flip(c, 0)), 0, _combine)
    gs = tl.flip(g_b, 0)
    return gs, _row(gs, rows, 0)


@triton.jit
def _fwd_kernel(
    u_ptr, delta_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, h0_ptr,
    y_ptr, hT_ptr, ckpt_ptr, hl_ptr, sdt_ptr,
    T, DM, N, G, PER_GROUP, NB, S, BPS, NBC, ZS, BCS, seq_ptr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_CKPT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr, NB_LOOP: tl.constexpr, SEGMENTED: tl.constexpr, CKPT_T: tl.constexpr,
    DT_GIVEN: tl.constexpr, VARLEN: tl.constexpr = False,
):
    """Program ``(b, channel block, s)``: time blocks ``[s·BPS, (s+1)·BPS)`` of segment ``s`` (the
    whole sequence when ``S == 1``; ``NB_LOOP``: ``BPS`` as a constexpr under the interpreter).
    With ``SEGMENTED`` the segment starts from the state folded from the segments before it:
    ``h ← exp(A ΣΔ_s') h + hl_s'`` (:func:`_fwd_carry_kernel`'s ``hl``, ``sdt``). With
    ``STORE_CKPT`` the state entering every ``CKPT_T`` tokens (``CKPT_T`` divides ``BLOCK_T``) goes
    to ``ckpt [B, NBC, Dm, N]``. With ``DT_GIVEN`` the step sizes are read from ``dt_ptr``
    (:func:`_dt_kernel`). ``ZS``, ``BCS``: elements from one token of z, of B and C, to the next.
    With ``VARLEN`` (one packed row, ``S == 1``) ``seq_ptr`` holds each token's document index
    ``[T]`` int32: the state restarts at each document's first token from its row of ``h0 [N_docs,
    Dm, N]`` (zeros without ``HAS_H0``) and each document's last state goes to its row of ``hT``."""
    b, seg, g, d, dmask, n, nmask, dn, dn_mask, A, bias = _program(A_ptr, bias_ptr, N, PER_GROUP, HAS_BIAS,
                                                                    BLOCK_D, BLOCK_N)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    if VARLEN:  # each document's initial state enters at its first token (_doc_block_states)
        h = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    elif HAS_H0:
        h = tl.load(h0_ptr + b * DM * N + dn, mask=dn_mask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if SEGMENTED:  # the state entering this segment, from the segments before it
        sp = 0
        while sp < seg:
            sdt = tl.load(sdt_ptr + (b * S + sp) * DM + d, mask=dmask, other=0.0)
            h = _exp2(sdt[None, :] * (A * LOG2E)) * h + tl.load(hl_ptr + (b * S + sp) * DM * N + dn, mask=dn_mask, other=0.0)
            sp += 1
    rows = tl.arange(0, BLOCK_T)
    # software-pipelined over time blocks (STAGES): the next block's loads overlap this one's scan;
    # blocks past NB (the last segment's tail) are all masked: a = 1, b = 0, nothing stored
    for i in tl.range(0, NB_LOOP if NB_LOOP > 0 else BPS, num_stages=STAGES):
        blk = seg * BPS + i
        if STORE_CKPT:  # the state entering this block (its first sub-block)
            tl.store(ckpt_ptr + (b * NBC + blk * (BLOCK_T // CKPT_T)) * DM * N + dn, h, mask=dn_mask & (blk < NB))
        t = blk * BLOCK_T + rows
        m2, off, u, dt, bc_off, bc_mask, Bt = _block_inputs(
            u_ptr, delta_ptr, dt_ptr, B_ptr, bias, b, t, d, dmask, g, n, nmask, T, DM, N, BCS, HAS_BIAS, SOFTPLUS,
            DT_GIVEN)
        Ct = tl.load(C_ptr + bc_off, mask=bc_mask, other=0.0).to(tl.float32)
        if VARLEN:  # reset at each document's first token; each document's last state stored
            starts, ends = doc_block(seq_ptr, blk * BLOCK_T, BLOCK_T, T)
            if starts:  # a document starts in this block
                doc, start, end = doc_rows(seq_ptr, t, T)
                hs, x, _ = _doc_block_states(u, dt, Bt, A, h, rows, start, h0_ptr, doc, dn, dn_mask, DM * N, HAS_H0)
            else:  # most blocks (documents of hundreds of tokens): the plain block
                hs, x = _block_states(u, dt, Bt, A, h, rows)
            if ends:
                doc, start, end = doc_rows(seq_ptr, t, T)
                tl.store(hT_ptr + doc[:, None, None] * (DM * N) + dn[None, :, :], hs,
                         mask=end[:, None, None] & dn_mask[None, :, :])
        else:
            hs, x = _block_states(u, dt, Bt, A, h, rows)  # states of the block's tokens, on chip only
        if STORE_CKPT:  # the state entering each later sub-block: after the token before it
            for j in tl.static_range(1, BLOCK_T // CKPT_T):
                sub = blk * (BLOCK_T // CKPT_T) + j
                h_sub = _row(hs, rows, j * CKPT_T - 1)
                tl.store(ckpt_ptr + (b * NBC + sub) * DM * N + dn, h_sub, mask=dn_mask & (sub < NBC))
        y = tl.sum(hs * Ct[:, :, None], axis=1)
        if HAS_D:
            y += Dv[None, :] * u
        if HAS_Z:
            zv = tl.load(z_ptr + (off + (b * T + t)[:, None] * (ZS - DM)), mask=m2, other=0.0).to(tl.float32)
            y = y * zv * tl.sigmoid(zv)
        tl.store(y_ptr + off, y, mask=m2)
        h = _row(hs, rows, BLOCK_T - 1)
    if not VARLEN:
        tl.store(hT_ptr + b * DM * N + dn, h, mask=dn_mask & (seg == S - 1))


@triton.jit
def _fwd_carry_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, bias_ptr, hl_ptr, sdt_ptr,
    T, DM, N, G, PER_GROUP, NB, S, BPS, BCS,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NB_LOOP: tl.constexpr,
):
    """Program ``(b, channel block, s)``: segment ``s``'s own contribution to the state after it,
    from a zero state (``hl [B, S, Dm, N]``), and its step sizes' sum (``sdt [B, S, Dm]``: the
    segment multiplies the state entering it by ``exp(A ΣΔ)``), both float32."""
    b, seg, g, d, dmask, n, nmask, dn, dn_mask, A, bias = _program(A_ptr, bias_ptr, N, PER_GROUP, HAS_BIAS,
                                                                    BLOCK_D, BLOCK_N)
    h = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    sdt = tl.zeros([BLOCK_D], dtype=tl.float32)
    rows = tl.arange(0, BLOCK_T)
    for i in tl.range(0, NB_LOOP if NB_LOOP > 0 else BPS):
        t = (seg * BPS + i) * BLOCK_T + rows
        m2, off, u, dt, bc_off, bc_mask, Bt = _block_inputs(
            u_ptr, delta_ptr, delta_ptr, B_ptr, bias, b, t, d, dmask, g, n, nmask, T, DM, N, BCS, HAS_BIAS, SOFTPLUS,
            False)
        hs, x = _block_states(u, dt, Bt, A, h, rows)
        h = _row(hs, rows, BLOCK_T - 1)
        sdt += tl.sum(dt, axis=0)
    tl.store(hl_ptr + (b * S + seg) * DM * N + dn, h, mask=dn_mask)
    tl.store(sdt_ptr + (b * S + seg) * DM + d, sdt, mask=dmask)


@triton.jit
def _block_offsets(blk, rows, b, g, d, dmask, n, nmask, T, DM, N, BCS, BLOCK_T: tl.constexpr):
    """Time block ``blk``'s rows ``t``, the mask and offsets of its ``[BLOCK_T, BLOCK_D]`` tiles of
    contiguous ``[B, T, Dm]`` tensors, and those of its ``[BLOCK_T, BLOCK_N]`` tiles of a
    ``[B, T, G, N]`` tensor whose tokens are ``BCS`` elements apart."""
    t = blk * BLOCK_T + rows
    tmask = t < T
    bc_off = (b * T + t)[:, None] * BCS + (g * N + n)[None, :]
    return (t, tmask[:, None] & dmask[None, :], (b * T + t)[:, None] * DM + d[None, :], bc_off,
            tmask[:, None] & nmask[None, :])


@triton.jit
def _bwd_loads(blk, u_ptr, delta_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, ckpt_ptr, dy_ptr, b, g, d, dmask, n, nmask, dn,
               dn_mask, rows, T, DM, N, NB, ZS, BCS, HAS_Z: tl.constexpr, HAS_DY: tl.constexpr, DT_GIVEN: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Time block ``blk``'s inputs to :func:`_bwd_kernel`, as loaded (each in its own dtype):
    ``(u, step, step one token on, B, C, dy (float32, zeros when absent), z, the saved state
    entering the block)``; zeros past T. ``step`` is ``delta`` as stored or, with ``DT_GIVEN``,
    the step size Δ read from ``dt_ptr`` (float32, :func:`_dt_kernel`); then ``delta`` is read
    only where the softplus's derivative needs it (in :func:`_bwd_block`)."""
    t, m2, off, bc_off, bc_mask = _block_offsets(blk, rows, b, g, d, dmask, n, nmask, T, DM, N, BCS, BLOCK_T)
    u = tl.load(u_ptr + off, mask=m2, other=0.0)
    if DT_GIVEN:
        step = tl.load(dt_ptr + off, mask=m2, other=0.0)
        step_next = tl.load(dt_ptr + off + DM, mask=((t + 1) < T)[:, None] & dmask[None, :], other=0.0)
    else:
        step = tl.load(delta_ptr + off, mask=m2, other=0.0)
        step_next = tl.load(delta_ptr + off + DM, mask=((t + 1) < T)[:, None] & dmask[None, :], other=0.0)
    Bt = tl.load(B_ptr + bc_off, mask=bc_mask, other=0.0)
    Ct = tl.load(C_ptr + bc_off, mask=bc_mask, other=0.0)
    dy = _rows_or_zeros(dy_ptr, off, m2, HAS_DY, BLOCK_T, BLOCK_D)
    if HAS_Z:
        zv = tl.load(z_ptr + (off + (b * T + t)[:, None] * (ZS - DM)), mask=m2, other=0.0)
    else:
        zv = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    h_start = tl.load(ckpt_ptr + (b * NB + blk) * DM * N + dn, mask=dn_mask & (blk < NB), other=0.0)
    return u, step, step_next, Bt, Ct, dy, zv, h_start


@triton.jit
def _bwd_block(blk, u, step, step_next, Bt, Ct, dy, zv, h_start, delta_ptr, du_ptr, ddelta_ptr, dz_ptr, dB_ptr, dC_ptr,
               b, g, d, dmask, n, nmask, A, bias, Dv, rows, carry, dA_acc, dD_acc, dbias_acc, T, DM, N, G, DZS,
               seq_ptr, h0_ptr, dhT_ptr, dh0_ptr, dn, dn_mask,
               HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
               DT_GIVEN: tl.constexpr, BLOCK_T: tl.constexpr, VARLEN: tl.constexpr, HAS_H0: tl.constexpr,
               HAS_DHT: tl.constexpr):
    """One time block ``blk`` of :func:`_bwd_kernel` from its inputs (:func:`_bwd_loads`):
    recompute its states from the saved one, run the adjoint back from ``carry`` (the adjoint at
    the next block's first token), store du, d(delta), dz, add to dB and dC; returns ``(carry at
    this block's first token, dA_acc, dD_acc, dbias_acc)`` with this block's sums added. dB and dC
    are contiguous ``[B, T, G, N]``; dz's tokens are ``DZS`` elements apart. With ``VARLEN``: the
    document resets of :func:`_doc_block_states` and :func:`_doc_adjoint_scan`, and each
    document's initial-state gradient ``exp(Δ A) g`` at its first token into its row of ``dh0``
    (with ``HAS_H0``)."""
    t, m2, off, bc_off, bc_mask = _block_offsets(blk, rows, b, g, d, dmask, n, nmask, T, DM, N, G * N, BLOCK_T)
    u = u.to(tl.float32)
    if DT_GIVEN:  # step and step_next are Δ and Δ one token on (zero past T)
        dt = step
        dt_next = step_next
        raw = step  # read only with the softplus, below
        if SOFTPLUS:  # the softplus's derivative needs delta + bias
            raw = _biased(tl.load(delta_ptr + off, mask=m2, other=0.0), bias, HAS_BIAS)
    else:
        dt, raw = _step_sizes(step, bias, m2, HAS_BIAS, SOFTPLUS)
        dt_next, _ = _step_sizes(step_next, bias, ((t + 1) < T)[:, None] & dmask[None, :], HAS_BIAS, SOFTPLUS)
    Bt = Bt.to(tl.float32)
    Ct = Ct.to(tl.float32)
    # recompute the block's states from the state that entered it
    if VARLEN:  # the document path only in the blocks where one starts or ends
        starts, ends = doc_block(seq_ptr, blk * BLOCK_T, BLOCK_T, T)
        if starts:
            doc, start, end = doc_rows(seq_ptr, t, T)
            hs, x, a = _doc_block_states(u, dt, Bt, A, h_start, rows, start, h0_ptr, doc, dn, dn_mask, DM * N,
                                         HAS_H0)
        else:
            hs, x = _block_states(u, dt, Bt, A, h_start, rows)
            a = x  # unread: no document starts here
    else:
        hs, x = _block_states(u, dt, Bt, A, h_start, rows)
    # output gate
    if HAS_Z:
        zv = zv.to(tl.float32)
        y0 = tl.sum(hs * Ct[:, :, None], axis=1)
        if HAS_D:
            y0 += Dv[None, :] * u
        sz = tl.sigmoid(zv)
        tl.store(dz_ptr + (off + (b * T + t)[:, None] * (DZS - DM)), dy * y0 * sz * (1.0 + zv * (1.0 - sz)), mask=m2)
        dy0 = dy * zv * sz
    else:
        dy0 = dy
    if VARLEN:
        if ends:
            doc, start, end = doc_rows(seq_ptr, t, T)
            gs, carry = _doc_adjoint_scan(dt_next, A, dy0, Ct, carry, rows, end, dhT_ptr, doc, dn, dn_mask, DM * N,
                                          HAS_DHT)
        else:
            gs, carry = _adjoint_scan(dt_next, A, dy0, Ct, carry, rows)
        if HAS_H0:  # each document's initial-state gradient, at its first token
            if starts:
                doc, start, end = doc_rows(seq_ptr, t, T)
                tl.store(dh0_ptr + doc[:, None, None] * (DM * N) + dn[None, :, :], a * gs,
                         mask=start[:, None, None] & dn_mask[None, :, :])
    else:
        gs, carry = _adjoint_scan(dt_next, A, dy0, Ct, carry, rows)
    # gradients; a_t h_{t-1} = h_t - Δ_t B_t u_t
    ah = hs - x
    gdt = gs * dt[:, None, :]
    dA_acc += tl.sum(gdt * ah, axis=0)
    gB = tl.sum(gs * Bt[:, :, None], axis=1)
    ddt = tl.sum(gs * ah * A[None, :, :], axis=1) + u * gB
    du = dt * gB
    if HAS_D:
        du += Dv[None, :] * dy0
        dD_acc += tl.sum(dy0 * u, axis=0)
    if SOFTPLUS:
        ddt = ddt * tl.sigmoid(raw)
    ddt = tl.where(m2, ddt, 0.0)
    dbias_acc += tl.sum(ddt, axis=0)
    tl.store(du_ptr + off, du, mask=m2)
    tl.store(ddelta_ptr + off, ddt, mask=m2)
    tl.atomic_add(dB_ptr + bc_off, tl.sum(gdt * u[:, None, :], axis=2), mask=bc_mask, sem="relaxed")
    tl.atomic_add(dC_ptr + bc_off, tl.sum(dy0[:, None, :] * hs, axis=2), mask=bc_mask, sem="relaxed")
    return carry, dA_acc, dD_acc, dbias_acc


@triton.jit
def _bwd_kernel(
    u_ptr, delta_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, ckpt_ptr, dy_ptr, dhT_ptr,
    du_ptr, ddelta_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, dbias_ptr, dh0_ptr, gl_ptr, sdtn_ptr,
    T, DM, N, G, PER_GROUP, NB, S, BPS, ZS, DZS, BCS, seq_ptr, h0_ptr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_DY: tl.constexpr, HAS_DHT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENTED: tl.constexpr,
    PREFETCH: tl.constexpr, DT_GIVEN: tl.constexpr, VARLEN: tl.constexpr = False, HAS_H0: tl.constexpr = False,
):
    """Program ``(b, channel block, s)``: the time blocks of segment ``s`` in reverse (the whole
    sequence when ``S == 1``). With ``DT_GIVEN`` the step sizes are read from ``dt_ptr``
    (:func:`_dt_kernel`) instead of computed from ``delta`` in the loop. With ``SEGMENTED`` the adjoint entering the segment from after it
    is folded from the segments after it: ``g ← gl_s' + exp(A ΣΔ'_s') g``
    (:func:`_bwd_carry_kernel`'s ``gl``, ``sdtn``). dA, dD and d(delta_bias) are written per
    (batch, segment), summed in torch. ``ZS``, ``DZS``, ``BCS``: elements from one token of z, of
    dz, of B and C, to the next. With ``VARLEN`` (one packed row, ``S == 1``): ``seq_ptr`` each
    token's document index ``[T]`` int32, ``h0`` (with ``HAS_H0``), ``dhT`` (with ``HAS_DHT``) and
    ``dh0`` per document ``[N_docs, Dm, N]`` (:func:`_bwd_block`)."""
    b, seg, g, d, dmask, n, nmask, dn, dn_mask, A, bias = _program(A_ptr, bias_ptr, N, PER_GROUP, HAS_BIAS,
                                                                    BLOCK_D, BLOCK_N)
    Dv = _channel_values(D_ptr, d, dmask, HAS_D)
    if VARLEN:  # each document's final-state gradient enters at its last token (_doc_adjoint_scan)
        carry = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    elif HAS_DHT:  # the adjoint after the last token
        carry = tl.load(dhT_ptr + b * DM * N + dn, mask=dn_mask, other=0.0).to(tl.float32)
    else:
        carry = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if SEGMENTED:  # the adjoint entering this segment's last token, from the segments after it
        sp = S - 1
        while sp > seg:
            sdtn = tl.load(sdtn_ptr + (b * S + sp) * DM + d, mask=dmask, other=0.0)
            carry = tl.load(gl_ptr + (b * S + sp) * DM * N + dn, mask=dn_mask, other=0.0) + \
                _exp2(sdtn[None, :] * (A * LOG2E)) * carry
            sp -= 1
    dA_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dD_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    dbias_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    rows = tl.arange(0, BLOCK_T)
    first = seg * BPS
    last = tl.minimum(NB, first + BPS) - 1
    if PREFETCH:  # each block's inputs are loaded during the block after it (the one before in this loop)
        nxt = _bwd_loads(last, u_ptr, delta_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, ckpt_ptr, dy_ptr, b, g, d, dmask, n,
                         nmask, dn, dn_mask, rows, T, DM, N, NB, ZS, BCS, HAS_Z, HAS_DY, DT_GIVEN, BLOCK_T, BLOCK_D)
    blk = last
    while blk >= first:  # this segment's time blocks in reverse
        if PREFETCH:
            cur = nxt
            nxt = _bwd_loads(tl.maximum(blk - 1, first), u_ptr, delta_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, ckpt_ptr,
                             dy_ptr, b, g, d, dmask, n, nmask, dn, dn_mask, rows, T, DM, N, NB, ZS, BCS, HAS_Z,
                             HAS_DY, DT_GIVEN, BLOCK_T, BLOCK_D)
        else:
            cur = _bwd_loads(blk, u_ptr, delta_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, ckpt_ptr, dy_ptr, b, g, d, dmask, n,
                             nmask, dn, dn_mask, rows, T, DM, N, NB, ZS, BCS, HAS_Z, HAS_DY, DT_GIVEN, BLOCK_T, BLOCK_D)
        u, step, step_next, Bt, Ct, dy, zv, h_start = cur
        carry, dA_acc, dD_acc, dbias_acc = _bwd_block(
            blk, u, step, step_next, Bt, Ct, dy, zv, h_start, delta_ptr, du_ptr, ddelta_ptr, dz_ptr, dB_ptr, dC_ptr,
            b, g, d, dmask, n, nmask, A, bias, Dv, rows, carry, dA_acc, dD_acc, dbias_acc, T, DM, N, G, DZS,
            seq_ptr, h0_ptr, dhT_ptr, dh0_ptr, dn, dn_mask,
            HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, DT_GIVEN, BLOCK_T, VARLEN, HAS_H0, HAS_DHT)
        blk -= 1
    if not VARLEN:  # initial-state gradient (the first segment's): exp(Δ_0 A) g_0
        raw0 = tl.load(delta_ptr + b * T * DM + d, mask=dmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            raw0 += bias
        a0 = _exp2(_step_size(raw0, SOFTPLUS)[None, :] * (A * LOG2E))
        tl.store(dh0_ptr + b * DM * N + dn, a0 * carry, mask=dn_mask & (seg == 0))
    part = b * S + seg  # this program's row of the per-(batch, segment) sums
    tl.store(dA_ptr + part * DM * N + dn, dA_acc, mask=dn_mask)
    if HAS_D:
        tl.store(dD_ptr + part * DM + d, dD_acc, mask=dmask)
    if HAS_BIAS:
        tl.store(dbias_ptr + part * DM + d, dbias_acc, mask=dmask)


@triton.jit
def _bwd_carry_kernel(
    delta_ptr, A_ptr, C_ptr, z_ptr, bias_ptr, dy_ptr, gl_ptr, sdtn_ptr,
    T, DM, N, G, PER_GROUP, NB, S, BPS, ZS, BCS,
    HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_DY: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program ``(b, channel block, s)``: the adjoint at segment ``s``'s first token from the
    segment's own outputs alone (nothing entering after it: ``gl [B, S, Dm, N]``), and the sum of
    the next tokens' step sizes over its tokens (``sdtn [B, S, Dm]``: the segment carries the
    adjoint entering after it back by ``exp(A ΣΔ')``), both float32. Only the output gradient
    ``dy`` feeds it (the final state's enters through the last segment)."""
    b, seg, g, d, dmask, n, nmask, dn, dn_mask, A, bias = _program(A_ptr, bias_ptr, N, PER_GROUP, HAS_BIAS,
                                                                    BLOCK_D, BLOCK_N)
    carry = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    sdtn = tl.zeros([BLOCK_D], dtype=tl.float32)
    rows = tl.arange(0, BLOCK_T)
    first = seg * BPS
    blk = tl.minimum(NB, first + BPS) - 1
    while blk >= first:
        t = blk * BLOCK_T + rows
        tmask = t < T
        m2 = tmask[:, None] & dmask[None, :]
        off = (b * T + t)[:, None] * DM + d[None, :]
        dy0 = _rows_or_zeros(dy_ptr, off, m2, HAS_DY, BLOCK_T, BLOCK_D)
        if HAS_Z:
            zv = tl.load(z_ptr + (off + (b * T + t)[:, None] * (ZS - DM)), mask=m2, other=0.0).to(tl.float32)
            dy0 = dy0 * zv * tl.sigmoid(zv)
        bc_off = (b * T + t)[:, None] * BCS + (g * N + n)[None, :]
        Ct = tl.load(C_ptr + bc_off, mask=tmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        _, carry, dt_next = _block_adjoint(delta_ptr, bias, b, t, d, dmask, T, DM, A, dy0, Ct, carry, rows,
                                           HAS_BIAS, SOFTPLUS)
        sdtn += tl.sum(dt_next, axis=0)
        blk -= 1
    tl.store(gl_ptr + (b * S + seg) * DM * N + dn, carry, mask=dn_mask)
    tl.store(sdtn_ptr + (b * S + seg) * DM + d, sdtn, mask=dmask)


@triton.jit
def _dt_kernel(delta_ptr, bias_ptr, dt_ptr, ROWS, DM, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The step sizes Δ = softplus(delta + delta_bias) (or without either) of ``ROWS`` rows of a
    ``[ROWS, Dm]`` ``delta``, float32, into ``dt_ptr``, with the same arithmetic as the scan's
    kernels (:func:`_step_sizes`)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < DM
    m2 = (r < ROWS)[:, None] & dmask[None, :]
    off = r.to(tl.int64)[:, None] * DM + d[None, :]
    bias = _channel_values(bias_ptr, d, dmask, HAS_BIAS)
    dt, _ = _step_sizes(tl.load(delta_ptr + off, mask=m2, other=0.0), bias, m2, HAS_BIAS, SOFTPLUS)
    tl.store(dt_ptr + off, dt, mask=m2)


def _wave(cfg: dict, n: int, device: torch.device, block_t: int, per_sm: int) -> int | None:
    """Programs in one wave of ``per_sm`` programs per SM of ``device``, where the backward at the
    fixed setting ``cfg`` is the measured 4-wide 1-warp tile (N up to 16) in ``block_t``-token
    blocks; None elsewhere and under the interpreter (the grid rules below then do not apply)."""
    if launch.interpret() or (cfg["bwd_block_t"], cfg["bwd_block_d"], cfg["bwd_warps"]) != (block_t, 4, 1) or n > 16:
        return None
    return per_sm * launch.sm_count(device)


def _capped(programs: int, cfg: dict, n: int, device: torch.device) -> bool:
    """Whether the backward at the fixed setting ``cfg`` runs with its registers capped at
    :data:`BWD_MAXNREG`: the measured tile in 16-token blocks (:func:`_wave`) on a grid of
    ``programs`` that fills at least :data:`BWD_CAP_WAVES` waves of :data:`WAVE_PROGRAMS_PER_SM`
    uncapped programs per SM."""
    wave = _wave(cfg, n, device, 16, WAVE_PROGRAMS_PER_SM)
    return wave is not None and programs >= BWD_CAP_WAVES * wave


def _prefetched(programs: int, cfg: dict, n: int, device: torch.device) -> bool:
    """Whether the backward at the fixed setting ``cfg`` loads each time block's inputs a block
    ahead (:data:`BWD_PREFETCH` None): the measured tile in 8-token blocks (:func:`_wave`) on a
    grid of ``programs`` that fills less than :data:`BWD_PREFETCH_WAVES` waves of
    :data:`BWD_PROGRAMS_PER_SM` programs per SM."""
    wave = _wave(cfg, n, device, 8, BWD_PROGRAMS_PER_SM)
    return wave is not None and programs < BWD_PREFETCH_WAVES * wave


# Time segments. One program per (sequence, channel block) runs the whole sequence. A grid can
# instead run its time blocks in S segments side by side: a first pass gives each segment's own
# contribution to the state after it (the forward) or to the adjoint before it (the backward) and
# its step sizes' sum, each segment folds those of the segments before (after) it into the state
# (adjoint) it starts from, then runs as before. The extra pass costs each element one exponential
# and one scan more. It was meant for long sequences in small batches, where the grid is under one
# wave of programs, but measured on an H200 it did not pay there: Mamba-130m's backward at B2 T8192
# (768 programs, under one wave of 8 per SM) took 4.75 ms in 3 segments against 4.08 ms whole
# (bf16, Triton 3.6, scripts/probe_scan_configs.py --segments in git at ee446cb;
# benchmarks/results/investigations/2026-12-03-probe-scan-segments-h200-65b7fee.jsonl), and in 8-token blocks
# loaded a block ahead 3.57 ms in 2 segments and 3.16 ms in 4 against 3.03 ms whole
# (benchmarks/results/investigations/2026-12-04-probe-scan-bwd-segments-h200-ad41f79.jsonl). So every grid runs whole
# unless SEGMENTS asks for more (tests force 2 to 5 against the float64 loop; probes time them).
SEGMENTS = 1


def _segments(n_blocks: int, varlen: bool = False) -> tuple[int, int]:
    """``(S, blocks per segment)`` for ``n_blocks`` time blocks in :data:`SEGMENTS` segments (fewer
    where the blocks do not fill them: ``S · per >= n_blocks > (S - 1) · per``); one segment for a
    packed row (``varlen``: its documents reset the state where they start, which the segments'
    carries do not model)."""
    per = triton.cdiv(n_blocks, max(1, min(1 if varlen else SEGMENTS, n_blocks)))
    return triton.cdiv(n_blocks, per), per


def _grid_shape(batch, groups, per_group, segments=1):
    return lambda args: (batch, groups * triton.cdiv(per_group, args["BLOCK_D"]), segments)


_fwd = launch.autotuned(_fwd_kernel, FWD_CONFIGS, TUNE_KEY + ["HAS_H0", "STORE_CKPT", "DT_GIVEN"], prune=_prune("fwd"))
# dB and dC start at zero and gather atomic adds: restored between autotuning trials
_bwd = launch.autotuned(_bwd_kernel, BWD_CONFIGS, TUNE_KEY + ["HAS_DY", "HAS_DHT", "PREFETCH", "DT_GIVEN"], prune=_prune("bwd"),
                       restore=("dB_ptr", "dC_ptr"))


def _step_size_buffer(delta, delta_bias, softplus):
    """Δ = softplus(delta + delta_bias) (either part where given) as a float32 tensor shaped as
    ``delta`` (:func:`_dt_kernel`), or None where Δ is ``delta`` itself (no softplus, no bias)."""
    if not softplus and delta_bias is None:
        return None
    batch, length, dm = delta.shape
    dt = launch.empty(delta.shape, torch.float32, delta.device)
    launch.run(_dt_kernel, (triton.cdiv(batch * length, DT_BLOCK_R), triton.cdiv(dm, DT_BLOCK_D)),
               delta, delta if delta_bias is None else delta_bias, dt, batch * length, dm,
               HAS_BIAS=delta_bias is not None, SOFTPLUS=softplus, BLOCK_R=DT_BLOCK_R, BLOCK_D=DT_BLOCK_D,
               fixed=dict(num_warps=4))
    return dt


def _strides(z, B) -> tuple[int, int]:
    """The token strides the kernels read z (``ZS``; any value without z) and B and C (``BCS``)
    with: inputs as :func:`_prepared` gives them (B and C at one stride)."""
    return (B.shape[2] * B.shape[3] if z is None else launch.row_stride(z)), launch.row_stride(B)


def _dz_buffer(dz_out, z):
    """Check ``dz_out``, where the backward is to write z's gradient: z's shape and dtype, its
    tokens evenly spaced (:func:`~hybridzoo.kernels.triton.launch.row_stride`)."""
    if z is None or dz_out.shape != z.shape or dz_out.dtype != z.dtype or launch.row_stride(dz_out) is None:
        got = "no z" if z is None else f"z {tuple(z.shape)} {z.dtype}"
        raise ValueError(f"selective_scan_grads (triton): dz_out must be a tensor shaped and typed as z, with "
                         f"evenly spaced tokens ({got}; dz_out {tuple(dz_out.shape)} {dz_out.dtype}, strides "
                         f"{dz_out.stride()})")
    return dz_out


def _forward(u, delta, A, B, C, D, z, delta_bias, softplus, initial_state, store_ckpt, seq_idx=None, n_docs=0):
    """Launch the forward on prepared inputs (:func:`_prepared`): ``(y, final, ckpt)``, ``ckpt`` the
    state entering each of the backward's time blocks ``[B, ceil(T / bwd_block_t), Dm, N]`` float32
    when ``store_ckpt``. A packed row (``seq_idx [T]`` int32, each token's document index, B = 1):
    ``initial_state`` and ``final`` are per document, ``[n_docs, Dm, N]``."""
    batch, length, dm = u.shape
    zs, bcs = _strides(z, B)
    groups, n = B.shape[2], A.shape[1]
    per_group = dm // groups
    block_n = max(triton.next_power_of_2(n), 2)
    cfg = _config(training=store_ckpt, block_n=block_n)
    n_blocks = triton.cdiv(length, cfg["block_t"])
    ckpt_t = cfg.get("bwd_block_t", cfg["block_t"])
    segments, per = _segments(n_blocks, seq_idx is not None)
    if seq_idx is not None and not launch.interpret():
        cfg["fwd_block_d"], cfg["fwd_warps"] = VARLEN_FWD_TILE.get((cfg["fwd_block_d"], cfg["fwd_warps"]),
                                                                   (cfg["fwd_block_d"], cfg["fwd_warps"]))
    y = launch.empty((batch, length, dm), u.dtype, u.device)
    final = launch.empty((batch if seq_idx is None else n_docs, dm, n), torch.float32, u.device)
    ckpt = launch.empty((batch, triton.cdiv(length, ckpt_t), dm, n) if store_ckpt else (1,), torch.float32,
                        u.device)
    hl = sdt = final  # unread with one segment
    if segments > 1:
        hl = launch.empty((batch, segments, dm, n), torch.float32, u.device)
        sdt = launch.empty((batch, segments, dm), torch.float32, u.device)
        launch.run(
            _fwd_carry_kernel, _grid_shape(batch, groups, per_group, segments),
            u, delta, A, B, u if delta_bias is None else delta_bias, hl, sdt,
            length, dm, n, groups, per_group, n_blocks, segments, per, bcs,
            HAS_BIAS=delta_bias is not None, SOFTPLUS=softplus, BLOCK_T=cfg["block_t"], BLOCK_N=block_n,
            NB_LOOP=launch.loop_count(per), fixed=dict(BLOCK_D=cfg["fwd_block_d"], num_warps=cfg["fwd_warps"]),
        )
    # a training forward reads Δ computed before it (FWD_DT_GIVEN); an inference one computes it
    dt = _step_size_buffer(delta, delta_bias, softplus) if FWD_DT_GIVEN and store_ckpt else None
    launch.run(
        _fwd, _grid_shape(batch, groups, per_group, segments),
        u, delta, delta if dt is None else dt, A, B, C, u if D is None else D, u if z is None else z,
        u if delta_bias is None else delta_bias, u if initial_state is None else initial_state,
        y, final, ckpt, hl, sdt,
        length, dm, n, groups, per_group, n_blocks, segments, per, triton.cdiv(length, ckpt_t), zs, bcs,
        u if seq_idx is None else seq_idx,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        SOFTPLUS=softplus, HAS_H0=initial_state is not None, STORE_CKPT=store_ckpt,
        BLOCK_T=cfg["block_t"], BLOCK_N=block_n, STAGES=cfg.get("fwd_stages", 1),
        NB_LOOP=launch.loop_count(per), SEGMENTED=segments > 1, CKPT_T=ckpt_t, DT_GIVEN=dt is not None,
        VARLEN=seq_idx is not None, fixed=dict(BLOCK_D=cfg["fwd_block_d"], num_warps=cfg["fwd_warps"]),
    )
    return y, final, ckpt


def _backward(u, delta, A, B, C, D, z, delta_bias, softplus, ckpt, dy, dfinal, initial_dtype, dz_out=None,
              seq_idx=None, initial_state=None, n_docs=0):
    """Launch the backward on prepared inputs and the forward's ``ckpt``: the gradients of
    ``(u, delta, A, B, C, D, z, delta_bias, initial_state)`` (None for a None input; the
    initial state's in ``initial_dtype``, None when there was none). dz goes to ``dz_out`` where
    given (z's shape and dtype, tokens evenly spaced: :func:`_dz_buffer`). A packed row
    (``seq_idx``, as in :func:`_forward`) also reads the per-document ``initial_state`` (its
    states restart from it), and ``dfinal`` and the initial state's gradient are per document."""
    cfg = _config(training=True, block_n=max(triton.next_power_of_2(A.shape[1]), 2))
    batch, length, dm = u.shape
    groups, n = B.shape[2], A.shape[1]
    block_t = cfg["bwd_block_t"]
    if ckpt.shape != (batch, triton.cdiv(length, block_t), dm, n):
        raise ValueError(f"selective_scan (triton): the saved block states have shape {tuple(ckpt.shape)}, "
                         f"expected {(batch, triton.cdiv(length, block_t), dm, n)} for these inputs")
    per_group = dm // groups
    dev = u.device
    n_blocks, block_n = ckpt.shape[1], max(triton.next_power_of_2(n), 2)
    programs = batch * groups * triton.cdiv(per_group, cfg["bwd_block_d"])
    segments, per = _segments(n_blocks, seq_idx is not None)
    fixed = dict(BLOCK_D=cfg["bwd_block_d"], num_warps=cfg["bwd_warps"])
    if cfg.get("bwd_maxnreg"):
        fixed["maxnreg"] = cfg["bwd_maxnreg"]
    elif "bwd_maxnreg" not in cfg and _capped(programs * segments, cfg, n, dev):
        fixed["maxnreg"] = BWD_MAXNREG
    prefetch = cfg.get("bwd_prefetch")
    prefetch = _prefetched(programs * segments, cfg, n, dev) if prefetch is None else bool(prefetch)
    du = launch.empty(u.shape, u.dtype, dev)
    ddelta = launch.empty(delta.shape, delta.dtype, dev)
    dz = None if z is None else (launch.empty(z.shape, z.dtype, dev) if dz_out is None else dz_out)
    zs, bcs = _strides(z, B)
    dzs = dm if dz is None else launch.row_stride(dz)
    dB = torch.zeros(B.shape, dtype=torch.float32, device=dev)  # atomics accumulate here
    dC = torch.zeros(C.shape, dtype=torch.float32, device=dev)
    dA = launch.empty((batch, segments, dm, n), torch.float32, dev)  # per batch and segment, summed below
    dD = None if D is None else launch.empty((batch, segments, dm), torch.float32, dev)
    dbias = None if delta_bias is None else launch.empty((batch, segments, dm), torch.float32, dev)
    dh0 = launch.empty((batch if seq_idx is None else max(n_docs, 1), dm, n), torch.float32, dev)
    dy = None if dy is None else dy.contiguous()
    dfinal = None if dfinal is None else dfinal.contiguous()
    # Δ once, float32, before the backward reads it twice a token (Δ and Δ one token on)
    dt = _step_size_buffer(delta, delta_bias, softplus) if BWD_DT_GIVEN else None
    gl = sdtn = dh0  # unread with one segment
    if segments > 1:
        gl = launch.empty((batch, segments, dm, n), torch.float32, dev)
        sdtn = launch.empty((batch, segments, dm), torch.float32, dev)
        launch.run(
            _bwd_carry_kernel, _grid_shape(batch, groups, per_group, segments),
            delta, A, C, u if z is None else z, u if delta_bias is None else delta_bias, u if dy is None else dy,
            gl, sdtn, length, dm, n, groups, per_group, n_blocks, segments, per, zs, bcs,
            HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=softplus, HAS_DY=dy is not None,
            BLOCK_T=block_t, BLOCK_N=block_n,
            fixed=dict(BLOCK_D=cfg["bwd_block_d"], num_warps=cfg["bwd_warps"]),
        )
    launch.run(
        _bwd, _grid_shape(batch, groups, per_group, segments),
        u, delta, delta if dt is None else dt, A, B, C, u if D is None else D, u if z is None else z,
        u if delta_bias is None else delta_bias, ckpt,
        u if dy is None else dy, u if dfinal is None else dfinal,
        du, ddelta, du if dz is None else dz, dB, dC, dA,
        dA if dD is None else dD, dA if dbias is None else dbias, dh0, gl, sdtn,
        length, dm, n, groups, per_group, n_blocks, segments, per, zs, dzs, bcs,
        u if seq_idx is None else seq_idx, u if initial_state is None else initial_state,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None,
        SOFTPLUS=softplus, HAS_DY=dy is not None, HAS_DHT=dfinal is not None,
        BLOCK_T=block_t, BLOCK_N=block_n, SEGMENTED=segments > 1, PREFETCH=prefetch, DT_GIVEN=dt is not None,
        VARLEN=seq_idx is not None, HAS_H0=seq_idx is not None and initial_state is not None, fixed=fixed,
    )
    return (
        du, ddelta, dA.sum((0, 1)).to(A.dtype), dB.to(B.dtype), dC.to(C.dtype),
        None if D is None else dD.sum((0, 1)).to(D.dtype), dz,
        None if delta_bias is None else dbias.sum((0, 1)).to(delta_bias.dtype),
        None if initial_dtype is None else dh0.to(initial_dtype),
    )


class _SelectiveScanFn(torch.autograd.Function):
    """Inputs as :func:`_prepared` gives them (B, C ``[B, T, G, N]``); ``seq_idx`` None or, for a
    packed row, each token's document index (:func:`_packed`)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, softplus, initial_state, seq_idx, n_docs):
        y, final, ckpt = _forward(u, delta, A, B, C, D, z, delta_bias, softplus, initial_state,
                                  store_ckpt=any(ctx.needs_input_grad), seq_idx=seq_idx, n_docs=n_docs)
        # a packed row's backward restarts each document from its initial state
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, ckpt, seq_idx,
                              None if seq_idx is None else initial_state)
        ctx.softplus, ctx.n_docs = softplus, n_docs
        ctx.initial_dtype = None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        u, delta, A, B, C, D, z, delta_bias, ckpt, seq_idx, initial_state = ctx.saved_tensors
        grads = _backward(u, delta, A, B, C, D, z, delta_bias, ctx.softplus, ckpt, dy, dfinal, ctx.initial_dtype,
                          seq_idx=seq_idx, initial_state=initial_state, n_docs=ctx.n_docs)
        return (*grads[:8], None, grads[8], None, None)


def _packed(cu_seqlens, u, A, initial_state, what: str):
    """``(seq_idx, n_docs)`` of a packed call: each token's document index ``[T]`` int32 on u's
    device and the number of documents, after checking ``cu_seqlens`` (:func:`hybridzoo.kernels.
    varlen.check_cu_seqlens`), the batch of one row and the per-document ``initial_state [N_docs,
    Dm, N]``; ``(None, 0)`` without ``cu_seqlens``."""
    if cu_seqlens is None:
        return None, 0
    from hybridzoo.kernels.varlen import check_cu_seqlens, seq_idx_from_cu_seqlens

    if u.dim() != 3 or u.shape[0] != 1:
        raise ValueError(f"{what} (triton): with cu_seqlens the documents are packed in one row, u [1, total, Dm]; "
                         f"got u {tuple(u.shape)}")
    cu = check_cu_seqlens(cu_seqlens, u.shape[1], u.device)
    n_docs = cu.numel() - 1
    expected = (n_docs, u.shape[2], A.shape[-1])
    if initial_state is not None and tuple(initial_state.shape) != expected:
        raise ValueError(f"{what} (triton): with cu_seqlens initial_state is per document, [N_docs, Dm, N] = "
                         f"{list(expected)}; got {tuple(initial_state.shape)}")
    return seq_idx_from_cu_seqlens(cu, u.shape[1]).to(device=u.device, dtype=torch.int32).contiguous(), n_docs


def _prepared(u, delta, A, B, C, D, z, delta_bias, initial_state, what: str, packed: bool = False):
    """The checks of the op and its inputs as the kernels take them: B and C ``[B, T, G, N]``;
    z, B and C read in place where their tokens are evenly spaced (a slice of the channels of a
    wider tensor: Mamba's gate half of ``in_proj``'s output, the B and C columns of ``x_proj``'s;
    B and C with one stride), everything else contiguous; raises on float64 or a non-CUDA device
    outside the interpreter. ``packed``: ``initial_state`` is per document, checked by
    :func:`_packed`."""
    groups = _check(u, delta, A, B, C, D, z, delta_bias, None if packed else initial_state, seq=True)
    launch.require_usable(what, u.device, u, delta, A, B, C, D, z, delta_bias, initial_state)
    batch, length, _ = u.shape
    n = A.shape[1]
    B4, C4 = B.reshape(batch, length, groups, n), C.reshape(batch, length, groups, n)
    bcs = launch.row_stride(B4)
    if bcs is None or bcs != launch.row_stride(C4):
        B4, C4 = B4.contiguous(), C4.contiguous()
    u_, delta_, A_, D_, bias_ = (None if x is None else x.contiguous() for x in (u, delta, A, D, delta_bias))
    z_ = None if z is None else launch.token_rows(z)
    state = None if initial_state is None else initial_state.contiguous()
    return u_, delta_, A_, B4, C4, D_, z_, bias_, state


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mamba-1 selective scan, fused Triton kernels (forward and backward).

    Args:
        u, delta, z: ``[B, T, Dm]`` float16/bfloat16/float32 (z may be None).
        A: ``[Dm, N]`` (negative), usually float32.
        B, C: ``[B, T, N]`` or ``[B, T, G, N]``, channel ``d`` using group ``d // (Dm / G)``.
        D, delta_bias: ``[Dm]`` or None.
        delta_softplus: apply softplus to ``delta + delta_bias``.
        initial_state: ``[B, Dm, N]`` or None (zeros); computed in float32.
        output_final_state: also return the state after the last token.
        cu_seqlens: None, or int32 ``[N_docs + 1]`` cumulative document lengths of documents packed
            in one row (B = 1, ``T = cu_seqlens[-1]``): the state restarts at each document's first
            token from that document's ``initial_state [N_docs, Dm, N]`` (zeros if None), and
            ``final_state`` is ``[N_docs, Dm, N]``, each document's last state. Handled in the
            kernels' time blocks (a document index per token), with no padding.

    Returns:
        ``(y [B, T, Dm] in u.dtype, final_state [B, Dm, N] float32 or None)``. Gradients flow to
        every tensor input, ``initial_state`` included, and from ``final_state``.
    """
    packed = cu_seqlens is not None
    if u.shape[1] == 0:
        _prepared(u, delta, A, B, C, D, z, delta_bias, initial_state, "selective_scan", packed)
        _packed(cu_seqlens, u, A, initial_state, "selective_scan")
        return _reference_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                               initial_state, output_final_state)
    prepared = _prepared(u, delta, A, B, C, D, z, delta_bias, initial_state, "selective_scan", packed)
    seq_idx, n_docs = _packed(cu_seqlens, u, A, initial_state, "selective_scan")
    y, final = _SelectiveScanFn.apply(*prepared[:8], bool(delta_softplus), prepared[8], seq_idx, n_docs)
    return y, (final if output_final_state else None)


def selective_scan_saved(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None = None, z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False, initial_state: torch.Tensor | None = None, *,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`selective_scan`'s forward for a caller that keeps its output and takes the backward
    later from :func:`selective_scan_grads` (no autograd graph is built).

    Returns:
        ``(y [B, T, Dm] in u.dtype, final_state [B, Dm, N] float32, saved)``: ``saved`` is the
        state entering each time block of the backward, ``[B, ceil(T / bwd_block_t), Dm, N]``
        float32 (``bwd_block_t`` from :func:`_config`), which the backward restarts from. With
        ``cu_seqlens`` (as in :func:`selective_scan`) ``final_state`` is ``[N_docs, Dm, N]``.
    """
    if u.shape[1] == 0:
        raise ValueError("selective_scan_saved (triton): T must be at least 1")
    prepared = _prepared(u, delta, A, B, C, D, z, delta_bias, initial_state, "selective_scan_saved",
                         cu_seqlens is not None)
    seq_idx, n_docs = _packed(cu_seqlens, u, A, initial_state, "selective_scan_saved")
    with torch.no_grad():
        return _forward(*prepared[:8], bool(delta_softplus), prepared[8], store_ckpt=True, seq_idx=seq_idx,
                        n_docs=n_docs)


def selective_scan_grads(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None, saved: torch.Tensor, dy: torch.Tensor | None,
    dfinal: torch.Tensor | None, delta_softplus: bool = False, dz_out: torch.Tensor | None = None, *,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of :func:`selective_scan` w.r.t. ``(u, delta, A, B, C, D, z, delta_bias,
    initial_state)`` from those of its outputs (``dy [B, T, Dm]``, ``dfinal [B, Dm, N]``; None
    means zero), given the same inputs and the ``saved`` block states of
    :func:`selective_scan_saved`. Each gradient comes in its input's dtype and shape (B and C as
    given, ``[B, T, N]`` or ``[B, T, G, N]``), None for a None input. ``dz_out``: where to write
    z's gradient (z's shape and dtype, tokens evenly spaced, e.g. the gate half of ``in_proj``'s
    gradient), returned as it; None: a new tensor. ``cu_seqlens``: that of the forward
    (``dfinal`` and the initial state's gradient then ``[N_docs, Dm, N]``)."""
    prepared = _prepared(u, delta, A, B, C, D, z, delta_bias, initial_state, "selective_scan_grads",
                         cu_seqlens is not None)
    seq_idx, n_docs = _packed(cu_seqlens, u, A, initial_state, "selective_scan_grads")
    dz_out = None if dz_out is None else _dz_buffer(dz_out, z)
    with torch.no_grad():
        grads = list(_backward(*prepared[:8], bool(delta_softplus), saved.contiguous(), dy, dfinal,
                               None if initial_state is None else initial_state.dtype, dz_out,
                               seq_idx=seq_idx, initial_state=prepared[8] if seq_idx is not None else None,
                               n_docs=n_docs))
    grads[3], grads[4] = grads[3].reshape(B.shape), grads[4].reshape(C.shape)
    return tuple(grads)
