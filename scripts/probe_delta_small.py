"""Probe the Triton delta rule at the head sizes of ``mqar-gdn-s`` (K 16, V 32) in bf16 on a GPU.

Session 6 found on an H200: ``test_gpu_small_heads[bf16]`` gives non-finite outputs (with every
buffer NaN-poisoned) and the ``mqar-gdn-s`` bf16 model step faults in ``_bwd_wy_kernel``; fp32
and K = V = 64 pass. This runs, for one launch variant, (1) the forward kernels one by one,
reporting each buffer's non-finite elements, (2) the op's forward + backward against the float64
reference, (3) one bf16-autocast step of the ``mqar-gdn-s`` model. Run each variant in its own
process with ``CUDA_LAUNCH_BLOCKING=1`` (a fault kills the CUDA context)::

    for v in default bk32 stages1 bk32_stages1; do
        CUDA_LAUNCH_BLOCKING=1 python3 scripts/probe_delta_small.py $v; done

Variants patch ``_Config`` after it is built: ``bk32`` key tiles at least 32 wide (``BK`` and the
WY key block), ``stages1`` one pipelining stage, ``fp16`` the op in fp16 (model step skipped).
Prints ``PROBE <variant> <part> OK|FAIL ...`` lines.
"""
import os
import sys
import traceback
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hybridzoo import HybridConfig, HybridLM  # noqa: E402
from hybridzoo.kernels.reference.delta_rule import chunk_delta_rule as reference  # noqa: E402
from hybridzoo.kernels.triton import delta_rule as D  # noqa: E402
from hybridzoo.kernels.triton import launch  # noqa: E402

variant = sys.argv[1] if len(sys.argv) > 1 else "default"
init = D._Config.__init__


def patched(self, q, v, chunk_size):
    init(self, q, v, chunk_size)
    if "bk32" in variant:
        self.BK = max(self.BK, 32)
        self.bkw = max(self.bkw, 32)
    if "stages1" in variant:
        self.stages = 1


D._Config.__init__ = patched
launch.POISON_OUTPUTS = True
dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: TRITON_INTERPRET=1, PROBE_B/PROBE_T small
dtype = torch.float16 if variant == "fp16" else torch.bfloat16


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T, H, K, V = int(os.environ.get("PROBE_B", 64)), int(os.environ.get("PROBE_T", 256)), 2, 16, 32
    x = {"q": torch.randn(B, T, H, K, generator=g),
         "k": torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1),
         "v": torch.randn(B, T, H, V, generator=g),
         "log_a": -0.5 * torch.rand(B, T, H, generator=g),
         "beta": torch.rand(B, T, H, generator=g),
         "initial_state": torch.randn(B, H, K, V, generator=g)}
    cast = {"q": dtype, "k": dtype, "v": dtype, "beta": dtype}
    return {n: t.to(dev, cast.get(n, torch.float32)) for n, t in x.items()}


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def nonfinite(name, t):
    bad = ~torch.isfinite(t)
    if not bad.any():
        return f"{name} ok"
    idx = bad.nonzero()
    return f"{name} {int(bad.sum())}/{t.numel()} non-finite, first at {idx[0].tolist()}, last {idx[-1].tolist()}"


def part(name, fn):
    try:
        print("PROBE", variant, name, "OK", fn(), flush=True)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print("PROBE", variant, name, "FAIL", type(e).__name__, str(e)[:300], flush=True)
        if "illegal" in str(e) or "CUDA" in str(e):
            sys.exit(1)


def forward_buffers():
    x = inputs()
    cfg = D._Config(x["q"], x["v"], 64)
    tm, w, u, h, vn, ht = D._recompute_states(cfg, x["k"], x["v"], x["beta"], x["log_a"], x["initial_state"])
    sync()
    return "; ".join(nonfinite(n, t) for n, t in (("tm", tm), ("w", w), ("u", u), ("h", h), ("vn", vn), ("ht", ht)))


def op_check():
    x = inputs()
    torch.manual_seed(1)
    go = torch.randn_like(x["v"], dtype=torch.float64)
    gs = torch.randn_like(x["initial_state"], dtype=torch.float64)
    out = {}
    for name, fn, cast in (("ours", D.chunk_delta_rule, None), ("ref", reference, torch.float64)):
        leaves = {n: t.detach().to(cast or t.dtype).requires_grad_() for n, t in x.items()}
        o, s = fn(leaves["q"], leaves["k"], leaves["v"], leaves["log_a"], leaves["beta"],
                  initial_state=leaves["initial_state"], output_final_state=True, chunk_size=64)
        ((o.double() * go).sum() + (s.double() * gs).sum()).backward()
        out[name] = {"o": o, "s": s, **{"d" + n: leaves[n].grad for n in x}}
    sync()
    errs = {}
    for n, ref in out["ref"].items():
        ours = out["ours"][n].double()
        errs[n] = float((ours - ref).norm() / ref.norm()) if torch.isfinite(ours).all() else nonfinite(n, ours)
    return errs


def model_step():
    cfg = yaml.safe_load(open(ROOT / "hybridzoo" / "recipes" / "mqar-gdn-s.yaml"))["model"]["config"]
    cfg.update(vocab_size=8192, backend="auto")
    torch.manual_seed(0)
    m = HybridLM(HybridConfig(**cfg)).to(dev)
    ids = torch.randint(0, 8192, (64, 256), device=dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, _, loss = m(ids, labels=ids)
    loss.backward()
    torch.cuda.synchronize()
    bad = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    return f"loss {loss.item():.4f}, non-finite grads: {bad}"


part("forward_buffers", forward_buffers)
part("op", op_check)
if variant != "fp16" and dev == "cuda":
    part("model", model_step)
