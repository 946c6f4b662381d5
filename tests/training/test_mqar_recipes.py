"""The ``mqar-<kind>-<s|l>`` recipes and ``benchmarks/mqar.py``: every recipe loads and builds,
its state size from the config equals the state the model really keeps, the two sizes of each kind
are ordered; one recipe trains 3 steps through ``hybridzoo fit`` and ``hybridzoo eval`` reports
its MQAR accuracy; the benchmark runs its CPU smoke setting (hybridzoo rows and the Llama
reference; the rows that need CUDA are skipped with a reason) and its table and plot work on fake
results."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import mqar as bench
from hybridzoo import HybridConfig, HybridLM
from hybridzoo.cli import main as cli_main
from hybridzoo.layers.attention import KVState
from hybridzoo.training.mqar import multiquery_ar
from hybridzoo.zoo.recipes import load_recipe, load_recipe_config

KINDS = ("mamba1", "mamba2", "gla", "retnet", "gdn", "attn")
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None



def measured_state_size(config: HybridConfig, seq_len: int) -> int:
    """Floats of state per sequence in the first layer, read off the state the model returns.

    Recurrent mixers: the recurrent tensor (the conv tail is not counted). Attention: the keys
    and values the query at position ``seq_len - 1`` reads = the K/V store after ``seq_len - 1``
    tokens plus that query's own key and value.
    """
    torch.manual_seed(0)
    model = HybridLM(HybridConfig.from_dict(config.to_dict(), vocab_size=32))
    with torch.no_grad():
        _, states = model(torch.randint(32, (1, seq_len - 1)))
    state = states[0]
    if isinstance(state, KVState):
        _, length, kv_heads, head_dim = state.k.shape
        return 2 * (length + 1) * kv_heads * head_dim
    return state.recurrent[0].numel()


def test_two_recipes_per_mixer_kind():
    assert bench.mqar_recipes() == [f"mqar-{kind}-{size}" for kind in KINDS for size in "sl"]


@pytest.mark.parametrize("kind", KINDS)
def test_recipes_load_build_and_have_ordered_state_sizes(kind):
    sizes = {}
    for size in "sl":
        name = f"mqar-{kind}-{size}"
        recipe = load_recipe(name)
        assert recipe["data"]["class_path"].endswith("MQARDataModule")
        data = recipe["data"]["init_args"]
        config = load_recipe_config(name)
        assert (config.pattern, config.n_layers, config.d_model) == ([kind], 2, 64)
        assert config.vocab_size == data["vocab_size"] == 8192  # Zoology's vocabulary
        with torch.device("meta"):
            model = HybridLM(config)
        assert [block.kind for block in model.blocks] == [kind, kind]
        # the formula against the state the model really keeps, at two sequence lengths
        for seq_len in (12, 24):
            assert bench.state_size(config, seq_len) == measured_state_size(config, seq_len), (name, seq_len)
        sizes[size] = [bench.state_size(config, t) for t in (64, data["seq_len"], 512)]
        assert all(isinstance(s, int) and s > 0 for s in sizes[size])
    assert all(small < large for small, large in zip(sizes["s"], sizes["l"])), sizes


def test_state_size_formulas_on_hand_made_configs():
    config = HybridConfig(d_model=32, n_layers=1, layers="mamba2", mamba2={"d_state": 4, "head_dim": 16})
    assert bench.state_size(config, 100) == (64 // 16) * 4 * 16
    config = HybridConfig(d_model=32, n_layers=1, layers="attn", attn={"n_heads": 4, "n_kv_heads": 2, "window": 5})
    assert bench.state_size(config, 3) == 2 * 3 * 2 * 8 and bench.state_size(config, 100) == 2 * 5 * 2 * 8
    mixed = HybridConfig(d_model=32, n_layers=2, layers="gdn attn")
    with pytest.raises(ValueError, match="kind="):
        bench.state_size(mixed, 10)
    gdn = mixed.gdn
    assert bench.state_size(mixed, 10, kind="gdn") == gdn.num_v_heads * gdn.head_k_dim * gdn.head_v_dim


def test_a_recipe_trains_three_steps_and_eval_reports_its_accuracy(tmp_path, capsys):
    export = tmp_path / "export"  # the ExportCallback's default place: <default_root_dir>/export
    args = ["fit", "--config", "mqar-gdn-s", "--data.init_args.vocab_size", "32", "--data.init_args.seq_len", "16",
            "--data.init_args.num_pairs", "2", "--data.init_args.batch_size", "4", "--data.init_args.num_train", "12",
            "--data.init_args.num_val", "8", "--model.warmup_steps", "1", "--model.learning_rate", "1e-2",
            "--model.config.gdn.chunk_size", "8", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.accelerator", "cpu",
            "--trainer.devices", "1",
            "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_checkpointing", "false", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    assert cli_main(args) == 0
    assert HybridLM.from_pretrained(export).config.gdn.chunk_size == 8
    capsys.readouterr()
    # hybridzoo eval --json on the export reports the MQAR accuracy ...
    assert cli_main(["eval", str(export), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # ... which is the argmax recall over the held-out examples (MQARDataModule: seed 2 * 0 + 1)
    model = HybridLM.from_pretrained(export)
    input_ids, labels = multiquery_ar(8, 16, 32, 2, seed=1)
    with torch.no_grad():
        logits, _ = model(input_ids)
    answers = labels[:, 1:] != -100
    correct = (logits[:, :-1].argmax(-1) == labels[:, 1:]) & answers
    assert result["tokens"] == 16
    assert result["mqar_accuracy"] == pytest.approx(int(correct.sum()) / int(answers.sum()), abs=0)


def test_benchmark_cpu_smoke(tmp_path, capsys):
    """hybridzoo's gdn-s and attn-s beside the Llama reference, 12 steps each; fla's GDN needs CUDA
    and is skipped with the reason; a second call finds every run done and only re-renders."""
    argv = ["--setting", "cpu-smoke", "--kinds", "gdn,attn", "--sizes", "s", "--seeds", "0", "--lrs", "3e-3",
            "--device", "cpu", "--out-dir", str(tmp_path), "--name", "smoke"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "skipped: mqar-gdn-s reference: fla GatedDeltaNet needs CUDA" in out
    results = json.loads((tmp_path / "smoke.json").read_text())
    runs = {(r["recipe"], r["impl"]): r for r in results["runs"]}
    assert set(runs) == {("mqar-gdn-s", "hybridzoo"), ("mqar-attn-s", "hybridzoo"), ("mqar-attn-s", "reference")}
    for row in runs.values():
        assert row["status"] == "ok", row.get("error")
        assert [p["step"] for p in row["curve"]] == [6, 12] and 0 <= row["accuracy"] <= 1
    assert runs[("mqar-attn-s", "hybridzoo")]["parameters"] == runs[("mqar-attn-s", "reference")]["parameters"]
    table = (tmp_path / "smoke.md").read_text()
    assert "| mqar-attn-s | 1,024 |" in table and "transformers LlamaAttention" in table
    assert bench.main(argv) == 0 and "0 runs to do" in capsys.readouterr().out


@pytest.mark.parametrize("recipe", ["mqar-attn-s", "mqar-attn-l"])
def test_benchmark_llama_reference_starts_equal_and_computes_the_same(recipe):
    """The reference model of a seed holds transformers' LlamaAttention with hybridzoo's initial
    weights (the RNG is drawn at the same place, in the same way), and gives the same logits:
    sliding window (-s) and full attention (-l)."""
    spec = bench.SETTINGS["cpu-smoke"]
    ours, _ = bench.build_model(recipe, "hybridzoo", spec, seed=1)
    ref, _ = bench.build_model(recipe, "reference", spec, seed=1)
    theirs = {name.replace("mixer.layer.", "mixer."): value for name, value in ref.state_dict().items()}
    assert theirs.keys() == ours.state_dict().keys()
    for name, value in ours.state_dict().items():
        assert torch.equal(value, theirs[name]), name
    ids, _ = multiquery_ar(2, spec["seq_len"], spec["vocab_size"], spec["num_pairs"], seed=0)
    with torch.no_grad():
        expected, got = ours(ids)[0], ref(ids)[0]
    assert (got - expected).abs().max() < 1e-5 * expected.abs().max()


@pytest.mark.parametrize("recipe", ["mqar-gla-s", "mqar-gla-l", "mqar-retnet-s", "mqar-retnet-l"])
def test_benchmark_fla_reference_starts_from_hybridzoo_weights(recipe):
    """fla's GLA and RetNet layers get fla's model init in the reference model (normal(0,
    initializer_range) for linear and conv weights, zero biases), drawn where hybridzoo's layer
    draws its own: under one seed both models hold the same weights (short convs as [C, 1, W]
    beside hybridzoo's [C, W])."""
    pytest.importorskip("fla.layers")
    spec = bench.SETTINGS["cpu-smoke"]
    for seed in (0, 1):
        ours = bench.build_model(recipe, "hybridzoo", spec, seed=seed)[0].state_dict()
        ref = bench.build_model(recipe, "reference", spec, seed=seed)[0].state_dict()
        theirs = {name.replace("mixer.layer.", "mixer."): value for name, value in ref.items()}
        assert theirs.keys() == ours.keys()
        for name, value in ours.items():
            assert torch.equal(value, theirs[name].reshape(value.shape)), (seed, name)


def fake_results() -> dict:
    rows = []
    for i, kind in enumerate(KINDS):
        for size, state in (("s", 1024), ("l", 8192)):
            for impl in bench.IMPLS:
                for lr in (1e-3, 3e-3):
                    for seed in range(3):
                        rows.append({"setting": "gpu", "recipe": f"mqar-{kind}-{size}", "kind": kind, "size": size,
                                     "impl": impl, "lr": lr, "seed": seed, "state_size": state, "parameters": 1000,
                                     "steps": 100 * (seed + 1), "status": "ok",
                                     "accuracy": min(1.0, 0.1 * i + seed * 0.01 + (0.2 if lr == 3e-3 else 0.0))})
    settings = {"gpu": {**bench.SETTINGS["gpu"], "lrs": [1e-3, 3e-3], "seeds": [0, 1, 2]}}
    return {"date": "2026-12-01", "settings": settings, "runs": rows, "summary": bench.summarize(rows),
            "notes": ["a note"], "meta": {"commit": "abc", "torch": "x"}}


def test_summary_takes_the_best_learning_rate_median():
    summary = fake_results()["summary"]
    assert len(summary) == 24
    row = next(s for s in summary if s["recipe"] == "mqar-retnet-l" and s["impl"] == "reference")
    assert row["best_lr"] == 3e-3 and row["seeds"] == [0, 1, 2]
    assert row["median_accuracy"] == pytest.approx(0.3 + 0.01 + 0.2)
    assert row["min_accuracy"] == pytest.approx(0.5) and row["median_steps"] == 200


def test_a_learning_rate_with_fewer_finished_seeds_does_not_win():
    """One lucky seed at 1e-2 (0.99) against three at 3e-3 (median 0.6): 3e-3 is the best
    learning rate; the summary says how many seeds each learning rate has."""
    base = dict(setting="gpu", recipe="mqar-gdn-l", kind="gdn", size="l", impl="reference", state_size=1,
                parameters=1, status="ok", steps=100)
    rows = [dict(base, lr=3e-3, seed=s, accuracy=a) for s, a in ((0, 0.5), (1, 0.6), (2, 0.7))]
    rows.append(dict(base, lr=1e-2, seed=0, accuracy=0.99))
    (row,) = bench.summarize(rows)
    assert row["best_lr"] == 3e-3 and row["median_accuracy"] == pytest.approx(0.6)
    assert row["seeds_by_lr"] == {"0.003": 3, "0.01": 1} and row["medians_by_lr"]["0.01"] == 0.99


def test_diverged_runs_are_counted_and_shown():
    """A run that ended on a non-finite held-out loss keeps its best accuracy; the summary and
    the table say how many of the seeds diverged."""
    base = dict(setting="gpu", recipe="mqar-mamba1-s", kind="mamba1", size="s", impl="hybridzoo", state_size=1024,
                parameters=1, status="ok", steps=500, lr=3e-3)
    rows = [dict(base, seed=0, accuracy=0.01, val_loss=float("nan")), dict(base, seed=1, accuracy=0.02, val_loss=7.5),
            dict(base, seed=2, accuracy=0.03, val_loss=float("inf"))]
    (row,) = bench.summarize(rows)
    assert row["diverged"] == 2 and row["median_accuracy"] == pytest.approx(0.02)
    results = {"settings": {"gpu": {**bench.SETTINGS["gpu"], "lrs": [3e-3], "seeds": [0, 1, 2]}}, "runs": rows,
               "summary": [row]}
    line = next(x for x in bench.results_table(results).splitlines() if x.startswith("| mqar-mamba1-s |"))
    assert "0.020 (0.010-0.030), 2 of 3 diverged" in line
    assert "diverged" not in next(x for x in bench.results_table(fake_results()).splitlines()
                                  if x.startswith("| mqar-gdn-l |"))


def test_results_table_on_fake_results():
    table = bench.results_table(fake_results())
    lines = table.splitlines()
    assert "## setting `gpu`" in lines and "- a note" in lines
    row = next(line for line in lines if line.startswith("| mqar-retnet-l |"))
    assert row.split("|")[1:-1] == [" mqar-retnet-l ", " 8,192 ", " 0.510 (0.500-0.520) ", " 0.003 ",
                                    " fla MultiScaleRetention ", " 0.510 (0.500-0.520) ", " 0.003 "]
    assert len([line for line in lines if line.startswith("| mqar-")]) == 12


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (pip install matplotlib)")
def test_plot_on_fake_results(tmp_path):
    path = bench.plot_results(fake_results(), tmp_path / "plot.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        bench.plot_results(fake_results(), tmp_path / "plot.png")


def test_runs_cut_by_the_time_limit_are_left_out_of_the_medians():
    rows = fake_results()["runs"]
    cut = [dict(r, accuracy=0.0, stopped="time limit 10 s") for r in rows
           if r["recipe"] == "mqar-gdn-l" and r["impl"] == "reference" and r["lr"] == 3e-3]
    before = next(s for s in bench.summarize(rows) if s["recipe"] == "mqar-gdn-l" and s["impl"] == "reference")
    after = next(s for s in bench.summarize(rows + cut) if s["recipe"] == "mqar-gdn-l" and s["impl"] == "reference")
    assert after == before


def test_paired_table_lines_up_the_two_implementations_of_a_seed():
    rows = [{"setting": "gpu", "recipe": "mqar-gdn-l", "variant": "", "impl": impl, "lr": 3e-3, "seed": 1,
             "status": "ok", "steps": 500, "accuracy": acc, "first_loss": loss,
             "curve": [{"accuracy": acc / 2}, {"accuracy": acc}], **extra}
            for impl, acc, loss, extra in (("hybridzoo", 0.9, 9.1, {}),
                                           ("reference", 0.5, 9.2, {"stopped": "time limit 200 s"}))]
    rows.append(dict(rows[0], variant="-decay_init=multiscale", accuracy=0.1))  # a variant has no pair
    lines = bench.paired_table(rows)
    (row,) = [line for line in lines if line.startswith("| gpu |")]
    assert row.split("|")[1:-1] == [" gpu ", " mqar-gdn-l ", " 0.003 ", " 1 ", " 9.1 / 9.2 ",
                                    " 0.900 / 0.500 (cut at 500 steps: time limit 200 s) ", " 0.45 0.90 ",
                                    " 0.25 0.50 "]
    kept_from_log = [rows[0], dict(rows[1], first_loss=None, stopped=None)]  # a row rebuilt without its first loss
    (row,) = [line for line in bench.paired_table(kept_from_log) if line.startswith("| gpu |")]
    assert row.split("|")[5] == " 9.1 / - "


def test_set_overrides_the_hybridzoo_mixer_and_names_the_run(tmp_path):
    spec = dict(bench.SETTINGS["cpu-smoke"], overrides={"gdn.decay_init": "multiscale"})
    model, config = bench.build_model("mqar-gdn-l", "hybridzoo", spec, seed=0)
    assert config.gdn.decay_init == "multiscale"
    plain, _ = bench.build_model("mqar-gdn-l", "hybridzoo", bench.SETTINGS["cpu-smoke"], seed=0)
    assert not torch.equal(model.blocks[0].mixer.A_log, plain.blocks[0].mixer.A_log)
    args = bench.parse_args(["--setting", "cpu-smoke", "--kinds", "gdn,attn", "--sizes", "l", "--seeds", "0",
                             "--lrs", "3e-3", "--out-dir", str(tmp_path)])
    jobs, _ = bench.plan(args, spec, "cpu", tmp_path)
    names = sorted(job["id"] for job in jobs)
    assert names == ["cpu-smoke-mqar-attn-l-hybridzoo-lr0.003-s0", "cpu-smoke-mqar-attn-l-reference-lr0.003-s0",
                     "cpu-smoke-mqar-gdn-l-decay_init=multiscale-hybridzoo-lr0.003-s0"]


def test_initial_decays_script_reads_each_heads_decay_from_the_model():
    """scripts/initial_decays.py: per layer, each head's exp(-exp(A_log) softplus(dt_bias)); with
    ``decay_init: multiscale`` the memories are the documented log-spaced ends of memory_range."""
    from tests.conftest import load_script

    script = load_script("initial_decays")
    layers = script.initial_decays("mqar-gdn-l", 0, {"gdn.decay_init": "multiscale",
                                                     "gdn.memory_range": [16, 1024]})
    assert len(layers) == 2 and all(len(heads) == 2 for heads in layers)
    for heads in layers:
        assert [round(1 / (1 - a)) for a in heads] == [16, 1024]
    drawn = script.initial_decays("mqar-gdn-l", 0)
    assert drawn != layers and all(0 < a < 1 for heads in drawn for a in heads)


def test_a_run_cut_by_the_time_limit_resumes_exactly_where_it_stopped(tmp_path, monkeypatch, capsys):
    """Cut at its first evaluation (step 6 of 12), a run leaves a checkpoint; the next invocation
    finishes it, and its curve equals that of the same run never cut (same weights, optimizer,
    schedule, data order). A checkpoint from other settings is refused by name."""
    argv = ["--setting", "cpu-smoke", "--kinds", "attn", "--sizes", "s", "--seeds", "0", "--lrs", "3e-3",
            "--impls", "hybridzoo", "--device", "cpu", "--name", "r"]
    assert bench.main(argv + ["--out-dir", str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "r.json").read_text())["runs"][0]

    cut_dir = tmp_path / "cut"
    monkeypatch.setattr(bench, "out_of_time", lambda spec, start: True)
    assert bench.main(argv + ["--out-dir", str(cut_dir), "--run-seconds", "1"]) == 0
    first = json.loads((cut_dir / "r.json").read_text())["runs"][0]
    assert first["steps"] == 6 and first["stopped"] and any((cut_dir / "r-runs").glob("*.resume.pt"))
    checkpoint = next((cut_dir / "r-runs").glob("*.resume.pt"))

    # other settings: refused for the file, and for the run itself; the checkpoint kept
    monkeypatch.setattr(bench, "out_of_time", lambda spec, start: False)
    with pytest.raises(SystemExit, match="give another --name"):
        bench.main(argv + ["--out-dir", str(cut_dir), "--max-steps", "18"])
    spec = dict(bench.SETTINGS["cpu-smoke"], max_steps=18)
    job = dict(id="x", recipe="mqar-attn-s", impl="hybridzoo", lr=3e-3, seed=0, spec=spec, device="cpu",
               path=str(checkpoint.with_suffix("").with_suffix(".json")))
    with pytest.raises(ValueError, match="delete it to start the run again"):
        bench.train_run(job)
    assert checkpoint.is_file()

    assert bench.main(argv + ["--out-dir", str(cut_dir)]) == 0
    resumed = json.loads((cut_dir / "r.json").read_text())["runs"][0]
    assert resumed["status"] == "ok" and not resumed.get("stopped") and resumed["resumed_at"] == 6
    assert resumed["steps"] == whole["steps"] == 12 and not checkpoint.exists()
    assert resumed["first_loss"] == whole["first_loss"]
    for got, expected in zip(resumed["curve"], whole["curve"], strict=True):
        assert {k: v for k, v in got.items() if k != "seconds"} == {k: v for k, v in expected.items() if k != "seconds"}
    capsys.readouterr()


def test_a_run_trains_on_its_data_order_epoch_after_epoch(monkeypatch):
    """The batches a run trains on (gathered where the model runs) are the seed's data order: the
    first epoch's are the training examples at that order's positions, and each later epoch
    draws every batch from distinct examples, none repeated within the epoch."""
    spec = dict(bench.SETTINGS["cpu-smoke"], num_train=20, batch_size=8, max_steps=6, eval_every=6)
    seen = []
    build = bench.build_model

    def recording(*args, **kwargs):
        model, config = build(*args, **kwargs)
        model.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].clone()) if module.training
                                        else None)
        return model, config

    monkeypatch.setattr(bench, "build_model", recording)
    bench.train_run(dict(id="t", recipe="mqar-attn-s", impl="hybridzoo", lr=3e-3, seed=4, spec=spec, device="cpu"))
    train_ids = bench.batches_of(spec, 4)[0]
    order = torch.randperm(20, generator=torch.Generator().manual_seed(4))
    assert len(seen) == 6
    assert torch.equal(seen[0], train_ids[order[:8]]) and torch.equal(seen[1], train_ids[order[8:16]])
    assert not torch.equal(seen[2], seen[0]) and not torch.equal(seen[4], seen[2])  # a new order each epoch
    rows = {tuple(row.tolist()): i for i, row in enumerate(train_ids)}
    for epoch in (seen[2:4], seen[4:6]):  # 2 batches of 8 from 20 examples per epoch
        indices = [rows[tuple(row.tolist())] for batch in epoch for row in batch]
        assert len(set(indices)) == 16


