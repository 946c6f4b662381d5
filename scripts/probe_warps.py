"""Reproduce the Triton 3.6 illegal memory access of linear-attention kernels launched with 8 warps
on [64, 64] x [64, 32] tiles (seen on an H200; benchmarks/results/2026-11-30-gpu-tests-h200.md).

Run each case in its own process (a fault kills the CUDA context), e.g.:

    for w in auto 8 4; do CUDA_LAUNCH_BLOCKING=1 python3 scripts/probe_warps.py la_64 $w; done
    CUDA_LAUNCH_BLOCKING=1 python3 scripts/probe_warps.py delta_16_32 auto
    CUDA_LAUNCH_BLOCKING=1 python3 scripts/probe_warps.py mqar-gdn-s:auto auto
    CUDA_LAUNCH_BLOCKING=1 python3 scripts/probe_warps.py mqar-mamba2-l:auto 8

Modes: ``la_<K>`` (chunk_linear_attn, scalar decay, B 64, T 256, Hk 1, H 4, K, V 32, bf16),
``delta_<K>_<V>`` (chunk_delta_rule, B 64, T 256, Hk = H = 2, bf16: ``delta_16_32`` has the head
sizes of ``mqar-gdn-s``, whose bf16 model test hit an illegal memory access at 8284662; with
``CUDA_LAUNCH_BLOCKING=1`` the traceback names the faulting launch),
``conv`` (causal_conv1d, B 64, T 256, 256 channels), ``<recipe>:<backend>`` (that recipe's model,
one bf16-autocast step at B 64, T 256). Warps: ``auto`` (hybridzoo's choice, autotuning included)
or a number forced on every launch that asks ``launch.warps`` (autotuning off). Prints ``PROBE <mode> <warps> OK|FAIL ...``.
"""
import sys
import traceback
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
mode, warps = sys.argv[1], sys.argv[2]
from hybridzoo.kernels.triton import launch  # noqa: E402
if warps != "auto":  # force one num_warps on every launch that asks launch.warps
    launch.warps = (lambda *tiles, w=int(warps): w)
    launch.AUTOTUNE = False  # autotuned kernels take their fixed settings, which ask launch.warps
import hybridzoo.kernels as K  # noqa: E402
from hybridzoo import HybridConfig, HybridLM  # noqa: E402
from hybridzoo.kernels.reference.linear_attn import chunk_linear_attn as ref  # noqa: E402
dev = "cuda"
torch.manual_seed(0)
try:
    if mode.startswith("la"):
        Kd = int(mode.split("_")[1])
        q = torch.randn(64, 256, 1, Kd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(64, 256, 1, Kd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(64, 256, 4, 32, device=dev, dtype=torch.bfloat16, requires_grad=True)
        la_ = (-torch.rand(64, 256, 4, device=dev) * 0.1).requires_grad_(True)
        o, s = K.chunk_linear_attn(q, k, v, la_, scale=1.0, output_final_state=True, backend="triton")
        torch.cuda.synchronize(); print("fwd ok", flush=True)
        (o.float().sum() + s.sum()).backward(); torch.cuda.synchronize(); print("bwd ok", flush=True)
        o2, s2 = ref(q.float(), k.float(), v.float(), la_, scale=1.0, output_final_state=True)
        print("rel err o", ((o.float() - o2).norm() / o2.norm()).item())
    elif mode.startswith("delta"):  # delta_<K>_<V>: chunk_delta_rule alone, bf16, B 64, T 256, Hk = H = 2
        Kd, Vd = (int(x) for x in mode.split("_")[1:3])
        q = torch.randn(64, 256, 2, Kd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.nn.functional.normalize(torch.randn(64, 256, 2, Kd, device=dev), dim=-1)
        k = k.to(torch.bfloat16).requires_grad_(True)
        v = torch.randn(64, 256, 2, Vd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        la_ = (-torch.rand(64, 256, 2, device=dev) * 0.1).requires_grad_(True)
        beta = torch.rand(64, 256, 2, device=dev, dtype=torch.bfloat16, requires_grad=True)
        o, s = K.chunk_delta_rule(q, k, v, la_, beta, output_final_state=True, chunk_size=64, backend="triton")
        torch.cuda.synchronize(); print("fwd ok", flush=True)
        (o.float().sum() + s.sum()).backward(); torch.cuda.synchronize(); print("bwd ok", flush=True)
    elif mode == "conv":
        x = torch.randn(64, 256, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(256, 4, device=dev, requires_grad=True); b = torch.randn(256, device=dev, requires_grad=True)
        y, _ = K.causal_conv1d(x, w, b, activation="silu", output_final_state=True, backend="triton")
        y.float().sum().backward(); torch.cuda.synchronize(); print("conv ok")
    else:
        name, backend = mode.split(":")
        cfg = yaml.safe_load(open(ROOT / "hybridzoo" / "recipes" / f"{name}.yaml"))["model"]["config"]
        cfg.update(vocab_size=8192, backend=backend)
        m = HybridLM(HybridConfig(**cfg)).to(dev)
        ids = torch.randint(0, 8192, (64, 256), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, _, loss = m(ids, labels=ids)
        torch.cuda.synchronize(); print("fwd ok", loss.item(), flush=True)
        loss.backward(); torch.cuda.synchronize(); print("bwd ok", flush=True)
    print("PROBE", mode, warps, "OK")
except Exception as e:
    traceback.print_exc()
    print("PROBE", mode, warps, "FAIL", type(e).__name__, str(e)[:200])
