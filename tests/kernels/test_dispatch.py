"""Backend selection: auto picks by device, bad or missing backends give clear errors."""

import subprocess
import sys

import pytest
import torch

import hybridzoo.kernels as K
from hybridzoo.kernels._dispatch import BACKENDS, resolve
from hybridzoo.kernels import reference


def test_auto_and_reference_on_cpu_resolve_to_the_reference():
    for op in reference.OPS:
        assert resolve(op, "auto", torch.device("cpu")) is getattr(reference, op)
        assert resolve(op, "reference", torch.device("cpu")) is getattr(reference, op)


def test_unknown_backend_names_itself_and_the_choices():
    q = torch.randn(1, 4, 1, 2)
    with pytest.raises(K.BackendUnavailable, match=r"unknown backend 'cuda_magic'.*'reference'"):
        K.chunk_linear_attn(q, q, q, backend="cuda_magic")


def test_backend_without_the_op_says_so(monkeypatch):
    import hybridzoo.kernels.triton as triton_backend

    monkeypatch.setattr(triton_backend, "OPS", ())
    x = torch.randn(1, 4, 3)
    with pytest.raises(K.BackendUnavailable, match="'triton' does not implement causal_conv1d"):
        K.causal_conv1d(x, torch.randn(3, 2), backend="triton")


def test_auto_on_cuda_prefers_triton_only_for_its_ops(monkeypatch):
    import hybridzoo.kernels.triton as triton_backend

    monkeypatch.setattr(triton_backend, "OPS", ("causal_conv1d",))
    monkeypatch.setattr(triton_backend, "causal_conv1d", "triton-impl", raising=False)
    cuda = torch.device("cuda")
    assert resolve("causal_conv1d", "auto", cuda) == "triton-impl"
    assert resolve("chunk_delta_rule", "auto", cuda) is reference.chunk_delta_rule
    from hybridzoo.kernels.backends import torch_sdpa

    assert resolve("attention", "auto", cuda) is torch_sdpa.attention


def test_missing_optional_package_names_the_package_and_the_fix(tmp_path, monkeypatch):
    (tmp_path / "fake_backend_xyz.py").write_text("import not_a_real_package_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BACKENDS, "fake", ("fake_backend_xyz", "not-a-real-package (pip install it)"))
    q = torch.randn(1, 4, 1, 2)
    with pytest.raises(K.BackendUnavailable,
                       match=r"'fake'.*needs the package 'not_a_real_package_xyz'.*pip install it"):
        K.chunk_linear_attn(q, q, q, backend="fake")


def test_planned_backend_says_it_is_not_there_yet(monkeypatch):
    monkeypatch.setitem(BACKENDS, "later", ("hybridzoo.kernels.backends.not_written_yet", None))
    q = torch.randn(1, 4, 1, 2)
    with pytest.raises(K.BackendUnavailable, match=r"'later' is planned but not part"):
        K.chunk_linear_attn(q, q, q, backend="later")


def test_mamba_ssm_backend_without_the_package_names_it():
    # mamba_ssm is a CUDA build, never installed in CI
    try:
        import mamba_ssm  # noqa: F401
        pytest.skip("mamba_ssm is installed here")
    except ImportError:
        pass
    u = torch.randn(1, 4, 3)
    with pytest.raises(K.BackendUnavailable, match=r"needs the package 'mamba-ssm'.*hybridzoo\[mamba\]"):
        K.selective_scan(u, u, -torch.ones(3, 2), torch.randn(1, 4, 2), torch.randn(1, 4, 2), backend="mamba_ssm")


def test_fla_backend_refuses_cpu_tensors_clearly():
    pytest.importorskip("fla", reason="flash-linear-attention not installed")
    q = torch.randn(1, 4, 1, 2)
    with pytest.raises(RuntimeError, match="CUDA only"):
        K.chunk_linear_attn(q, q, q, backend="fla")


def test_import_does_not_import_optional_packages():
    code = ("import sys, hybridzoo, hybridzoo.kernels, hybridzoo.layers; "
            "bad = [m for m in ('fla', 'mamba_ssm', 'transformers', 'lightning', 'causal_conv1d') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
