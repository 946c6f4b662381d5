"""Out-of-bounds checking for Triton kernels under ``TRITON_INTERPRET=1``.

The interpreter reads and writes raw host addresses, so a kernel that touches memory outside its
tensors usually still "works" on the CPU (it reads a neighbour's bytes) while the same kernel
faults on a GPU ("illegal memory access"). :func:`bounds_checked` closes that gap: while it is
active, every launch records the byte ranges of its tensor arguments' storages, and every load
and store checks each unmasked address against them.

    with bounds_checked() as report:
        run_kernels(...)
    assert report.violations == [], report.violations[:3]
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np


@dataclass
class BoundsReport:
    launches: int = 0
    accesses: int = 0
    violations: list[str] = field(default_factory=list)


def _ranges(args) -> list[tuple[int, int]]:
    out = []
    for arg in args:
        if isinstance(arg, tuple):
            out += _ranges(arg)
        elif hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            out.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return out


@contextlib.contextmanager
def bounds_checked(max_violations: int = 20):
    """Check every masked-in address of every interpreted load/store against the launch's tensors."""
    from triton.runtime import interpreter as interp

    report = BoundsReport()
    current: list[tuple[int, int]] = []
    name = [""]

    orig_init = interp.GridExecutor._init_args_hst
    orig_load = interp.InterpreterBuilder.create_masked_load
    orig_store = interp.InterpreterBuilder.create_masked_store

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = orig_init(self, args_dev, kwargs)
        current[:] = _ranges(list(args_hst) + list(kwargs_hst.values()))
        name[0] = getattr(self.fn, "__name__", str(self.fn))
        report.launches += 1
        return args_hst, kwargs_hst

    def check(ptrs, mask, nbytes: int, what: str) -> None:
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        m = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        addr = addr[m]
        report.accesses += addr.size
        if addr.size == 0:
            return
        ok = np.zeros(addr.shape, dtype=bool)
        for lo, hi in current:
            ok |= (addr >= lo) & (addr + nbytes <= hi)
        if not ok.all() and len(report.violations) < max_violations:
            bad = addr[~ok]
            report.violations.append(f"{name[0]}: {what} of {bad.size} address(es) outside every "
                                     f"tensor argument (first {int(bad[0]):#x})")

    def load(self, ptrs, mask, other, *rest):
        check(ptrs, mask, np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize, "load")
        return orig_load(self, ptrs, mask, other, *rest)

    def store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, np.asarray(value.data).itemsize, "store")
        return orig_store(self, ptrs, value, mask, *rest)

    interp.GridExecutor._init_args_hst = init_args_hst
    interp.InterpreterBuilder.create_masked_load = load
    interp.InterpreterBuilder.create_masked_store = store
    try:
        yield report
    finally:
        interp.GridExecutor._init_args_hst = orig_init
        interp.InterpreterBuilder.create_masked_load = orig_load
        interp.InterpreterBuilder.create_masked_store = orig_store
