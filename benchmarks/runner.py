"""Runner: run a list of shell commands over the visible GPUs, N processes per GPU, with a deadline.

Each command is one case and runs in its own process (a fault or an out-of-memory error kills only
its case) with ``CUDA_VISIBLE_DEVICES`` set to its GPU; ``{out}`` in a command is replaced by the
case's own folder (also in the environment as ``CASE_OUT``) and ``{gpu}`` by its GPU index. Under
``--out-dir`` the runner writes ``logs/<case>.log`` (stdout and stderr of each case),
``cases/<case>/`` (what the case writes to ``{out}``) and ``runner.json`` (run metadata, and per
case: command, GPU, start, seconds, exit status and state), rewritten as cases finish. At the
deadline the cases still running are stopped (their whole process group) and recorded as
``timeout``; cases not yet started are recorded as ``not started``.

    python -m benchmarks runner --out-dir runs/bench --per-gpu 2 --deadline-s 3600 \\
        "python -m benchmarks kernels --only delta --out {out}/kernels.json" \\
        "python -m benchmarks seco --recipes gated-deltanet-340m --out {out}/seco.json"
    python -m benchmarks runner --out-dir runs/bench --commands cases.txt   # one command a line

Without a GPU (or with ``--gpus none``) the cases run on the CPU, ``--per-gpu`` of them at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from benchmarks.meta import run_metadata, write_json


@dataclass
class Case:
    """One command and what became of it. ``state``: pending, running, ok, failed, timeout, not started."""
    name: str
    command: str
    gpu: int | None = None
    state: str = "pending"
    returncode: int | None = None
    start: float | None = None
    seconds: float | None = None
    log: str | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    def record(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "process"}


def case_names(commands: list[str]) -> list[str]:
    """A short file-system-safe name per command: its index and its first words (``03-python-m-benchmarks-seco``)."""
    names = []
    for i, command in enumerate(commands):
        slug = re.sub(r"[^A-Za-z0-9]+", "-", command)[:40].strip("-") or "case"
        names.append(f"{i:02d}-{slug}")
    return names


def visible_gpus(spec: str | None) -> list[int | None]:
    """GPU indices from ``--gpus`` (``"0,1"``, or ``"none"`` for the CPU), else every visible CUDA
    device; ``[None]`` (one CPU lane) when there is none."""
    if spec is not None:
        return [None] if spec.strip().lower() == "none" else [int(g) for g in spec.split(",") if g.strip()]
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return list(range(count)) or [None]


def _start(case: Case, gpu: int | None, out_dir: Path) -> None:
    case_out = out_dir / "cases" / case.name
    case_out.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "logs" / f"{case.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CASE_OUT=str(case_out), PYTHONUNBUFFERED="1")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    command = case.command.replace("{out}", str(case_out)).replace("{gpu}", "" if gpu is None else str(gpu))
    with open(log_path, "w") as log:
        log.write(f"$ {command}\n")
        log.flush()
        case.process = subprocess.Popen(command, shell=True, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)  # its own process group, stopped as one
    case.gpu, case.state, case.start, case.log = gpu, "running", time.time(), str(log_path)


def _stop(case: Case) -> None:
    try:
        os.killpg(case.process.pid, signal.SIGTERM)
        case.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(case.process.pid, signal.SIGKILL)
        case.process.wait()
    except ProcessLookupError:
        pass


def run(commands: list[str], out_dir: str | Path, gpus: list[int | None], per_gpu: int = 1,
        deadline_s: float | None = None, poll_s: float = 0.5, log=print) -> dict:
    """Run ``commands`` as cases, ``per_gpu`` at a time on each of ``gpus``, until all finish or
    ``deadline_s`` passes. Returns (and writes as ``out_dir/runner.json``) the run's record."""
    if per_gpu < 1:
        raise ValueError(f"runner: per_gpu must be at least 1, got {per_gpu}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = [Case(name, command) for name, command in zip(case_names(commands), commands)]
    header = {**run_metadata(), "gpus": gpus, "per_gpu": per_gpu, "deadline_s": deadline_s}
    slots = [gpu for _ in range(per_gpu) for gpu in gpus]  # lanes: every GPU once, then again

    def save() -> dict:
        record = {**header, "cases": [c.record() for c in cases]}
        write_json(out_dir / "runner.json", record)
        return record

    start = time.time()
    pending, running = list(cases), {}
    while pending or running:
        for slot, case in list(running.items()):
            if case.process.poll() is not None:
                case.returncode, case.seconds = case.process.returncode, time.time() - case.start
                case.state = "ok" if case.returncode == 0 else "failed"
                log(f"runner: {case.name} {case.state} (rc {case.returncode}, {case.seconds:.1f} s)")
                del running[slot]
                save()
        if deadline_s is not None and time.time() - start > deadline_s:
            for case in running.values():
                _stop(case)
                case.state, case.seconds = "timeout", time.time() - case.start
                log(f"runner: {case.name} stopped at the deadline ({deadline_s:.0f} s)")
            for case in pending:
                case.state = "not started"
            break
        for slot in range(len(slots)):
            if slot not in running and pending:
                case = pending.pop(0)
                _start(case, slots[slot], out_dir)
                running[slot] = case
                log(f"runner: {case.name} on {'GPU ' + str(slots[slot]) if slots[slot] is not None else 'the CPU'}")
        time.sleep(poll_s)
    return save()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks runner", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("commands", nargs="*", help="shell commands, one case each")
    parser.add_argument("--commands", dest="command_file", default=None,
                        help="a file of commands, one a line (blank lines and # comments skipped)")
    parser.add_argument("--out-dir", required=True, help="logs/, cases/ and runner.json go here")
    parser.add_argument("--gpus", default=None, help="comma-separated GPU indices, or 'none' (default: every visible GPU)")
    parser.add_argument("--per-gpu", type=int, default=1, help="processes at a time on each GPU (default 1)")
    parser.add_argument("--deadline-s", type=float, default=None, help="stop every case still running after this")
    args = parser.parse_args(argv)
    commands = list(args.commands)
    if args.command_file:
        lines = Path(args.command_file).read_text().splitlines()
        commands += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not commands:
        parser.error("no commands: give them as arguments or with --commands FILE")
    record = run(commands, args.out_dir, visible_gpus(args.gpus), args.per_gpu, args.deadline_s)
    states = [case["state"] for case in record["cases"]]
    print(json.dumps({state: states.count(state) for state in dict.fromkeys(states)}))
    return 0 if all(state == "ok" for state in states) else 1


if __name__ == "__main__":
    sys.exit(main())
