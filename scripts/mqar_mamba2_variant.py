"""MQAR runs of hybridzoo's Mamba-2 with one piece swapped or changed, to find which piece makes
its ``-s`` runs take off less often than mamba_ssm's ``Mamba2`` (a bisection).

    python scripts/mqar_mamba2_variant.py --variant ssd-kernel -- --setting gpu --kinds mamba2 \\
        --sizes s --impls hybridzoo --lrs 0.01 --seeds 0,1,2 --name bisect-ssd

Everything after ``--`` goes to ``python -m benchmarks.mqar``; each run's id and ``variant``
field get ``+<variant>``. Variants (each changes only hybridzoo's ``Mamba2`` mixer):

``ssd-kernel``
    mamba_ssm's ``mamba_chunk_scan_combined`` (its SSD kernels, with ``dt_bias``, the softplus
    and ``D`` inside, output in the activation dtype) in place of hybridzoo's scan and ``D``
    term; hybridzoo's conv, gated norm and projections stay. Needs mamba_ssm and CUDA.
``round-y``
    ``y + D x`` rounded to the activation dtype before the gated norm, as mamba_ssm's fused
    path does (hybridzoo keeps it in float32).
``fwd-theirs``, ``bwd-theirs``, ``bwd-theirs-decay``, ``bwd-theirs-xbc``
    The SSD part (from the conv's output and the raw ``dt`` to ``y + D x``) as one autograd
    Function whose forward is one implementation's and whose backward takes each input's
    gradient from one of the two, both evaluated at the same inputs and output gradient:
    ``fwd-theirs`` is mamba_ssm's forward (its output in the activation dtype) with every
    gradient hybridzoo's; ``bwd-theirs`` is hybridzoo's forward with every gradient mamba_ssm's;
    ``-decay`` takes only ``dt``, ``dt_bias`` and ``A_log``'s gradients from mamba_ssm, ``-xbc``
    only those of ``x``, ``B``, ``C`` and ``D``.
``bwd-mirror``, ``bwd-noise``
    hybridzoo's forward; each input's gradient is hybridzoo's minus mamba_ssm's deviation from it
    (``2 g_ours − g_theirs``: the same error, mirrored), or hybridzoo's plus Gaussian noise of the
    same norm as that deviation (per input tensor; drawn from a hash of the element, the input and
    a step counter, which CUDA graph replays of runs on several streams allow). Whether an error
    helps by its size or by its direction.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("ssd-kernel", "round-y", "fwd-theirs", "bwd-theirs", "bwd-theirs-decay", "bwd-theirs-xbc",
            "bwd-mirror", "bwd-noise")
# per split variant: (forward from mamba_ssm?, the inputs whose gradient comes from mamba_ssm)
_SSD_INPUTS = ("xs", "dt", "dt_bias", "A_log", "D", "B", "C")
# hybridzoo's own Mamba2._ssd, kept when a variant replaces it
_ORIGINAL_SSD: dict = {}
_SPLITS = {"fwd-theirs": (True, ()), "bwd-theirs": (False, _SSD_INPUTS),
           "bwd-theirs-decay": (False, ("dt", "dt_bias", "A_log")),
           "bwd-theirs-xbc": (False, ("xs", "D", "B", "C")),
           "bwd-mirror": (False, ()), "bwd-noise": (False, ())}


def _ssd_ours(self, xs, dt, dt_bias, A_log, D, B, C):
    """hybridzoo's SSD (``Mamba2._ssd``, unpatched): ``y + D x`` [B, T, H, P] float32 (float64 for float64)."""
    from hybridzoo.layers.mamba2 import Mamba2

    return _ORIGINAL_SSD.get("ssd", Mamba2._ssd)(self, xs, B, C, dt, dt_bias, A_log, D, None)[0]


def _ssd_theirs(self, xs, dt, dt_bias, A_log, D, B, C):
    """mamba_ssm's ``mamba_chunk_scan_combined``: ``y + D x`` [B, T, H, P] in xs.dtype."""
    import torch
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return mamba_chunk_scan_combined(xs, dt, -torch.exp(A_log.float()), B, C, chunk_size=self.config.chunk_size,
                                     D=D, dt_bias=dt_bias, dt_softplus=True)


def _signed(c: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _hashed_normal(shape, counter, salt: int, device):
    """Standard normal draws from a hash of each element's index, ``salt`` and the step
    ``counter`` (an int64 tensor): tensor arithmetic only, so a captured CUDA graph replays it
    with the counter's current value, where the generator's draws clash with captures on other
    streams of the process. Two splitmix64-style mixes give two uniforms, Box-Muller a normal."""
    import torch

    n = 1
    for d in shape:
        n *= d
    index = torch.arange(n, device=device, dtype=torch.int64)

    def shr(x, k):  # a logical shift (torch's >> on int64 keeps the sign)
        return (x >> k) & ((1 << (64 - k)) - 1)

    def mix(x):
        x = x + _signed(0x9E3779B97F4A7C15)
        x = (x ^ shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
        x = (x ^ shr(x, 27)) * _signed(0x94D049BB133111EB)
        return x ^ shr(x, 31)

    base = index * 2 + (counter * 7919 + salt) * _signed(0xD1B54A32D192ED03)
    u1, u2 = (shr(mix(base + k), 11) for k in (0, 1))
    u1 = (u1.double() + 1.0) / 2.0 ** 53  # (0, 1]
    u2 = u2.double() / 2.0 ** 53
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * torch.pi * u2)).float().reshape(shape)


