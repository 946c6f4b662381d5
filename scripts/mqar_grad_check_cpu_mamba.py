"""Run ``scripts/mqar_grad_check.py`` on a CPU with mamba_ssm's layers in Triton's interpreter.

mamba_ssm's ``Mamba2`` computes with Triton kernels (the SSD chunk kernels, the gated RMSNorm), which
Triton's CPU interpreter can run, so its bf16 gradient can be set beside hybridzoo's and float64's
without a GPU. This wrapper makes that possible, and changes nothing in either implementation's math:

* the interpreter, with hybridzoo's bf16 fixes for it (``hybridzoo.kernels.triton.launch``: dots
  on widened operands, float32 -> bf16 casts rounding to nearest even, as compiled kernels do);
* each ``triton.autotune`` kernel runs its first candidate (the interpreter cannot time them),
  calling the candidate's ``pre_hook`` (mamba_ssm zeroes its atomic-add buffers there);
* ``torch.cuda.device`` is a no-op and ``get_device_properties`` reports 4 SMs (mamba_ssm asks
  for them around its launches);
* ``Mamba2`` takes its unfused path (``use_mem_eff_path=False``: ``nn.Conv1d``, then
  ``mamba_chunk_scan_combined``, then the gated RMSNorm), since the fused one needs
  causal_conv1d's CUDA build. The scan kernels are the same as in the fused path.

mamba_ssm must be importable from its Python sources (the source archive's ``mamba_ssm``
folder on ``PYTHONPATH``, no CUDA build); its ``import selective_scan_cuda`` needs an empty module
of that name on the path. Arguments are ``mqar_grad_check.py``'s:

    PYTHONPATH=/path/to/mamba-src:/path/to/stub python scripts/mqar_grad_check_cpu_mamba.py \
        --recipe mqar-mamba2-s --setting gpu --impl reference --lr 1e-2 --seed 0 --steps 0 --check 0 --out /tmp/gc
"""
import contextlib
import os
import sys
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class _FirstConfig:
    """A stand-in for ``triton.autotune``'s tuner: launches its first candidate (with its
    ``pre_hook``), and answers ``configs``, ``best_config`` and the kernel's own attributes."""

    def __init__(self, fn, configs):
        self.fn, self.configs, self.best_config = fn, configs, configs[0]
        self.arg_names = fn.arg_names if hasattr(fn, "arg_names") else fn.fn.arg_names

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            config = self.best_config
            if config.pre_hook:
                config.pre_hook({**dict(zip(self.arg_names, args)), **kwargs})
            return self.fn[grid](*args, num_warps=config.num_warps, num_stages=config.num_stages,
                                 **{**config.kwargs, **kwargs})
        return call


def prepare() -> None:
    """Patch torch, Triton and mamba_ssm as the module docstring says (before mamba_ssm loads)."""
    import torch
    import triton

    import hybridzoo.kernels.triton.launch  # noqa: F401  (the interpreter's bf16 as on a GPU)

    torch.cuda.device = lambda index=None: contextlib.nullcontext()
    torch.cuda.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(multi_processor_count=4)
    triton.autotune = lambda configs, key, **kwargs: (lambda fn: _FirstConfig(fn, configs))
    import mamba_ssm
    import mamba_ssm.modules.mamba2 as mamba2

    init = mamba2.Mamba2.__init__

    def unfused_init(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "use_mem_eff_path": False})

    mamba2.Mamba2.__init__ = unfused_init
    mamba_ssm.Mamba2 = mamba2.Mamba2


if __name__ == "__main__":
    import runpy

    prepare()
    sys.argv = [str(ROOT / "scripts" / "mqar_grad_check.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
