"""Run the inside of a mixer without keeping its activations: the backward recomputes them.

A Mamba mixer's training step used to keep, per token and layer, every intermediate of its
conv, gates, scan and norm (float32 copies of bf16 tensors among them: 73 kB per token for
Mamba-2 at d_model 1024, 5x mamba_ssm). :func:`recomputed` keeps only the tensors it is given
(the in-projection's output, the parameters and the carried states) and, in the backward, runs
the same function again under the forward's autocast state with autograd on, then backpropagates
through that fresh graph. The gradients are those of the plain call: the same operations run on
the same inputs (checked in float64 by tests/layers/test_mixer_memory.py).

A body may also skip an expensive op in that second run (:class:`Kept`): the forward keeps the op's
outputs (or, for an op whose output only feeds the body's result, just their shapes) and the
recomputation hands them back, with a backward that the caller supplies; this is how Mamba-2 keeps
its scan output, as mamba_ssm does, instead of running the scan's forward twice.

Used when a gradient is wanted, outside context parallelism (whose sharded ops communicate in
the forward and must not run twice); the plain call is taken otherwise.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from hybridzoo.parallel.context import active as context_parallel_active

__all__ = ["Kept", "kept_op", "linear_grads", "maybe_recomputed", "plain_modules", "recomputed", "wants_recompute"]


def plain_modules(*modules: torch.nn.Module) -> bool:
    """True when a mixer may use these submodules' weights directly (in a recomputed or fused body):
    each is a torch.nn or hybridzoo module of the exact class the mixer built, and no forward hook
    (on it or global) would be skipped. A replaced submodule (an adapter such as peft's LoRA around
    a projection) or a hooked one makes the mixer call its submodules as modules instead."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    return all(type(m).__module__.startswith(("torch.nn.", "hybridzoo."))
               and not m._forward_hooks and not m._forward_pre_hooks for m in modules)


def wants_recompute(*tensors: torch.Tensor | None) -> bool:
    """True when a call on ``tensors`` builds a graph worth not keeping: grad mode is on, one of
    them requires grad, and no context-parallel context is active."""
    return (torch.is_grad_enabled() and context_parallel_active() is None
            and any(t is not None and t.requires_grad for t in tensors))


class _GivenOutputs(torch.autograd.Function):
    """Outputs computed earlier, attached to ``inputs`` with the backward ``grads_fn(*inputs,
    *output_grads) -> input grads`` (``grads_fn(*inputs, *outputs, *output_grads)`` when
    ``with_outputs``)."""

    @staticmethod
    def forward(ctx, grads_fn, outputs, with_outputs, *inputs):
        ctx.grads_fn = grads_fn
        ctx.outputs = tuple(outputs) if with_outputs else ()
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, *ctx.grads_fn(*ctx.saved_tensors, *ctx.outputs, *grads))


class Kept:
    """What a recomputed body keeps from its forward for the backward's second run.

    A body that takes ``keep`` calls :meth:`op` for an expensive op. In the forward (and in a
    plain call, ``keep=None`` there) the op runs; in the recomputation it does not: the kept
    outputs come back attached to the op's inputs, and ``grads(*inputs, *output_grads)`` is
    their backward.
    """

    def __init__(self, kept: Sequence | None = None, counts: Sequence[int] | None = None):
        self.replaying = kept is not None
        self.tensors: list = list(kept or [])
        self.counts: list[int] = list(counts or [])
        self._next = self._op = 0

    def op(self, run: Callable[..., tuple], grads: Callable[..., tuple], inputs: tuple,
           keep_values: bool | Sequence[bool] = True, grads_take_outputs: bool = False) -> tuple:
        """``run(*inputs)`` (a tuple of tensors) in the forward; in the recomputation its kept
        outputs, where ``keep_values`` is False (for all outputs, or one flag per output: those
        only returned by the body, never read in it) zeros of their shapes, one element each.
        With ``grads_take_outputs`` the backward is called as ``grads(*inputs, *outputs,
        *output_grads)``: for an op whose backward needs what its forward saved (an output the
        body itself ignores)."""
        if not self.replaying:
            outputs = run(*inputs)
            flags = [keep_values] * len(outputs) if isinstance(keep_values, bool) else keep_values
            self.tensors.extend(o if flag else o.new_zeros(()).expand(o.shape)
                                for o, flag in zip(outputs, flags, strict=True))
            self.counts.append(len(outputs))
            return outputs
        count = self.counts[self._op]
        outputs = self.tensors[self._next:self._next + count]
        self._next, self._op = self._next + count, self._op + 1
        return _GivenOutputs.apply(grads, tuple(outputs), grads_take_outputs, *inputs)