def _deviated(ours, theirs, variant, counter=None, salt: int = 0):
    """``2 ours - theirs`` (bwd-mirror) or ``ours`` + noise of norm ``|theirs - ours|`` (bwd-noise;
    its draws from :func:`_hashed_normal` of ``counter`` and ``salt``)."""
    if ours is None:
        return None
    deviation = theirs.float() - ours.float()
    if variant == "bwd-mirror":
        return (ours.float() - deviation).to(ours.dtype)
    noise = _hashed_normal(deviation.shape, counter, salt, deviation.device)
    return (ours.float() + noise * (deviation.norm() / noise.norm().clamp_min(1e-30))).to(ours.dtype)


def _split_function():
    import torch

    class Split(torch.autograd.Function):
        """One implementation's forward, each input's gradient from the implementation chosen."""

        @staticmethod
        def forward(ctx, layer, variant, *inputs):
            theirs_fwd, ctx.theirs_grads = _SPLITS[variant]
            ctx.variant = variant
            ctx.layer, ctx.device_type = layer, inputs[0].device.type
            ctx.autocast = (torch.is_autocast_enabled(ctx.device_type), torch.get_autocast_dtype(ctx.device_type))
            ctx.save_for_backward(*inputs)
            return (_ssd_theirs if theirs_fwd else _ssd_ours)(layer, *inputs)

        @staticmethod
        def backward(ctx, dy):
            inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in ctx.saved_tensors]
            both = ctx.variant in ("bwd-mirror", "bwd-noise")
            needed = {"ours": both or len(ctx.theirs_grads) < len(_SSD_INPUTS), "theirs": both or bool(ctx.theirs_grads)}
            grads = {}
            with torch.enable_grad(), torch.autocast(ctx.device_type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
                for name, fn in (("ours", _ssd_ours), ("theirs", _ssd_theirs)):
                    if needed[name]:  # only the implementations whose gradients are taken
                        y = fn(ctx.layer, *inputs)
                        grads[name] = torch.autograd.grad(y, inputs, dy.to(y.dtype), allow_unused=True)
            picked = tuple(grads["theirs" if n in ctx.theirs_grads else "ours"][i] for i, n in enumerate(_SSD_INPUTS))
            if both:
                layer = ctx.layer
                if not hasattr(layer, "_noise_counter"):  # made in the eager warm-up steps, before a capture
                    layer._noise_counter = torch.zeros((), dtype=torch.int64, device=dy.device)
                layer._noise_counter += 1  # in place: a graph replay counts on
                picked = tuple(_deviated(o, t, ctx.variant, layer._noise_counter, salt=i)
                               for i, (o, t) in enumerate(zip(grads["ours"], grads["theirs"])))
            return (None, None, *picked)

    return Split


def _ssd_patch(ssd):
    """A ``Mamba2._ssd`` that computes ``y + D x`` with ``ssd(layer, xs, dt, dt_bias, A_log, D, B, C)``
    (training from an empty state; the recurrent state it returns is None)."""
    def patched(self, xs, B, C, dt, dt_bias, A_log, D, recurrent, keep=None):
        if recurrent is not None:
            raise ValueError("mqar_mamba2_variant: training from an empty state only")
        return ssd(self, xs, dt, dt_bias, A_log, D, B, C), None
    return patched


def apply(variant: str) -> None:
    """Patch :class:`hybridzoo.layers.mamba2.Mamba2` for ``variant`` (one of :data:`VARIANTS`)."""
    from hybridzoo.layers import mamba2

    _ORIGINAL_SSD.setdefault("ssd", mamba2.Mamba2._ssd)
    original = mamba2.Mamba2._body
    if variant == "ssd-kernel":  # autograd through mamba_ssm's own Function
        mamba2.Mamba2._ssd = _ssd_patch(_ssd_theirs)
        mamba2.Mamba2.mix = mamba2.Mamba2._mix_modules
    elif variant == "round-y":
        def body(self, zxbcdt, conv, norm, out, *rest, **kw):
            rounded = lambda y, z: norm(y.to(zxbcdt.dtype), z)  # noqa: E731
            return original(self, zxbcdt, conv, rounded, out, *rest, **kw)
        mamba2.Mamba2._body = body
    elif variant in _SPLITS:
        split = _split_function()
        mamba2.Mamba2._ssd = _ssd_patch(lambda layer, *inputs: split.apply(layer, variant, *inputs))
        mamba2.Mamba2.mix = mamba2.Mamba2._mix_modules
    else:
        raise SystemExit(f"mqar_mamba2_variant: unknown variant {variant!r}; choose from {VARIANTS}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True, choices=VARIANTS)
    args = parser.parse_args(argv[:split])
    apply(args.variant)

    from benchmarks import mqar

    plan = mqar.plan

    def tagged(*a, **k):
        jobs, skipped = plan(*a, **k)
        for job in jobs:
            job["variant"] = f"{job['variant']}+{args.variant}"
            job["id"] = job["id"].replace(f"-{job['impl']}-", f"+{args.variant}-{job['impl']}-", 1)
            job["path"] = str(mqar.run_file(Path(job["path"]).parent, job["id"]))
        return [j for j in jobs if not Path(j["path"]).is_file()], skipped

    mqar.plan = tagged
    note = f"hybridzoo's runs by scripts/mqar_mamba2_variant.py --variant {args.variant} (the command below is its tail)"
    return mqar.main(argv[split + 1:] + ["--note", note])


if __name__ == "__main__":
    sys.exit(main())
