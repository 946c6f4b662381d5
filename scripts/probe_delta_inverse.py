"""Probe: cost and accuracy of four forms of the delta rule's triangular inverse (session 9).

One kernel computes a chunk's A = strictly_lower(diag(beta) K K^T * Gamma) and (I + A)^-1 (float32
out), in one of four forms:

    MODE 0: as delta_rule._unit_lower_inverse: rows of the 16 x 16 diagonal blocks picked by
            reductions, the blocks merged by 3xTF32 dots;
    MODE 1: the same with single-pass TF32 merges;
    MODE 2: rows read back from a float32 scratch copy of A (as fla's solve_tril reads its A), 3xTF32;
    MODE 3: MODE 2 with TF32 merges.

Each is timed (bf16 at fla's anchor shape B2 T16384 H16 K128; fp32 at B2 T4096) and compared with a
float64 triangular solve, on random normalised keys and on an adversarial chunk (identical keys,
beta 1, no decay: A = strictly lower ones, whose inverse is bidiagonal). The op's _wy_fwd_kernel is
timed too, in both forms (computing Tm, and HAS_TM: reading it).

    python3 scripts/probe_delta_inverse.py . OUT.json          # on a GPU
    TRITON_INTERPRET=1 python3 scripts/probe_delta_inverse.py . OUT.json   # CPU smoke, tiny shapes
    python3 scripts/probe_delta_inverse.py . --compile         # sm_90 registers / spills, no GPU

Result on an H200 (benchmarks/results/2026-11-30-probe-delta-inverse-h200.json): MODE 0 stays.
On random inputs every form has the same error (A's bf16 operands dominate it); on the
adversarial chunk TF32 merges give 1.36e-2 relative error, 3.5x bf16's unit roundoff 2^-8
(3xTF32: 5e-6), for 0.27 ms of 0.85 saved; the scratch read-back with 3xTF32 spills ~2 KB per
thread on sm_90 (``--compile``, recorded in the JSON) and is 2.8x slower.
"""
import json, sys
root, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
sys.path.insert(0, root + "/scripts")
import torch, triton
import triton.language as tl
from hybridzoo.kernels.triton import delta_rule as dr

INV = tl.constexpr(16)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CPU = DEV == "cpu"


@triton.jit
def _inv_kernel(k_ptr, beta_ptr, la_ptr, tm_ptr, scr_ptr, T, N,
                H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BKW: tl.constexpr,
                PREC: tl.constexpr, MODE: tl.constexpr, MPREC: tl.constexpr):
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    b, h = i_bh // H, i_bh % H
    DT = k_ptr.dtype.element_ty
    mask_t, rows, rows_k = dr._chunk_rows(b, h, i_n, T, H, G, C)
    offs_c = tl.arange(0, C)
    beta = tl.load(beta_ptr + rows, mask=mask_t, other=0.0).to(tl.float32)
    gamma_mat, gamma_in, _, _ = dr._chunk_decays(la_ptr, rows, mask_t, C)
    a = tl.zeros([C, C], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BKW)):
        offs_k = i_k * BKW + tl.arange(0, BKW)
        key = dr._load_rows(k_ptr, rows_k, K, offs_k, mask_t, K)
        a += dr._dot(key * beta[:, None], tl.trans(key), DT, PREC)
    a = tl.where(offs_c[:, None] > offs_c[None, :], a * gamma_mat, 0.0)
    BLK: tl.constexpr = INV
    NB: tl.constexpr = C // BLK
    blk, i_b = tl.arange(0, NB), tl.arange(0, BLK)
    diag = blk[:, None, None, None] == blk[None, None, :, None]
    row = i_b[None, :, None]
    n = tl.zeros([NB, BLK, BLK], dtype=tl.float32)
    if MODE >= 2:
        scr = scr_ptr + (i_bh.to(tl.int64) * N + i_n) * C * C
        tl.store(scr + offs_c[:, None] * C + offs_c[None, :], a)
        tl.debug_barrier()
        for i in tl.static_range(1, BLK):
            a_i = tl.load(scr + (blk[:, None] * BLK + i) * C + blk[:, None] * BLK + i_b[None, :])
            n_i = -a_i - tl.sum(a_i[:, :, None] * n, axis=1)
            n = tl.where(row == i, n_i[:, None, :], n)
    else:
        a_d = tl.sum(tl.where(diag, tl.reshape(a, [NB, BLK, NB, BLK]), 0.0), axis=2)
        for i in tl.static_range(1, BLK):
            a_i = tl.sum(tl.where(row == i, a_d, 0.0), axis=1)
            n_i = -a_i - tl.sum(a_i[:, :, None] * n, axis=1)
            n = tl.where(row == i, n_i[:, None, :], n)
    n = tl.where(row == i_b[None, None, :], 1.0, n)
    d_inv = tl.reshape(tl.where(diag, n[:, :, None, :], 0.0), [C, C])
    r = tl.arange(0, C)
    same = (r[:, None] // BLK) == (r[None, :] // BLK)
    x = tl.dot(d_inv, tl.where(same, 0.0, a), input_precision=MPREC)
    t = d_inv - tl.dot(x, d_inv, input_precision=MPREC)
    t = d_inv - tl.dot(x, t, input_precision=MPREC)
    d_inv = d_inv - tl.dot(x, t, input_precision=MPREC)
    dr._store_rows(tm_ptr, rows, C, offs_c, mask_t, C, d_inv)


def inputs(B, T, H, K, dtype, adversarial=False):
    g = torch.Generator(device=DEV).manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=DEV, generator=g), dim=-1)
    beta = torch.rand(B, T, H, device=DEV, generator=g)
    la = -0.5 * torch.rand(B, T, H, device=DEV, generator=g)
    if adversarial:  # every key of a chunk the same, beta 1, no decay: A = strictly lower ones
        k = k[:, ::64].repeat_interleave(64, dim=1)[:, :T]
        beta = torch.ones_like(beta)
        la = torch.zeros_like(la)
    return k.to(dtype).contiguous(), beta.to(dtype).contiguous(), la.contiguous()