def kept_op(keep: Kept | None, run: Callable[..., tuple], grads: Callable[..., tuple], inputs: tuple,
            keep_values: bool | Sequence[bool] = True, grads_take_outputs: bool = False) -> tuple:
    """``run(*inputs)`` when ``keep`` is None (a plain call), else :meth:`Kept.op`."""
    return run(*inputs) if keep is None else keep.op(run, grads, inputs, keep_values, grads_take_outputs)


def linear_grads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 dout: torch.Tensor | None) -> tuple:
    """The backward of ``F.linear(x, weight, bias)`` (``x [..., in]``, ``weight [out, in]``) from
    ``dout [..., out]`` (None: zero): ``(dx, dweight, dbias)`` in the inputs' dtype."""
    if dout is None:
        return None, None, None
    rows = dout.reshape(-1, dout.shape[-1])
    dweight = rows.mT @ x.reshape(-1, x.shape[-1])
    return dout @ weight, dweight, None if bias is None else rows.sum(0)


def _call(body, tensors, keep):
    return body(*tensors) if keep is None else body(*tensors, keep=keep)


class _Recomputed(torch.autograd.Function):
    """``body(*tensors) -> tuple of tensors``, keeping only ``tensors`` (and ``keep``'s) for the backward."""

    @staticmethod
    def forward(ctx, body, uses_keep, *tensors):
        device = next(t.device for t in tensors if t is not None)
        ctx.body, ctx.uses_keep, ctx.device_type = body, uses_keep, device.type
        ctx.autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        keep = Kept() if uses_keep else None
        outputs = _call(body, tensors, keep)  # autograd Function forwards run without grad
        ctx.n_inputs, ctx.keep_counts = len(tensors), keep.counts if keep else None
        ctx.save_for_backward(*tensors, *(keep.tensors if keep else ()))
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        # an output may not be a view of an input (autograd would refuse its gradient)
        return tuple(o.clone() if o is not None and o._is_view() else o for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[2:]
        saved = ctx.saved_tensors
        leaves = [None if t is None else t.detach().requires_grad_(need)
                  for t, need in zip(saved[:ctx.n_inputs], needs)]
        keep = Kept(saved[ctx.n_inputs:], ctx.keep_counts) if ctx.uses_keep else None
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
            outputs = _call(ctx.body, leaves, keep)
        # the backward of that graph runs outside autocast, as the plain call's would
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if g is not None and o is not None and o.requires_grad]
        wanted = [leaf for leaf, need in zip(leaves, needs) if need]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                         allow_unused=True) if pairs and wanted else [None] * len(wanted))
        return (None, None, *(next(found) if need else None for need in needs))


def recomputed(body: Callable[..., tuple], *tensors: torch.Tensor | None, keeps: bool = False) -> tuple:
    """``body(*tensors)``, differentiable w.r.t. every tensor, keeping for the backward only
    ``tensors`` themselves (none of body's intermediates).

    Args:
        body: a function of tensors (None allowed) returning a tuple of tensors (None allowed);
            it must be deterministic (it runs again in the backward) and use no tensor that
            needs a gradient other than its arguments (pass parameters in as arguments).
        tensors: its arguments.
        keeps: body takes a keyword ``keep`` (a :class:`Kept`, None in a plain call).

    Returns:
        ``body``'s outputs.
    """
    return _Recomputed.apply(body, keeps, *tensors)


def maybe_recomputed(body: Callable[..., tuple], *tensors: torch.Tensor | None, keeps: bool = False) -> tuple:
    """:func:`recomputed` when :func:`wants_recompute` says so, else the plain ``body(*tensors)``
    (with ``keep=None`` when ``keeps``)."""
    if wants_recompute(*tensors):
        return recomputed(body, *tensors, keeps=keeps)
    return body(*tensors)
