"""``scripts/mqar_mamba2_variant.py``: the Mamba-2 bisection's variants change what they say and
nothing else. mamba_ssm is not needed: its SSD is replaced by a stand-in whose output (and so
every gradient) is twice hybridzoo's, which makes each gradient's source visible."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hybridzoo.layers import mamba2
from hybridzoo.layers.mamba2 import Mamba2, Mamba2Config

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mqar_mamba2_variant.py"


@pytest.fixture
def variant(monkeypatch):
    spec = importlib.util.spec_from_file_location("mqar_mamba2_variant", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "_ssd_theirs", lambda layer, *a: 2 * module._ssd_ours(layer, *a))
    for name in ("_body", "_ssd", "mix"):  # restored after the test
        monkeypatch.setattr(mamba2.Mamba2, name, getattr(mamba2.Mamba2, name))
    return module


def _grads(layer, x):
    layer.zero_grad()
    y, _ = layer(x)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}


def _layer():
    torch.manual_seed(0)
    layer = Mamba2(32, Mamba2Config(d_state=8, head_dim=16, chunk_size=16), backend="reference").double()
    return layer, torch.randn(2, 24, 32, dtype=torch.float64)


def test_split_variants_take_each_gradient_from_the_implementation_named(variant):
    layer, x = _layer()
    y0, g0 = _grads(layer, x)
    after = ("norm.weight", "out_proj.weight", "in_proj.weight")  # not (only) through the SSD part
    expected = {
        "fwd-theirs": (2.0, {}),  # forward twice as large, gradients hybridzoo's
        "bwd-theirs-decay": (1.0, {"dt_bias": 2.0, "A_log": 2.0}),
        "bwd-theirs-xbc": (1.0, {"D": 2.0, "conv1d.weight": 2.0, "conv1d.bias": 2.0}),
        "bwd-theirs": (1.0, {n: 2.0 for n in g0 if n not in after}),
        "bwd-mirror": (1.0, {n: 0.0 for n in g0 if n not in after}),  # 2 g - (2 g)
    }
    for name, (out_scale, grad_scale) in expected.items():
        variant.apply(name)  # each replaces Mamba2._ssd (the layer's own kept aside) and Mamba2.mix
        y, g = _grads(layer, x)
        if out_scale == 1.0:
            torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)
        else:  # the forward's output is only the gated norm's input: it must differ
            assert not torch.allclose(y, y0)
        for n, grad in g.items():
            if n in grad_scale:
                torch.testing.assert_close(grad, grad_scale[n] * g0[n], rtol=1e-10, atol=1e-12, msg=f"{name} {n}")
            elif n != "in_proj.weight" and name != "fwd-theirs":  # in_proj: z's gradient and the SSD's
                torch.testing.assert_close(grad, g0[n], rtol=1e-10, atol=1e-12, msg=f"{name} {n}")


def test_round_y_runs_are_tagged_and_leave_the_unchanged_run_alone(variant, tmp_path):
    args = ["--setting", "cpu-smoke", "--kinds", "mamba2", "--sizes", "s", "--impls", "hybridzoo", "--lrs", "0.01",
            "--seeds", "0", "--device", "cpu", "--out-dir", str(tmp_path), "--name", "v"]
    assert variant.main(["--variant", "round-y", "--", *args]) == 0
    (path,) = (tmp_path / "v-runs").glob("*.json")
    row = json.loads(path.read_text())
    assert row["id"] == "cpu-smoke-mqar-mamba2-s+round-y-hybridzoo-lr0.01-s0" and row["variant"] == "+round-y"
    assert row["status"] == "ok", row.get("error")
    results = json.loads((tmp_path / "v.json").read_text())
    assert any("--variant round-y" in note for note in results["notes"])
    with pytest.raises(SystemExit, match="unknown variant"):
        variant.apply("no-such-variant")


def test_hashed_noise_is_normal_repeatable_and_moves_with_the_step(variant):
    counter = torch.tensor(3)
    a = variant._hashed_normal((100, 100), counter, 0, "cpu")
    assert torch.equal(a, variant._hashed_normal((100, 100), counter, 0, "cpu"))
    assert abs(float(a.mean())) < 0.05 and abs(float(a.std()) - 1.0) < 0.05
    for other in (variant._hashed_normal((100, 100), counter + 1, 0, "cpu"),
                  variant._hashed_normal((100, 100), counter, 1, "cpu")):
        assert abs(float((a * other).mean())) < 0.05  # uncorrelated draws


def test_bwd_noise_adds_noise_the_size_of_the_deviation_new_each_step(variant):
    layer, x = _layer()
    _, g0 = _grads(layer, x)
    variant.apply("bwd-noise")
    _, g1 = _grads(layer, x)
    _, g2 = _grads(layer, x)
    for g in (g1, g2):  # D's gradient is the Function's own: ours + noise of norm |2 ours - ours|
        torch.testing.assert_close((g["D"] - g0["D"]).norm(), g0["D"].norm(), rtol=1e-5, atol=0)
        torch.testing.assert_close(g["norm.weight"], g0["norm.weight"], rtol=1e-10, atol=1e-12)
    assert not torch.allclose(g1["D"], g2["D"]) and not torch.allclose(g1["A_log"], g2["A_log"])