def reference(k, beta, la, C=64):
    B, T, H, K = k.shape
    kk = k.double().view(B, T // C, C, H, K).permute(0, 3, 1, 2, 4)
    bb = beta.double().view(B, T // C, C, H).permute(0, 3, 1, 2)
    ll = la.double().view(B, T // C, C, H).permute(0, 3, 1, 2)
    cs = ll.cumsum(-1)
    gam = torch.exp(cs[..., :, None] - cs[..., None, :])
    a = (bb[..., :, None] * kk @ kk.transpose(-1, -2)) * gam
    a = torch.tril(a, -1)
    eye = torch.eye(C, dtype=torch.float64, device=k.device)
    tm = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    return tm.permute(0, 2, 3, 1, 4).reshape(B, T, H, C)


if out == "--compile":  # each form compiled for sm_90 at K 128, the op's WY warps (no GPU needed)
    import kernel_resources
    rows = []
    for dt, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        cfg = dr._Config(torch.empty(1, 1, 16, 128, device="meta", dtype=torch_dtype),
                         torch.empty(1, 1, 16, 128, device="meta", dtype=torch_dtype), 64)
        types = dict(k_ptr=f"*{dt}", beta_ptr=f"*{dt}", la_ptr="*fp32", tm_ptr="*fp32", scr_ptr="*fp32",
                     T="i32", N="i32")
        for mode in range(4):
            consts = dict(H=16, G=1, K=128, C=64, BKW=64, PREC=cfg.prec, MODE=mode,
                          MPREC="tf32" if mode in (1, 3) else "tf32x3")
            row = dict(dtype=dt, mode=mode, num_warps=cfg.warps_wy,
                       **kernel_resources.resources(_inv_kernel, types, consts, cfg.warps_wy, 1))
            rows.append(row); print(json.dumps(row))
    sys.exit(0)

res = []
CASES = ((torch.bfloat16, (2, 16384, 16, 128), False), (torch.bfloat16, (2, 4096, 16, 128), True),
         (torch.float32, (2, 4096, 16, 128), False), (torch.float32, (2, 4096, 16, 128), True))
if CPU:
    CASES = tuple((d, (1, 128, 1, 32), a) for d, _, a in CASES)
for dtype, shape, adv in CASES:
    B, T, H, K = shape
    k, beta, la = inputs(B, T, H, K, dtype, adv)
    cfg = dr._Config(k, k, 64)
    N = cfg.N
    ref = reference(k, beta, la)
    scr = torch.empty(B * H * N * 64 * 64, device=DEV, dtype=torch.float32)
    for mode in range(4):
        tm = torch.full((B, T, H, 64), float("nan"), device=DEV)
        call = lambda: _inv_kernel[(N, B * H)](k, beta, la, tm, scr, T, N, H=H, G=1, K=K, C=64, BKW=64,
                                                PREC=cfg.prec, MODE=mode, MPREC="tf32" if mode in (1, 3) else "tf32x3", num_warps=cfg.warps_wy)
        try:
            call(); torch.cuda.synchronize() if not CPU else None
            err = float((tm.double() - ref).abs().max() / ref.abs().max())
            ms = triton.testing.do_bench(call, warmup=10, rep=100, return_mode="median") if not (adv or CPU) else None
            row = dict(dtype=str(dtype), shape=shape, adversarial=adv, mode=mode, rel_err=err, ms=ms)
        except Exception as e:  # noqa
            row = dict(dtype=str(dtype), shape=shape, adversarial=adv, mode=mode, error=repr(e)[-600:])
        res.append(row); print(json.dumps(row), flush=True)
    if not (adv or CPU):  # the whole WY forward as the op runs it (computes the inverse), and its HAS_TM form
        w = torch.empty(B, T, H, K, device=DEV, dtype=dtype); u = torch.empty(B, T, H, K, device=DEV)
        tmb = torch.empty(B, T, H, 64, device=DEV, dtype=dtype)
        for has_tm in (False, True):
            f = lambda: dr._wy_fwd_kernel[(N, B * H)](k, k, beta, la, tmb, w, u, T, HAS_TM=has_tm, **cfg.wy_consts())
            f()
            ms = triton.testing.do_bench(f, warmup=10, rep=100, return_mode="median")
            row = dict(dtype=str(dtype), shape=shape, kernel="_wy_fwd_kernel", has_tm=has_tm, ms=ms)
            res.append(row); print(json.dumps(row), flush=True)
json.dump(res, open(out, "w"), indent=1)
print("\nmode  dtype           adv    rel_err    ms")
for r in res:
    if "mode" in r:
        print(r["mode"], r["dtype"], r["adversarial"], f"{r.get('rel_err', float('nan')):.2e}", r.get("ms"), r.get("error", ""))
    else:
        print(r)
