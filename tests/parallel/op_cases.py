"""Single-process ground truths and sharded runs of every recurrent op (run inside spawned ranks).

Each case builds the whole sequence's inputs from one seed on every rank, runs the kernel op on
the whole sequence (the ground truth, computed by code that does not shard) and the sharded op on
this rank's slice, and checks outputs, final states and the gradients of every input (sequence
inputs: this rank's slice; weights: the sum over ranks; initial state: on rank 0) to 1e-10.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridzoo import kernels
from hybridzoo.parallel import recurrent_ops

TOL = 1e-10


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(b.dtype).tiny))


def _inputs(op: str, T: int, variant: str, seed: int = 0) -> tuple[dict, dict, list[str]]:
    """(sequence inputs [B, T, ...], other inputs, names of the sequence inputs)."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, **f64) * scale)

    B = 2
    if op in ("chunk_linear_attn", "chunk_delta_rule"):
        Hk, H, K, V = 1, 2, 4, 3
        seq = {"q": r(B, T, Hk, K), "k": r(B, T, Hk, K), "v": r(B, T, H, V)}
        if op == "chunk_delta_rule":
            seq["k"] = torch.nn.functional.normalize(seq["k"], dim=-1)
            seq["beta"] = torch.rand(B, T, H, generator=g, **f64)
            seq["log_a"] = -torch.rand(B, T, H, generator=g, **f64) * 0.3
        elif variant == "per_key":
            seq["log_a"] = -torch.rand(B, T, H, K, generator=g, **f64) * 0.3
        elif variant == "scalar":
            seq["log_a"] = -torch.rand(B, T, H, generator=g, **f64) * 0.3
        other = {"initial_state": r(B, H, K, V)}
    elif op == "selective_scan":
        Dm, N, G = 4, 3, 2
        seq = {"u": r(B, T, Dm), "delta": r(B, T, Dm, scale=0.5), "B": r(B, T, G, N),
               "C": r(B, T, G, N), "z": r(B, T, Dm)}
        other = {"A": -torch.rand(Dm, N, generator=g, **f64) - 0.2, "D": r(Dm),
                 "delta_bias": r(Dm, scale=0.3), "initial_state": r(B, Dm, N)}
    else:  # causal_conv1d
        Dm, W = 3, 4
        seq = {"x": r(B, T, Dm)}
        other = {"weight": r(Dm, W), "bias": r(Dm), "initial_state": r(B, W - 1, Dm)}
    return seq, other, list(seq)


def _call(module, op: str, args: dict, **extra):
    kw = dict(initial_state=args.get("initial_state"), output_final_state=True, **extra)
    if op == "chunk_linear_attn":
        return module.chunk_linear_attn(args["q"], args["k"], args["v"], args.get("log_a"),
                                        chunk_size=4, **kw)
    if op == "chunk_delta_rule":
        return module.chunk_delta_rule(args["q"], args["k"], args["v"], args["log_a"], args["beta"],
                                       chunk_size=4, **kw)
    if op == "selective_scan":
        return module.selective_scan(args["u"], args["delta"], args["A"], args["B"], args["C"],
                                     args["D"], args["z"], args["delta_bias"], True, **kw)
    return module.causal_conv1d(args["x"], args["weight"], args["bias"], activation="silu", **kw)


