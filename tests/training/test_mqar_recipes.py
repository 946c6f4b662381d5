"""The ``mqar-<kind>-<s|l>`` recipes and ``scripts/mqar_sweep.py``: every recipe loads and builds,
its state size from the config equals the state the model really keeps, the two sizes of each kind
are ordered; one recipe trains 3 steps through ``hybridzoo fit`` and ``hybridzoo eval`` reports
its MQAR accuracy; the table and the plot of the sweep work on fake results."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from hybridzoo import HybridConfig, HybridLM
from hybridzoo.cli import main as cli_main
from hybridzoo.layers.attention import KVState
from hybridzoo.training.mqar import multiquery_ar
from hybridzoo.zoo.recipes import load_recipe, load_recipe_config
from tests.conftest import load_script

KINDS = ("mamba1", "mamba2", "gla", "retnet", "gdn", "attn")
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

sweep = load_script("mqar_sweep")


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
    assert sweep.mqar_recipes() == [f"mqar-{kind}-{size}" for kind in KINDS for size in "sl"]
    assert sweep.select_recipes("mqar-gla-*, mqar-attn-l") == ["mqar-gla-s", "mqar-gla-l", "mqar-attn-l"]
    with pytest.raises(SystemExit, match="mqar-lstm"):
        sweep.select_recipes("mqar-lstm-s")


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
            assert sweep.state_size(config, seq_len) == measured_state_size(config, seq_len), (name, seq_len)
        sizes[size] = [sweep.state_size(config, t) for t in (64, data["seq_len"], 512)]
        assert all(isinstance(s, int) and s > 0 for s in sizes[size])
    assert all(small < large for small, large in zip(sizes["s"], sizes["l"])), sizes


def test_state_size_formulas_on_hand_made_configs():
    config = HybridConfig(d_model=32, n_layers=1, layers="mamba2", mamba2={"d_state": 4, "head_dim": 16})
    assert sweep.state_size(config, 100) == (64 // 16) * 4 * 16
    config = HybridConfig(d_model=32, n_layers=1, layers="attn", attn={"n_heads": 4, "n_kv_heads": 2, "window": 5})
    assert sweep.state_size(config, 3) == 2 * 3 * 2 * 8 and sweep.state_size(config, 100) == 2 * 5 * 2 * 8
    mixed = HybridConfig(d_model=32, n_layers=2, layers="gdn attn")
    with pytest.raises(ValueError, match="kind="):
        sweep.state_size(mixed, 10)
    gdn = mixed.gdn
    assert sweep.state_size(mixed, 10, kind="gdn") == gdn.num_v_heads * gdn.head_k_dim * gdn.head_v_dim


def test_a_recipe_trains_three_steps_and_eval_reports_its_accuracy(tmp_path, capsys):
    run = {"setting": "tiny", "device": "cpu", "steps": 3, "seq_len": 16, "num_pairs": 2, "vocab_size": 32,
           "batch_size": 4, "num_train": None, "num_val": 8, "warmup_steps": 1, "lr": 1e-2, "seed": 0,
           "chunk_size": 8, "max_minutes": None}
    row = sweep.train_and_evaluate("mqar-gdn-s", run, tmp_path)
    capsys.readouterr()
    assert row["status"] == "ok", row.get("error")
    assert row["steps"] == 3 and row["state_size"] == 1024
    assert row["fit_args"][row["fit_args"].index("--model.config.gdn.chunk_size") + 1] == "8"
    assert HybridLM.from_pretrained(row["export"]).config.gdn.chunk_size == 8
    assert 0.0 <= row["accuracy"] <= 1.0 and row["eval_answers"] == 8 * 2
    # hybridzoo eval --json on the export reports the same accuracy ...
    assert cli_main(["eval", row["export"], "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mqar_accuracy"] == row["accuracy"]
    # ... which is the argmax recall over the held-out examples (MQARDataModule: seed 2 * 0 + 1)
    model = HybridLM.from_pretrained(row["export"])
    input_ids, labels = multiquery_ar(8, 16, 32, 2, seed=1)
    with torch.no_grad():
        logits, _ = model(input_ids)
    answers = labels[:, 1:] != -100
    correct = (logits[:, :-1].argmax(-1) == labels[:, 1:]) & answers
    assert row["accuracy"] == pytest.approx(int(correct.sum()) / int(answers.sum()), abs=0)


def fake_results() -> dict:
    runs = []
    for i, kind in enumerate(KINDS):
        for size, state in (("s", 1024), ("l", 8192)):
            runs.append({"recipe": f"mqar-{kind}-{size}", "kind": kind, "size": size, "setting": "cpu",
                         "state_size": state, "parameters": 120_000 + i, "steps": 300, "fit_s": 90.0,
                         "accuracy": 0.1 * i + (0.2 if size == "l" else 0.0), "loss": 3.5, "status": "ok"})
            runs.append({"recipe": f"mqar-{kind}-{size}", "kind": kind, "size": size, "setting": "gpu",
                         "state_size": state * 4, "parameters": 650_000, "status": "not run"})
    settings = {"cpu": {"seq_len": 64, "num_pairs": 4, "vocab_size": 256, "batch_size": 32, "steps": 300,
                        "device": "cpu", "max_minutes": 1.6},
                "gpu": {"seq_len": 256, "num_pairs": 16, "vocab_size": 8192, "steps": 4000, "device": "cuda"}}
    return {"date": "2026-11-30", "settings": settings, "runs": runs, "notes": ["a note"],
            "meta": {"commit": "abc", "torch": "x", "lightning": "y"}}


def test_results_table_on_fake_results():
    table = sweep.results_table(fake_results())
    lines = table.splitlines()
    assert "## setting `cpu`" in lines and "## setting `gpu`" in lines and "- a note" in lines
    row = next(line for line in lines if line.startswith("| mqar-retnet-l |"))
    assert row.split("|")[1:-1] == [" mqar-retnet-l ", " retnet ", " 8,192 ", " 120,003 ", " 300 ", " 90 ",
                                    " 0.500 ", " 3.500 ", " ok "]
    gpu_rows = [line for line in lines[lines.index("## setting `gpu`"):] if line.startswith("| mqar-")]
    assert len(gpu_rows) == 12 and all(line.endswith("| not run |") for line in gpu_rows)


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (pip install matplotlib)")
def test_plot_on_fake_results(tmp_path):
    path = sweep.plot_results(fake_results(), tmp_path / "plot.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        sweep.plot_results(fake_results(), tmp_path / "plot.png")


def test_not_run_rows_and_render_only(tmp_path, capsys):
    out = tmp_path / "results"
    assert sweep.main(["--setting", "gpu", "--not-run", "--out-dir", str(out), "--name", "plan"]) == 0
    results = json.loads((out / "plan.json").read_text())
    assert results["settings"]["gpu"]["status"] == "not run"
    assert [r["recipe"] for r in results["runs"]] == sweep.mqar_recipes()
    for row in results["runs"]:
        assert row["status"] == "not run" and "accuracy" not in row
        args = row["fit_args"]
        assert args[:3] == ["fit", "--config", row["recipe"]]
        assert args[args.index("--trainer.accelerator") + 1] == "gpu"
        assert args[args.index("--data.init_args.seq_len") + 1] == "256"
    attn_l = next(r for r in results["runs"] if r["recipe"] == "mqar-attn-l")
    assert attn_l["state_size"] == 2 * 256 * 64  # full attention at T = 256
    assert sweep.main(["--render-only", "--out-dir", str(out), "--name", "plan", "--note", "later"]) == 0
    assert "- later" in (out / "plan.md").read_text()
    capsys.readouterr()


def test_merge_folds_partial_sweeps(tmp_path, capsys):
    """--merge: two partial GPU sweeps (run side by side) replace the planned rows of the target;
    the other settings' rows stay; a later file wins for the same recipe."""
    out = tmp_path / "results"
    assert sweep.main(["--setting", "gpu", "--not-run", "--out-dir", str(out), "--name", "all"]) == 0
    base = fake_results()
    parts = []
    for i, recipes in enumerate((["mqar-gla-s", "mqar-gdn-l"], ["mqar-gdn-l"])):
        runs = [dict(next(r for r in base["runs"] if r["recipe"] == name), setting="gpu", status="ok",
                     accuracy=0.25 * (i + 1)) for name in recipes]
        path = tmp_path / f"part{i}.json"
        path.write_text(json.dumps({**base, "runs": runs, "settings": {"gpu": {"steps": 100 + i}}}))
        parts.append(str(path))
    assert sweep.main(["--merge", *parts, "--out-dir", str(out), "--name", "all"]) == 0
    merged = json.loads((out / "all.json").read_text())
    rows = {r["recipe"]: r for r in merged["runs"] if r["setting"] == "gpu"}
    assert len(rows) == 12 and rows["mqar-gla-s"]["accuracy"] == 0.25 and rows["mqar-gdn-l"]["accuracy"] == 0.5
    assert rows["mqar-attn-s"]["status"] == "not run" and merged["settings"]["gpu"]["steps"] == 101
    assert "| mqar-gdn-l |" in (out / "all.md").read_text()
    capsys.readouterr()