def test_invocations_into_one_file_merge_their_sweeps_and_refuse_another_schedule(tmp_path, capsys):
    """Two invocations with other learning rates and seeds write one file: its setting lists the
    union of both and both command lines; a third with another step cap is refused by name."""
    base = ["--setting", "cpu-smoke", "--kinds", "attn", "--sizes", "s", "--impls", "hybridzoo", "--device", "cpu",
            "--name", "m", "--out-dir", str(tmp_path), "--max-steps", "2", "--eval-every", "2"]
    assert bench.main(base + ["--lrs", "3e-3", "--seeds", "0"]) == 0
    assert bench.main(base + ["--lrs", "1e-2", "--seeds", "1"]) == 0
    results = json.loads((tmp_path / "m.json").read_text())
    setting = results["settings"]["cpu-smoke"]
    assert setting["lrs"] == [3e-3, 1e-2] and setting["seeds"] == [0, 1] and len(setting["argv"]) == 2
    assert sorted((r["lr"], r["seed"]) for r in results["runs"]) == [(3e-3, 0), (1e-2, 1)]
    assert all(r["commit"] and r["cuda_graph"] is None for r in results["runs"])  # eager on the CPU
    with pytest.raises(SystemExit, match="give another --name"):
        bench.main(base[:-4] + ["--max-steps", "4", "--lrs", "3e-3", "--seeds", "0"])
    capsys.readouterr()