def check_op(rank: int, size: int, op: str, variant: str, method: str, T: int,
             dtype: torch.dtype = torch.float64, tol: float = TOL) -> None:
    seq, other, seq_names = _inputs(op, T, variant)
    seq = {n: t.to(dtype) for n, t in seq.items()}
    other = {n: t.to(dtype) for n, t in other.items()}
    every = {**seq, **other}
    for t in every.values():
        t.requires_grad_(True)
    o_ref, final_ref = _call(kernels, op, every)
    g = torch.Generator().manual_seed(1)
    grad_o = torch.randn(o_ref.shape, generator=g, dtype=torch.float64).to(dtype)
    grad_final = torch.randn(final_ref.shape, generator=g, dtype=torch.float64).to(dtype)
    ref_grads = torch.autograd.grad((o_ref * grad_o).sum() + (final_ref * grad_final).sum(),
                                    list(every.values()))
    ref_grads = dict(zip(every, ref_grads))

    Tl = T // size
    sl = slice(rank * Tl, (rank + 1) * Tl)
    local = {name: t.detach()[:, sl].clone().requires_grad_(True) for name, t in seq.items()}
    local.update({name: t.detach().clone().requires_grad_(True) for name, t in other.items()})
    o, final = _call(recurrent_ops, op, local, method=method)
    assert o.dtype == o_ref.dtype and final.dtype == final_ref.dtype
    assert _rel(o, o_ref[:, sl]) < tol, (op, rank, "output", _rel(o, o_ref[:, sl]))
    # the state after this rank's slice = the whole op's final state on the prefix
    prefix = {n: (t.detach()[:, :(rank + 1) * Tl] if n in seq_names else t.detach()) for n, t in every.items()}
    _, final_prefix = _call(kernels, op, prefix)
    assert _rel(final, final_prefix) < tol, (op, rank, "final state", _rel(final, final_prefix))
    last = rank == size - 1
    loss = (o * grad_o[:, sl]).sum() + ((final * grad_final).sum() if last else 0 * final.sum())
    grads = dict(zip(local, torch.autograd.grad(loss, list(local.values()), allow_unused=True)))
    for name, grad in grads.items():
        grad = torch.zeros_like(local[name]) if grad is None else grad
        if name in seq_names:
            want = ref_grads[name][:, sl]
        elif name == "initial_state":
            want = ref_grads[name] if rank == 0 else torch.zeros_like(grad)
        else:
            dist.all_reduce(grad)
            want = ref_grads[name]
        err = _rel(grad, want) if want.norm() > 0 else float(grad.norm())
        assert err < tol, (op, variant, method, rank, f"grad {name}", err)


CASES = [("chunk_linear_attn", "none"), ("chunk_linear_attn", "scalar"),
         ("chunk_linear_attn", "per_key"), ("chunk_delta_rule", ""), ("selective_scan", ""),
         ("causal_conv1d", "")]


def check_every_op(rank: int, size: int, T: int) -> None:
    recurrent_ops.SSM_CORRECTION_BLOCK = 5   # several blocks (and a ragged last one) per slice
    for op, variant in CASES:
        for method in ("sequential", "scan"):
            if op == "causal_conv1d" and method == "sequential":
                continue
            check_op(rank, size, op, variant, method, T)
        check_op(rank, size, op, variant, "scan", T, torch.float32, 1e-5)  # dtypes kept


def check_ring(rank: int, size: int, T: int) -> None:
    from hybridzoo.parallel.ring_attention import ring_attention, zigzag_shard

    g = torch.Generator().manual_seed(2)
    B, Hq, Hk, D, Dv = 2, 4, 2, 4, 3
    full = {"q": torch.randn(B, T, Hq, D, generator=g, dtype=torch.float64),
            "k": torch.randn(B, T, Hk, D, generator=g, dtype=torch.float64),
            "v": torch.randn(B, T, Hk, Dv, generator=g, dtype=torch.float64)}
    grad_o = torch.randn(B, T, Hq, Dv, generator=g, dtype=torch.float64)
    Tl = T // size
    for window in (None, 3, Tl + 2, 2 * Tl + 1):
        for t in full.values():
            t.requires_grad_(True)
        o_ref, _ = kernels.attention(full["q"], full["k"], full["v"], window=window)
        ref = torch.autograd.grad((o_ref * grad_o).sum(), list(full.values()))
        for layout in ("contiguous", "zigzag"):
            if layout == "contiguous":
                part = lambda x: x[:, rank * Tl:(rank + 1) * Tl]  # noqa: E731
            else:
                part = lambda x: zigzag_shard(x, rank, size)  # noqa: E731
            local = [part(t.detach()).clone().requires_grad_(True) for t in full.values()]
            o = ring_attention(*local, window=window, layout=layout)
            assert _rel(o, part(o_ref)) < TOL, (layout, window, rank, _rel(o, part(o_ref)))
            grads = torch.autograd.grad((o * part(grad_o)).sum(), local)
            for name, got, want in zip(full, grads, ref):
                assert _rel(got, part(want)) < TOL, (layout, window, rank, name, _rel(got, part(want)))
