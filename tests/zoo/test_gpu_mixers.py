"""Every MQAR recipe's model on CUDA with the default kernels (``backend="auto"``: our Triton
kernels, SDPA / flex attention) against the same weights on the reference kernels.

The kernel tests check each op at real shapes with equal head sizes; these check the shapes the
mixers really hand them (Mamba-2: one B/C group for all heads, ``d_state`` != ``head_dim``, down
to ``d_state = 8``; GLA: per-key decays after a short conv; ...), in float32 and under bf16
autocast as ``hybridzoo fit`` trains, forward and backward. They exist because a Mamba-2 MQAR run
hit an illegal memory access on an H200 that no kernel test had shown.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from hybridzoo import HybridConfig, HybridLM

RECIPES = Path(__file__).resolve().parents[2] / "hybridzoo" / "recipes"
NAMES = sorted(p.stem for p in RECIPES.glob("mqar-*.yaml"))


def _models(name: str) -> tuple[HybridLM, HybridLM]:
    config = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())["model"]["config"]
    config["vocab_size"] = 512
    torch.manual_seed(0)
    reference = HybridLM(HybridConfig(**{**config, "backend": "reference"})).cuda()
    fast = HybridLM(HybridConfig(**{**config, "backend": "auto"})).cuda()
    fast.load_state_dict(reference.state_dict())
    return reference, fast


def _loss_and_grads(model: HybridLM, ids: torch.Tensor, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        _, _, loss = model(ids, labels=ids)
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_recipe_model_matches_reference_on_gpu(name: str, autocast: bool):
    reference, fast = _models(name)
    ids = torch.randint(0, 512, (64, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ref_loss, ref_grads = _loss_and_grads(reference, ids, autocast=False)
    loss, grads = _loss_and_grads(fast, ids, autocast)
    tol = 3e-2 if autocast else 1e-3
    assert torch.isfinite(loss), name
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item()), (name, loss.item(), ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    worst = max(((_rel(grads[n], ref_grads[n]), n) for n in ref_grads), key=lambda x: x[0])
    assert worst[0] <= (5e-2 if autocast else 1e-3), (name, worst)