def test_a_run_that_reaches_its_last_step_as_time_runs_out_is_finished_not_cut(tmp_path, monkeypatch, capsys):
    """The time limit is checked at each evaluation; at the last step the run has ended, so it is
    neither marked cut nor leaves a checkpoint to resume (the summary counts it)."""
    monkeypatch.setattr(bench, "out_of_time", lambda spec, start: True)
    argv = ["--setting", "cpu-smoke", "--kinds", "attn", "--sizes", "s", "--seeds", "0", "--lrs", "3e-3",
            "--impls", "hybridzoo", "--device", "cpu", "--name", "r", "--max-steps", "6", "--run-seconds", "1",
            "--out-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    row = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    assert row["steps"] == 6 and "stopped" not in row and "resume_from" not in row
    assert not any((tmp_path / "r-runs").glob("*.resume.pt"))
    capsys.readouterr()


def test_stop_at_leaves_the_runs_it_did_not_start_for_the_next_invocation(tmp_path, capsys):
    """Past --stop-at, a running run stops at its next evaluation (a checkpoint), a run not yet
    started writes no row, and the next invocation runs and finishes both."""
    argv = ["--setting", "cpu-smoke", "--kinds", "attn", "--sizes", "s", "--impls", "hybridzoo", "--device", "cpu",
            "--name", "d", "--out-dir", str(tmp_path), "--lrs", "3e-3", "--seeds", "0,1"]
    assert bench.main(argv + ["--stop-at", "0"]) == 0
    runs = tmp_path / "d-runs"
    assert list(runs.glob("*.json")) == [] and list(runs.glob("*.resume.pt")) == []
    assert "not started (past --stop-at)" in capsys.readouterr().out
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "d.json").read_text())["runs"]
    assert [r["steps"] for r in rows] == [12, 12] and not any(r.get("stopped") for r in rows)
    assert "deadline" not in json.loads((tmp_path / "d.json").read_text())["settings"]["cpu-smoke"]
    capsys.readouterr()


