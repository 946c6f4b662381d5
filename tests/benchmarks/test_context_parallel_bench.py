"""``python -m benchmarks context_parallel --check-grads``: the sharded step's loss and gradients,
summed over 2 gloo ranks on the CPU, against the unsharded step."""

from __future__ import annotations

import pytest
import torch

from benchmarks import context_parallel as bench


def test_check_grads_finds_the_sharded_step_exact_in_float64():
    """float64, 2 ranks: the context-parallel step equals the unsharded one (a rank's gradients
    left unsummed, or another rank's tokens, would be off by order 1)."""
    result = bench.measure(["--device", "cpu", "--ranks", "2", "--recipe", "tiny-hybrid", "--seq-len", "32",
                            "--steps", "1", "--warmup", "0", "--dtype", "float64", "--check-grads"])
    check = result["check"]
    assert check["parameters"] == sum(1 for _ in bench._model(bench._parse(["--recipe", "tiny-hybrid"]),
                                                              torch.device("cpu")).parameters())
    assert check["loss_relative_difference"] < 1e-12
    assert check["max_gradient_relative_difference"] < 1e-10
    assert result["backend"] == "gloo" and result["ranks"] == 2 and result["sharded_s"] > 0


def test_compare_gradients_names_the_worst_parameter():
    ref = {"a": torch.ones(4), "b": torch.ones(4)}
    got = {"a": torch.ones(4), "b": torch.tensor([1.0, 1.0, 1.0, 3.0])}
    check = bench.compare_gradients(2.2, got, 2.0, ref)
    assert check["worst_parameter"] == "b" and check["max_gradient_relative_difference"] == pytest.approx(1.0)
    assert check["loss_relative_difference"] == pytest.approx(0.1)


def test_nccl_without_a_gpu_per_rank_is_refused():
    with pytest.raises(SystemExit, match="needs a GPU per rank"):
        bench._placement(bench._parse(["--device", "cpu", "--ranks", "2", "--backend", "nccl"]))


def test_seco_on_each_rank_is_exact_and_sends_the_predicted_bytes():
    """``--seco-chunk``: each rank runs SeCO over its slice; the step equals unsharded SeCO in
    float64, and the bytes the ranks send (every isend, counted) are those
    ``seco_bytes_per_step`` predicts."""
    result = bench.measure(["--device", "cpu", "--ranks", "2", "--recipe", "tiny-hybrid", "--seq-len", "64",
                            "--steps", "1", "--warmup", "0", "--dtype", "float64", "--check-grads",
                            "--seco-chunk", "16"])
    assert result["seco_chunk"] == 16
    assert result["check"]["max_gradient_relative_difference"] < 1e-10
    assert result["bytes_sent_per_step"] == result["bytes_forward"] + result["bytes_backward"] > 0


def test_the_unsharded_run_can_be_skipped_and_bytes_match_the_plain_prediction():
    result = bench.measure(["--device", "cpu", "--ranks", "2", "--recipe", "tiny-hybrid", "--seq-len", "32",
                            "--steps", "1", "--warmup", "0", "--dtype", "float64", "--skip-unsharded",
                            "--method", "sequential"])
    assert result["single_s"] is None and result["ratio"] is None and result["sharded_s"] > 0
    assert result["bytes_sent_per_step"] == result["bytes_forward"] + result["bytes_backward"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--check-grads", "--skip-unsharded"], "drop --skip-unsharded"),
    (["--seco-chunk", "0"], "--seco-chunk must be at least 1"),
])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench._parse(argv)
    assert message in capsys.readouterr().err


def test_each_rank_gets_an_indexed_device():
    """A GPU per rank: rank r on GPU r; ranks sharing a GPU: all on GPU 0, named with its index
    (``torch.cuda.set_device`` refuses a bare ``cuda``); CPU ranks on the CPU."""
    cuda = bench._parse(["--device", "cuda"])
    assert bench.rank_device(cuda, 1, own_gpus=True) == torch.device("cuda", 1)
    assert bench.rank_device(cuda, 1, own_gpus=False) == torch.device("cuda", 0)
    assert bench.rank_device(bench._parse(["--device", "cpu"]), 1, own_gpus=False) == torch.device("cpu")
