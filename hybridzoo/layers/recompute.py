"""Run the inside of a mixer without keeping its activations: the backward recomputes them.

A Mamba mixer's training step used to keep, per token and layer, every intermediate of its
conv, gates, scan and norm (float32 copies of bf16 tensors among them: 73 kB per token for
Mamba-2 at d_model 1024, 5x mamba_ssm). :func:`recomputed` keeps only the tensors it is given
(the in-projection's output, the parameters and the carried states) and, in the backward, runs
the same function again under the forward's autocast state with autograd on, then backpropagates
through that fresh graph. The gradients are those of the plain call: the same operations run on
the same inputs (checked bit for bit in float64 by tests/layers/test_mixer_memory.py).

Used when a gradient is wanted, outside context parallelism (whose sharded ops communicate in
the forward and must not run twice); the plain call is taken otherwise.
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridzoo.parallel.context import active as context_parallel_active

__all__ = ["maybe_recomputed", "recomputed", "wants_recompute"]


def wants_recompute(*tensors: torch.Tensor | None) -> bool:
    """True when a call on ``tensors`` builds a graph worth not keeping: grad mode is on, one of
    them requires grad, and no context-parallel context is active."""
    return (torch.is_grad_enabled() and context_parallel_active() is None
            and any(t is not None and t.requires_grad for t in tensors))


class _Recomputed(torch.autograd.Function):
    """``body(*tensors) -> tuple of tensors``, keeping only ``tensors`` for the backward."""

    @staticmethod
    def forward(ctx, body, *tensors):
        device = next(t.device for t in tensors if t is not None)
        ctx.body, ctx.device_type = body, device.type
        ctx.autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        outputs = body(*tensors)  # autograd Function forwards run without grad
        ctx.save_for_backward(*tensors)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        # an output may not be a view of an input (autograd would refuse its gradient)
        return tuple(o.clone() if o is not None and o._is_view() else o for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[1:]
        leaves = [None if t is None else t.detach().requires_grad_(need)
                  for t, need in zip(ctx.saved_tensors, needs)]
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
            outputs = ctx.body(*leaves)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if g is not None and o is not None and o.requires_grad]
        wanted = [leaf for leaf, need in zip(leaves, needs) if need]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                         allow_unused=True) if pairs and wanted else [None] * len(wanted))
        return (None, *(next(found) if need else None for need in needs))


def recomputed(body: Callable[..., tuple], *tensors: torch.Tensor | None) -> tuple:
    """``body(*tensors)``, differentiable w.r.t. every tensor, keeping for the backward only
    ``tensors`` themselves (none of body's intermediates).

    Args:
        body: a function of tensors (None allowed) returning a tuple of tensors (None allowed);
            it must be deterministic (it runs again in the backward) and use no tensor that
            needs a gradient other than its arguments (pass parameters in as arguments).
        tensors: its arguments.

    Returns:
        ``body``'s outputs.
    """
    return _Recomputed.apply(body, *tensors)


def maybe_recomputed(body: Callable[..., tuple], *tensors: torch.Tensor | None) -> tuple:
    """:func:`recomputed` when :func:`wants_recompute` says so, else the plain ``body(*tensors)``."""
    if wants_recompute(*tensors):
        return recomputed(body, *tensors)
    return body(*tensors)