def test_train_step_on_the_cpu_is_the_eager_step_and_refuses_a_graph():
    """benchmarks.graph_step.TrainStep: eager, it is one AdamW step on the gathered batch (the same
    weights as the step written out); a CUDA graph on CPU tensors is refused."""
    from benchmarks.graph_step import TrainStep, make_optimizer
    from hybridzoo.zoo.model import lm_loss, shift_labels

    spec = bench.SETTINGS["cpu-smoke"]
    ids, labels = bench.batches_of(spec, 0)[:2]
    models = [bench.build_model("mqar-attn-s", "hybridzoo", spec, 0)[0] for _ in range(2)]
    optims = [make_optimizer(m.parameters(), 3e-3, (0.9, 0.95), "cpu", graph=False) for m in models]
    index = torch.arange(8)
    step = TrainStep(models[0], optims[0], ids, labels, clip=1.0)
    loss = step(index)
    logits, _ = models[1](ids[index])
    expected = lm_loss(logits, shift_labels(labels[index]))
    expected.backward()
    torch.nn.utils.clip_grad_norm_(models[1].parameters(), 1.0)
    optims[1].step()
    assert torch.equal(loss, expected.detach())
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    # the head and loss at the scored positions only: the same loss and the same step, in float64
    models = [bench.build_model("mqar-attn-s", "hybridzoo", spec, 0)[0].double() for _ in range(2)]
    optims = [make_optimizer(m.parameters(), 3e-3, (0.9, 0.95), "cpu", graph=False) for m in models]
    steps = [TrainStep(models[0], optims[0], ids, labels, clip=1.0, scored_only=True),
             TrainStep(models[1], optims[1], ids, labels, clip=1.0)]
    assert steps[0].positions.shape == (ids.shape[0], spec["num_pairs"])
    for index in (torch.arange(8), torch.arange(8, 16)):
        losses = [s(index) for s in steps]
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=0)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="CUDA graph needs"):
        TrainStep(models[0], optims[0], ids, labels, clip=1.0, graph=True)


