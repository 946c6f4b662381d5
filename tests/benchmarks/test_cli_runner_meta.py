"""benchmarks/: the ``python -m benchmarks`` dispatcher, the run metadata and the multi-GPU runner
(on the CPU: commands that need no GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

from benchmarks import __main__ as cli
from benchmarks import meta, runner


def test_help_lists_every_benchmark_module_and_dispatch_runs_one(tmp_path, monkeypatch, capsys):
    names = cli.commands()
    assert {"kernels", "seco", "models", "runner"} <= set(names) and "meta" not in names
    assert all(names.values()), names  # every command has a one-line description
    assert cli.main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name}" in listed for name in names)
    assert cli.main(["no-such-benchmark"]) == 2
    assert "no benchmark named 'no-such-benchmark'" in capsys.readouterr().err
    # a module dropped into the package (as mqar.py / context_parallel.py will be) is a command
    plug = tmp_path / "plugged.py"
    plug.write_text(textwrap.dedent('''
        """Plugged: a benchmark added later."""
        def main(argv):
            print("plugged", argv)
            return 7
    '''))
    monkeypatch.setattr(cli, "HERE", tmp_path)
    assert cli.commands() == {"plugged": "Plugged: a benchmark added later."}
    imported = []
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: imported.append(name) or
                        types.SimpleNamespace(main=lambda argv: 7 if argv == ["--x", "1"] else 0))
    assert cli.main(["plugged", "--x", "1"]) == 7 and imported == ["benchmarks.plugged"]


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], capture_output=True, text=True, check=True)
    assert "kernels" in out.stdout and "seco" in out.stdout


def test_run_metadata_records_versions_and_imported_peers(monkeypatch):
    monkeypatch.setenv("HYBRIDZOO_SPLIT_STATE", "1")
    monkeypatch.delenv("HYBRIDZOO_FUSED", raising=False)
    record = meta.run_metadata(peers=("no_such_package_xyz",))
    assert {"date", "commit", "dirty", "device", "device_count", "versions", "settings"} <= set(record)
    assert record["settings"].get("HYBRIDZOO_SPLIT_STATE") == "1" and "HYBRIDZOO_FUSED" not in record["settings"]
    versions = record["versions"]
    assert {"python", "torch", "triton", "cuda"} <= set(versions)
    assert versions["no_such_package_xyz"] is None  # asked for, not installed: recorded as absent
    import transformers  # noqa: F401  (imported: recorded without being asked for)

    assert meta.run_metadata()["versions"]["transformers"] == transformers.__version__


def test_runner_states_outputs_and_deadline(tmp_path):
    commands = ["echo hi > {out}/x.txt", "sleep 30", "exit 3", "echo {gpu}-last"]
    record = runner.run(commands, tmp_path, gpus=[None], per_gpu=2, deadline_s=3, poll_s=0.1, log=lambda *a: None)
    states = {c["command"]: c["state"] for c in record["cases"]}
    assert states == {"echo hi > {out}/x.txt": "ok", "sleep 30": "timeout", "exit 3": "failed",
                      "echo {gpu}-last": "ok"}
    first = record["cases"][0]
    assert (tmp_path / "cases" / first["name"] / "x.txt").read_text() == "hi\n"
    assert json.loads((tmp_path / "runner.json").read_text())["cases"][2]["returncode"] == 3
    assert "-last" in (tmp_path / "logs" / f"{record['cases'][3]['name']}.log").read_text()
    timed_out = record["cases"][1]
    assert timed_out["seconds"] < 20  # stopped at the deadline, not run to its end


def test_runner_spreads_cases_over_gpus_and_leaves_the_rest_at_the_deadline(tmp_path):
    record = runner.run(["echo $CUDA_VISIBLE_DEVICES"] * 3 + ["sleep 30", "echo late"], tmp_path,
                        gpus=[0, 1], per_gpu=1, deadline_s=2, poll_s=0.1, log=lambda *a: None)
    gpus = [c["gpu"] for c in record["cases"][:3]]
    assert set(gpus) == {0, 1}
    for case in record["cases"][:3]:
        assert (tmp_path / "logs" / f"{case['name']}.log").read_text().splitlines()[-1] == str(case["gpu"])
    assert [c["state"] for c in record["cases"][3:]] in (["timeout", "not started"], ["timeout", "ok"])
