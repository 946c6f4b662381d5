"""``python -m benchmarks data_parallel``: DDP over 2 CPU processes (gloo) takes the same steps as
one process at the same global batch, and the options are checked before anything runs."""

from __future__ import annotations

import json

import pytest

from benchmarks import data_parallel as bench

SMOKE = ["--accelerator", "cpu", "--recipe", "tiny-hybrid", "--devices", "2", "--seq-len", "32",
         "--global-batch", "4", "--steps", "2", "--warmup", "1", "--max-files", "4"]


def test_ddp_on_two_cpu_processes_takes_the_one_process_steps(tmp_path):
    """Each rank trains on its half of the one-process batch, and the all-reduced gradients give
    the same step: the losses agree to float32 rounding (a rank given other rows, or the whole
    global batch each, would be off by far more), and both runs are timed."""
    out = tmp_path / "dp.json"
    assert bench.main(SMOKE + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["losses_one_device"]) == len(result["losses_2_devices"]) == 2
    assert result["max_relative_loss_difference"] < 1e-5
    assert result["losses_one_device"][0] != result["losses_one_device"][1]  # the model trained
    assert result["tokens_per_s_one_device"] > 0 and result["tokens_per_s_2_devices"] > 0
    assert result["scaling"] == pytest.approx(result["tokens_per_s_2_devices"] / result["tokens_per_s_one_device"])
    assert result["settings"]["strategy"] == "ddp" and result["commit"]


@pytest.mark.parametrize("argv, message", [
    (["--devices", "1"], "--devices must be at least 2"),
    (["--global-batch", "5"], "must be a multiple of --devices"),
    (["--accelerator", "cpu", "--strategy", "fsdp"], "--strategy fsdp needs --accelerator gpu"),
    (["--steps", "3", "--warmup", "3"], "--warmup must be in"),
])
def test_bad_options_are_refused_before_any_run(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err