def test_quick_autotuning_shortens_the_timing_of_every_autotuner(monkeypatch):
    """quick_autotuning: triton.testing.do_bench (what Triton's autotuners time configs with)
    gets 2 + 10 ms defaults, passes explicit arguments through, and is not wrapped twice."""
    import triton.testing

    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup=25, rep=100, *a, **k: calls.append((warmup, rep, k)))
    bench.quick_autotuning()
    triton.testing.do_bench(lambda: None, quantiles=(0.5, 0.2, 0.8))
    triton.testing.do_bench(lambda: None, 5, 50)
    assert calls == [(2.0, 10.0, {"quantiles": (0.5, 0.2, 0.8)}), (5, 50, {})]
    wrapped = triton.testing.do_bench
    bench.quick_autotuning()
    assert triton.testing.do_bench is wrapped and wrapped.quick == (2.0, 10.0)


def test_runs_sharing_a_process_on_streams_equal_runs_alone(tmp_path, capsys, monkeypatch):
    """``--streams 3``: three runs in threads of one process give the rows each gives alone, over
    several epochs (each run shuffles each new epoch from its own generator, seeded where the
    model's draws leave torch's stream, so a neighbour's draws cannot change its data order)."""
    base = ["--setting", "cpu-smoke", "--kinds", "attn,gdn", "--sizes", "s", "--impls", "hybridzoo", "--device", "cpu",
            "--lrs", "3e-3", "--seeds", "0,1", "--max-steps", "12", "--eval-every", "4", "--patience", "9",
            "--name", "s"]
    smaller = {**bench.SETTINGS, "cpu-smoke": dict(bench.SETTINGS["cpu-smoke"], num_train=40)}  # 5 steps an epoch
    monkeypatch.setattr(bench, "SETTINGS", smaller)
    assert bench.main(base + ["--out-dir", str(tmp_path / "alone")]) == 0
    assert bench.main(base + ["--out-dir", str(tmp_path / "streams"), "--streams", "3"]) == 0
    alone = {r["id"]: r for r in json.loads((tmp_path / "alone" / "s.json").read_text())["runs"]}
    shared = {r["id"]: r for r in json.loads((tmp_path / "streams" / "s.json").read_text())["runs"]}
    assert len(alone) == 4 and alone.keys() == shared.keys()
    for run_id, row in alone.items():
        assert row["status"] == "ok" and row["steps"] == 12
        assert shared[run_id]["first_loss"] == row["first_loss"]
        for got, expected in zip(shared[run_id]["curve"], row["curve"], strict=True):
            assert {k: v for k, v in got.items() if k != "seconds"} == {k: v for k, v in expected.items()
                                                                         if k != "seconds"}
    capsys.readouterr()


