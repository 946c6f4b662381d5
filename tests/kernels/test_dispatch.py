"""Backend selection: auto picks by device, bad or missing backends give clear errors."""

import subprocess
import sys

import pytest
import torch

import hybridzoo.kernels as K
import hybridzoo.kernels._dispatch as dispatch
from hybridzoo.kernels._dispatch import BACKENDS, TritonUnsupported, resolve
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
    monkeypatch.setattr(dispatch, "_capability", lambda device: (9, 0))
    cuda = torch.device("cuda")
    assert resolve("causal_conv1d", "auto", cuda).__wrapped__ == "triton-impl"
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


def _fake_cuda(monkeypatch, capability=(9, 0), version=(3, 7)):
    """resolve() as on a CUDA machine with a GPU of ``capability`` and Triton ``version``."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dispatch, "_capability", lambda device: capability)
    monkeypatch.setattr(dispatch, "_triton_version", lambda: version)


@pytest.mark.parametrize("op, fallback", [("chunk_delta_rule", "'fla'"), ("chunk_linear_attn", "'fla'"),
                                          ("selective_scan", "'mamba_ssm'"), ("causal_conv1d", "'mamba_ssm'")])
def test_triton_too_old_names_the_op_the_reason_and_the_fallback(op, fallback, monkeypatch):
    _fake_cuda(monkeypatch, version=(3, 4))
    for backend in ("triton", "auto"):
        with pytest.raises(TritonUnsupported) as error:
            resolve(op, backend, torch.device("cuda"))
        message = str(error.value)
        assert op in message and "Triton 3.4 is older than 3.6" in message
        assert "backend='reference'" in message and fallback in message
    assert issubclass(TritonUnsupported, K.BackendUnavailable)


def test_gpu_below_sm80_names_the_op_the_reason_and_the_fallback(monkeypatch):
    _fake_cuda(monkeypatch, capability=(7, 5))
    with pytest.raises(TritonUnsupported, match=r"chunk_delta_rule: the GPU has compute capability 7\.5.*"
                                                r"8\.0 or more.*backend='reference'.*'fla'"):
        resolve("chunk_delta_rule", "triton", torch.device("cuda"))
    # a supported GPU and Triton resolve to the kernel (wrapped by the resource guard)
    _fake_cuda(monkeypatch, capability=(8, 0), version=(3, 9))
    import hybridzoo.kernels.triton as triton_backend

    assert resolve("chunk_delta_rule", "triton", torch.device("cuda")).__wrapped__ is triton_backend.chunk_delta_rule


def test_shape_past_shared_memory_names_the_op_the_need_and_the_fallback(monkeypatch):
    from triton.runtime.errors import OutOfResources

    import hybridzoo.kernels.triton as triton_backend

    _fake_cuda(monkeypatch)

    def too_big(*args, **kwargs):
        raise OutOfResources(294912, 232448, "shared memory")

    monkeypatch.setattr(triton_backend, "chunk_linear_attn", too_big)
    run = resolve("chunk_linear_attn", "triton", torch.device("cuda"))
    with pytest.raises(TritonUnsupported, match=r"chunk_linear_attn: these shapes are past the GPU's shared "
                                                r"memory limit \(needs 294912 .* has 232448\).*backend='reference'"):
        run()
    # other errors pass through unchanged
    monkeypatch.setattr(triton_backend, "chunk_linear_attn", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        resolve("chunk_linear_attn", "triton", torch.device("cuda"))()


def test_interpreter_on_the_cpu_asks_no_gpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "_triton_version", lambda: (3, 9))
    monkeypatch.setattr(dispatch, "_capability", lambda device: 1 / 0)
    assert dispatch.triton_problem("chunk_delta_rule", torch.device("cuda")) is None


def test_resolving_an_op_reads_no_package_metadata_per_call(monkeypatch):
    """Every op call resolves its backend (four per layer in a training step). Reading Triton's
    version from the package metadata parses files on disk (0.6 ms a call on a 2-core CPU): 24 layers
    spent tens of milliseconds of host time per step on it, in steps where the GPU waits on the
    host. The version is read once per process."""
    calls = []
    real = dispatch.metadata.version
    monkeypatch.setattr(dispatch.metadata, "version", lambda name: calls.append(name) or real(name))
    forget = getattr(dispatch._triton_version, "cache_clear", lambda: None)
    forget()
    try:
        for _ in range(10):
            try:
                resolve("chunk_linear_attn", "triton", torch.device("cpu"))
            except K.BackendUnavailable:  # no Triton here: the question is the same
                pass
        assert len(calls) <= 1, calls
    finally:
        forget()


def test_host_ops_script_counts_one_layers_ops_and_launches():
    """``scripts/host_ops.py`` (the host-side work of a training step, per layer): a Gated DeltaNet
    layer adds aten ops and Triton launches (the delta rule's and the fused passes'), counted
    through the GPU's code path on the CPU with the kernels skipped."""
    import re
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "host_ops.py"
    result = subprocess.run([sys.executable, str(script), "mqar-gdn-s", "--tokens", "32", "--top", "3"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r"step at 1 layer (\d+) aten ops, (\d+) Triton launches; each added layer (\d+) aten ops, "
                      r"(\d+) Triton launches", result.stdout)
    assert found, result.stdout
    step_ops, step_launches, layer_ops, layer_launches = map(int, found.groups())
    assert 0 < layer_ops < step_ops and 0 < layer_launches < step_launches


def test_host_ops_step_starts_from_no_gradients():
    """A counted step is a training step's: it starts with every ``.grad`` set to None (as
    ``zero_grad`` does), so a second step leaves the gradients of one step, not their sum, and
    dispatches no accumulating adds."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "host_ops.py"
    spec = importlib.util.spec_from_file_location("host_ops_under_test", path)
    host_ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_ops)
    torch.manual_seed(0)
    step, vocab_size = host_ops._model("mqar-gdn-s", 1, "ours")
    ids = torch.randint(0, vocab_size, (1, 16))
    step(ids)
    model = step.model
    once = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert once
    step(ids)
    for name, p in model.named_parameters():
        if name in once:
            torch.testing.assert_close(p.grad, once[name], rtol=0, atol=0, msg=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without a GPU")
def test_host_cost_script_refuses_without_a_gpu():
    """``scripts/host_cost_gpu.py`` times launches on a CUDA GPU; without one it says so and
    names the CPU count instead, with exit status 2 (not a traceback, not an empty table)."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "host_cost_gpu.py"
    result = subprocess.run([sys.executable, str(script), "--calls", "2"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    assert "needs a CUDA GPU" in result.stderr and "host_ops.py" in result.stderr
    bad = subprocess.run([sys.executable, str(script), "--calls", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--calls and --rounds must be at least 1" in bad.stderr


def test_host_ops_script_counts_a_peer_beside_hybridzoo():
    """``scripts/host_ops.py --peer``: fla's RetNet model of the model table's pair, counted the
    same way beside hybridzoo's (its Triton launches skipped, its autotuning answered untimed)."""
    import re
    from pathlib import Path

    pytest.importorskip("fla")
    script = Path(__file__).resolve().parents[2] / "scripts" / "host_ops.py"
    result = subprocess.run([sys.executable, str(script), "retnet-340m", "--peer", "--tiny", "--tokens", "32"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for side in ("hybridzoo", "peer"):
        found = re.search(rf"retnet-340m {side}: step at 1 layer \d+ aten ops, \d+ Triton launches; each added "
                          rf"layer (\d+) aten ops, (\d+) Triton launches", result.stdout)
        assert found, result.stdout
        assert all(int(n) > 0 for n in found.groups()), (side, found.groups())
