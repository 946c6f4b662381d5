"""The environment variables hybridzoo reads, each in a fresh process (they are read at import):

* ``HYBRIDZOO_AUTOTUNE=0``: an autotuned Triton kernel launches with its launcher's fixed settings
  instead of the autotuner's choice (``launch.run``);
* ``HYBRIDZOO_SECO_FLASH=0``: SeCO's chunk attention no longer takes PyTorch's flash backward on
  CUDA in bf16 / fp16 (``chunk_attention_applies``); the CPU path does not depend on it;
* ``HYBRIDZOO_COMPILE_THREADS=N``: an autotuner's candidates are compiled on N threads before
  it times them (``launch.compile_ahead``'s hook in the tuning; unset: the usable CPUs, at most
  8; 0 turns it off); a value that is not a whole number is refused at import.

The CUDA tensor and the autotuner are stand-ins: only the decisions run, nothing is launched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json
from types import SimpleNamespace

import torch
import triton

from hybridzoo.kernels.triton import launch
from hybridzoo.layers import chunk_attention


class StandInAutotuner(triton.runtime.Autotuner):
    def __init__(self):  # no kernel: records which launch path was taken
        self.launched = []
        self.best_config = SimpleNamespace(kwargs={"BLOCK": 128}, num_warps=8, num_stages=3)
        self.fn = _Plain(self.launched)
        self.configs, self.arg_names, self.keys, self.cache = [1, 2], ["x", "N"], ["N"], {}

    def _bench(self, *args, config, **meta):  # a candidate timed while a key is tuned
        return [1.0]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(("autotuner", kwargs))


class _Plain:
    def __init__(self, launched):
        self.launched = launched

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(("fixed", kwargs))


precompiled = []
launch.precompile = lambda kernel, grid, args, consts, threads: precompiled.append(sorted(consts))
tuner = launch.compile_ahead(StandInAutotuner())
settings = launch.run(tuner, (1,), fixed={"BLOCK": 32, "num_warps": 4, "num_stages": 1}, N=7)
tuner._bench(torch.zeros(1), config=1, grid=(1,), warmup=False, N=7)  # as Triton times a candidate

def fake(dtype, device="cuda", d=64):
    return SimpleNamespace(device=torch.device(device), is_cuda=device == "cuda", dtype=dtype, shape=(1, 4, 2, d))

print(json.dumps({
    "autotune": launch.AUTOTUNE,
    "settings": settings,
    "launched": [path for path, _ in tuner.launched],
    "compile_threads": launch.COMPILE_THREADS,
    "precompiled": precompiled,
    "flash_on_cuda": chunk_attention.FLASH_ON_CUDA,
    "cuda_bf16": chunk_attention.chunk_attention_applies(fake(torch.bfloat16), fake(torch.bfloat16), "auto"),
    "cuda_fp16": chunk_attention.chunk_attention_applies(fake(torch.float16), fake(torch.float16), "auto"),
    "cpu_fp32": chunk_attention.chunk_attention_applies(torch.zeros(1, 4, 2, 64), torch.zeros(1, 8, 2, 64), "auto"),
}))
"""


def probe(check: bool = True, **env):
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("HYBRIDZOO_AUTOTUNE", "HYBRIDZOO_SECO_FLASH", "HYBRIDZOO_COMPILE_THREADS")}
    environment.update(env, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT,
                         env=environment, timeout=300)
    if not check:
        return run
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("setting", ["default", "autotune-off", "flash-off", "compile-threads", "compile-threads-off"])
def test_each_variable_is_read_and_changes_only_its_own_path(setting):
    env = {"default": {}, "autotune-off": {"HYBRIDZOO_AUTOTUNE": "0"}, "flash-off": {"HYBRIDZOO_SECO_FLASH": "0"},
           "compile-threads": {"HYBRIDZOO_COMPILE_THREADS": "4"}, "compile-threads-off": {"HYBRIDZOO_COMPILE_THREADS": "0"}}
    result = probe(**env[setting])
    autotune, flash = setting != "autotune-off", setting != "flash-off"
    assert result["autotune"] is autotune and result["flash_on_cuda"] is flash
    usable = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    threads = {"compile-threads": 4, "compile-threads-off": 0}.get(setting, usable)
    assert result["compile_threads"] == threads
    assert result["precompiled"] == ([["N"]] if threads > 1 else [])  # as a key is tuned
    if autotune:  # the autotuner launches and its choice is reported
        assert result["launched"] == ["autotuner"]
        assert result["settings"] == {"BLOCK": 128, "num_warps": 8, "num_stages": 3}
    else:  # the plain kernel with the launcher's fixed settings
        assert result["launched"] == ["fixed"]
        assert result["settings"] == {"BLOCK": 32, "num_warps": 4, "num_stages": 1}
    assert result["cuda_bf16"] is flash and result["cuda_fp16"] is flash
    assert result["cpu_fp32"] is True  # the CPU always takes it


def test_compile_threads_must_be_a_whole_number():
    run = probe(check=False, HYBRIDZOO_COMPILE_THREADS="many")
    assert run.returncode != 0 and "HYBRIDZOO_COMPILE_THREADS must be a whole number" in run.stderr