def test_patience_stops_a_flat_run_only_where_it_is_set(monkeypatch):
    """A run whose accuracy never rises (MQAR's plateau before recall appears) trains to the step
    cap when patience is off (the GPU settings), and stops after ``patience`` flat evaluations
    past its first where it is set."""
    assert bench.SETTINGS["gpu"]["patience"] is None and bench.SETTINGS["gpu-long"]["patience"] is None
    monkeypatch.setattr(bench, "evaluate", lambda *args, **kwargs: (0.0, 8.3))
    base = dict(bench.SETTINGS["cpu-smoke"], max_steps=12, eval_every=2)
    job = dict(id="t", recipe="mqar-attn-s", impl="hybridzoo", lr=3e-3, seed=0, device="cpu")
    for patience, steps in ((None, 12), (0, 12), (2, 6), (3, 8)):
        row = bench.train_run(dict(job, spec=dict(base, patience=patience)))
        assert row["steps"] == steps, (patience, row["steps"])
        assert [p["step"] for p in row["curve"]] == list(range(2, steps + 1, 2))


def test_paired_summary_counts_the_seeds_each_implementation_wins():
    """Seed by seed: only pairs that both finished count; a cut run or a variant has no pair."""
    def run(impl, seed, accuracy, **extra):
        return {"setting": "gpu", "recipe": "mqar-gla-s", "variant": "", "impl": impl, "lr": 3e-3, "seed": seed,
                "status": "ok", "accuracy": accuracy, **extra}
    rows = [run("hybridzoo", 0, 0.676), run("reference", 0, 0.741), run("hybridzoo", 1, 0.769),
            run("reference", 1, 0.720), run("hybridzoo", 2, 0.619), run("reference", 2, 0.538),
            run("hybridzoo", 3, 0.9), run("reference", 3, 0.1, stopped="time limit 10 s"),
            run("hybridzoo", 4, 0.9, variant="-decay_init=multiscale"), run("reference", 4, 0.1)]
    lines = bench.paired_summary(rows)
    (row,) = [line for line in lines if line.startswith("| gpu |")]
    assert row.split("|")[1:-1] == [" gpu ", " mqar-gla-s ", " 0.003 ", " 3 ", " 2 ", " +0.022 "]
    assert bench.paired_summary([run("hybridzoo", 0, 0.5)]) == []


