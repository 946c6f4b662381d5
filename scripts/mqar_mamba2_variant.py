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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("ssd-kernel", "round-y")


def _ssd_kernel_body(self, zxbcdt, conv, norm, out, dt_bias, A_log, D, conv_tail, recurrent, keep=None):
    """``Mamba2._body`` with mamba_ssm's SSD (scan, softplus of ``dt + dt_bias`` and ``D x``)."""
    import torch
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    if recurrent is not None:
        raise ValueError("ssd-kernel variant: training from an empty state only")
    batch, length, _ = zxbcdt.shape
    H, P, G, N = self.n_heads, self.head_dim, self.n_groups, self.d_state
    z, xBC, dt = zxbcdt.split([self.d_inner, self.conv_dim, H], dim=-1)
    xBC, conv_tail = conv(xBC, conv_tail)
    xs, B, C = xBC.split([self.d_inner, G * N, G * N], dim=-1)
    y, final = mamba_chunk_scan_combined(
        xs.unflatten(-1, (H, P)), dt, -torch.exp(A_log.float()), B.unflatten(-1, (G, N)),
        C.unflatten(-1, (G, N)), chunk_size=self.config.chunk_size, D=D, dt_bias=dt_bias,
        dt_softplus=True, return_final_states=True)
    y = norm(y.reshape(batch, length, self.d_inner), z)
    return out(y), conv_tail, final.transpose(-1, -2)  # mamba_ssm's [B, H, P, N] -> ours


def apply(variant: str) -> None:
    """Patch :class:`hybridzoo.layers.mamba2.Mamba2` for ``variant`` (one of :data:`VARIANTS`)."""
    from hybridzoo.layers import mamba2

    original = mamba2.Mamba2._body
    if variant == "ssd-kernel":
        mamba2.Mamba2._body = _ssd_kernel_body
        mamba2.Mamba2.mix = mamba2.Mamba2._mix_modules  # autograd through mamba_ssm's own Function
    elif variant == "round-y":
        def body(self, zxbcdt, conv, norm, out, *rest, **kw):
            rounded = lambda y, z: norm(y.to(zxbcdt.dtype), z)  # noqa: E731
            return original(self, zxbcdt, conv, rounded, out, *rest, **kw)
        mamba2.Mamba2._body = body
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
            job["path"] = str(Path(job["path"]).with_name(f"{job['id']}.json"))
        return [j for j in jobs if not Path(j["path"]).is_file()], skipped

    mqar.plan = tagged
    return mqar.main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