def test_reference_weights_map_to_hybridzoo_names():
    """Under one seed both models hold the same weights: mapped to hybridzoo's names and shapes
    (fla's separate q/k/v of Gated DeltaNet concatenated, [C, 1, W] convolutions squeezed), the
    reference model's state equals hybridzoo's, name for name."""
    from benchmarks.mqar_reference import hybridzoo_tensors

    spec = bench.SETTINGS["cpu-smoke"]
    recipes = ["mqar-attn-s", "mqar-attn-l"]
    if importlib.util.find_spec("fla") is not None:
        recipes += ["mqar-gdn-s", "mqar-gdn-l", "mqar-gla-s", "mqar-retnet-l"]
    for recipe in recipes:
        ours = bench.build_model(recipe, "hybridzoo", spec, seed=2)[0].state_dict()
        ref = bench.build_model(recipe, "reference", spec, seed=2)[0].state_dict()
        mapped = hybridzoo_tensors(recipe.split("-")[1], ref, ours)
        assert mapped.keys() == ours.keys(), recipe
        for name, value in ours.items():
            assert torch.equal(mapped[name], value), (recipe, name)
    with pytest.raises(KeyError, match="no hybridzoo counterpart"):
        hybridzoo_tensors("gdn", {"blocks.0.mixer.layer.extra.weight": torch.zeros(1)}, ours)


def test_dtype_fp32_tags_both_implementations_and_reaches_the_training_loop(tmp_path, monkeypatch):
    """``--dtype fp32`` names every run ``-fp32`` (both implementations, so that they never mix with
    the benchmark's bf16 runs in one file) and hands the dtype to :class:`RunLoop`."""
    monkeypatch.setattr(bench, "reference_skip_reason", lambda kind, device: None)  # plan without mamba_ssm
    args = bench.parse_args(["--setting", "cpu-smoke", "--kinds", "mamba2", "--sizes", "s", "--seeds", "0",
                             "--lrs", "1e-2", "--dtype", "fp32", "--out-dir", str(tmp_path)])
    jobs, _ = bench.plan(args, dict(bench.SETTINGS["cpu-smoke"]), "cpu", tmp_path)
    assert sorted(job["id"] for job in jobs) == ["cpu-smoke-mqar-mamba2-s-fp32-hybridzoo-lr0.01-s0",
                                                 "cpu-smoke-mqar-mamba2-s-fp32-reference-lr0.01-s0"]
    assert {job["variant"] for job in jobs} == {"-fp32"} and {job["dtype"] for job in jobs} == {"fp32"}
    plain, _ = bench.plan(bench.parse_args(["--setting", "cpu-smoke", "--kinds", "mamba2", "--sizes", "s",
                                            "--seeds", "0", "--lrs", "1e-2", "--out-dir", str(tmp_path)]),
                          dict(bench.SETTINGS["cpu-smoke"]), "cpu", tmp_path)
    assert {job["variant"] for job in plain} == {""} and {job["dtype"] for job in plain} == {"bf16"}

    seen = []

    class Stop(Exception):
        pass

    def recording_loop(*args, **kwargs):
        seen.append(kwargs.get("dtype"))
        raise Stop

    monkeypatch.setattr(bench, "RunLoop", recording_loop)
    with pytest.raises(Stop):
        bench.train_run(jobs[0])
    assert seen == ["fp32"]


def test_render_only_keeps_the_runs_of_a_results_file_without_its_run_folder(tmp_path):
    """A results file kept without its ``<name>-runs`` folder (as committed) renders again from
    the runs it holds; it used to be rewritten with none."""
    import shutil

    source = Path(bench.ROOT) / "benchmarks" / "results" / "2026-12-03-mqar-gpu-3000-h200.json"
    shutil.copy(source, tmp_path / "kept.json")
    runs = json.loads(source.read_text())["runs"]
    assert runs and not (tmp_path / "kept-runs").exists()
    assert bench.main(["--render-only", "--name", "kept", "--out-dir", str(tmp_path)]) == 0
    rendered = json.loads((tmp_path / "kept.json").read_text())
    assert rendered["runs"] == runs
    assert {(s["recipe"], s["impl"]) for s in rendered["summary"]} >= {("mqar-gla-s", "hybridzoo"),
                                                                       ("mqar-gla-s", "reference")}
    assert "| mqar-gla-s |" in (tmp_path / "kept.md").read_text()


def test_a_new_invocation_into_a_results_file_without_its_run_folder_keeps_its_runs(tmp_path, capsys):
    """Adding runs to a committed results file (its run folder is not committed): its runs are
    written back as run files first, so the rebuilt file holds them and the new ones."""
    import shutil

    source = Path(bench.ROOT) / "benchmarks" / "results" / "2026-12-03-mqar-gpu-3000-h200.json"
    shutil.copy(source, tmp_path / "kept.json")
    old = json.loads(source.read_text())["runs"]
    argv = ["--setting", "cpu-smoke", "--kinds", "attn", "--sizes", "s", "--impls", "hybridzoo", "--device", "cpu",
            "--seeds", "0", "--lrs", "3e-3", "--max-steps", "2", "--eval-every", "2", "--name", "kept",
            "--out-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    assert f"mqar: {len(old)} runs of the results file written back" in capsys.readouterr().out
    results = json.loads((tmp_path / "kept.json").read_text())
    ids = [r["id"] for r in results["runs"]]
    assert sorted(ids) == sorted([r["id"] for r in old] + ["cpu-smoke-mqar-attn-s-hybridzoo-lr0.003-s0"])
    assert {"gpu", "cpu-smoke"} <= set(results["settings"])


def test_a_run_that_fell_back_from_the_graph_takes_turns_at_its_eager_steps(tmp_path, monkeypatch):
    """Runs sharing a process (``--streams``) run only graph replays side by side. A run whose graph
    check failed steps eagerly from then on, and an eager step calls Triton's autotuners, whose
    ``run`` is not thread-safe: its steps must hold the lane lock as warm-up steps do (they ran
    unlocked, and fla's autotuner failed in the runs tuning beside them)."""
    args = bench.parse_args(["--setting", "cpu-smoke", "--kinds", "gla", "--sizes", "s", "--impls", "hybridzoo",
                             "--seeds", "0", "--lrs", "1e-2", "--out-dir", str(tmp_path)])
    jobs, _ = bench.plan(args, dict(bench.SETTINGS["cpu-smoke"]), "cpu", tmp_path)
    held = []

    class FellBack(bench.RunLoop):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.train_step.fallback = "check failed (test)"

        def train_step_once(self):
            held.append(bench._LANE_LOCK._is_owned())
            return super().train_step_once()

    monkeypatch.setattr(bench, "RunLoop", FellBack)
    row = bench.train_run(jobs[0])
    assert row["status"] == "ok" and len(held) == row["steps"] == bench.SETTINGS["cpu-smoke"]["max_steps"]
    assert all(held)
