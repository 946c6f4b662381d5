"""``hybridzoo fit / eval / generate / recipes``: the CLI end to end on a tiny model, and bad
input that must end in one clear error line, exit status 2, and no file clobbered."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from hybridzoo import HybridLM
from hybridzoo.cli import main

ROOT = Path(__file__).resolve().parents[2]

TINY_MODEL = {
    "config": {
        "d_model": 16, "n_layers": 2, "layers": "gdn attn", "d_mlp": 32,
        "gdn": {"num_k_heads": 2, "num_v_heads": 2, "head_k_dim": 8, "head_v_dim": 8, "chunk_size": 8},
        "attn": {"n_heads": 2, "window": 8},
    },
    "learning_rate": 1e-2,
    "warmup_steps": 2,
}
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def write_corpus(path: Path, n_docs: int = 40) -> Path:
    """A jsonl corpus of ``n_docs`` short, varied documents (about 150 bytes each)."""
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i % 7}  # document {i}\n" * 3})
             for i in range(n_docs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_recipe(directory: Path, root: Path, corpus: Path, max_steps: int = 4, seq_len: int = 16,
                 model: dict | None = None, callbacks: list | None = None, **trainer) -> Path:
    """A complete recipe for a tiny byte-level run on ``corpus`` writing under ``root``."""
    recipe = {
        "model": model or TINY_MODEL,
        "data": {"class_path": "hybridzoo.training.data.TextDataModule",
                 "init_args": {"paths": [str(corpus)], "seq_len": seq_len, "batch_size": 4, "val_fraction": 0.25}},
        "trainer": {"default_root_dir": str(root), "max_steps": max_steps, "accelerator": "cpu",
                    "log_every_n_steps": 1, "limit_val_batches": 2, "num_sanity_val_steps": -1,
                    "callbacks": callbacks if callbacks is not None else [
                        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                         "init_args": {"save_last": True}}],
                    **trainer},
    }
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(directory: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short fit: 4 steps, a validation and checkpoint at step 2 and 4, the export."""
    tmp = tmp_path_factory.mktemp("fit")
    corpus = write_corpus(tmp / "corpus.jsonl")
    recipe = write_recipe(tmp, tmp / "run", corpus, max_steps=4, val_check_interval=2)
    code = main(["fit", "--config", str(recipe), *QUIET])
    assert code == 0
    return tmp


def test_fit_exports_a_loadable_model(trained):
    export = trained / "run" / "export"
    assert {"model.safetensors", "config.json", "training.json"} <= {p.name for p in export.iterdir()}
    model = HybridLM.from_pretrained(export)
    assert model.config.vocab_size == 256 and model.config.d_model == 16  # linked from the data
    # the export holds the final weights: those of the last Lightning checkpoint (step 4)
    ckpt = torch.load(next((trained / "run").rglob("last.ckpt")), map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ckpt["state_dict"]["model." + name]), name
    info = json.loads((export / "training.json").read_text())
    assert info["data"]["class_path"].endswith("TextDataModule") and info["global_step"] == 4
    assert [h["step"] for h in info["val_history"]] == [0, 2, 4]


def test_eval_matches_an_independent_cross_entropy(trained, capsys):
    export = trained / "run" / "export"
    code, out, err = run_cli(["eval", export, "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    # independent: the held-out rows straight from the data module, one cross-entropy over all
    from hybridzoo.training.data import TextDataModule

    data = TextDataModule(paths=[str(trained / "corpus.jsonl")], seq_len=16, batch_size=4, val_fraction=0.25)
    data.setup("validate")
    rows = torch.stack([data._val_set[i]["input_ids"] for i in range(len(data._val_set))])
    model = HybridLM.from_pretrained(export)
    with torch.no_grad():
        logits = model(rows)[0]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 256), rows[:, 1:].reshape(-1)).item()
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(loss / math.log(2), rel=1e-5)
    assert result["tokens"] == rows[:, 1:].numel() and result["tokens_per_s"] > 0
    code, out, _ = run_cli(["eval", export], capsys)  # the table form
    assert code == 0 and "bits_per_byte" in out
    # --data: other files, the same tokenizer and row length (held-out documents of that file)
    other = write_corpus(trained / "other.jsonl", n_docs=8)
    code, out, err = run_cli(["eval", export, "--data", other, "--json"], capsys)
    assert code == 0, err
    other_data = TextDataModule(paths=[str(other)], seq_len=16, val_fraction=0.25)
    other_data.setup("validate")
    assert json.loads(out)["tokens"] == len(other_data._val_set) * 15


def test_generate_greedy_is_the_model_generate(trained, capsys):
    export = trained / "run" / "export"
    code, out, err = run_cli(["generate", export, "--prompt", "def f", "--max-new-tokens", "12",
                              "--temperature", "0", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    model = HybridLM.from_pretrained(export)
    ids = model.generate(torch.tensor([list(b"def f")]), max_new_tokens=12)[0, 5:].tolist()
    assert result["new_tokens"] == 12
    assert result["completion"] == bytes(ids).decode("utf-8", errors="replace")
    code, out, _ = run_cli(["generate", export, "--prompt", "def f", "--max-new-tokens", "5"], capsys)
    assert code == 0 and out.startswith("def f")


def test_mqar_fit_eval_reports_recall_accuracy(tmp_path, capsys):
    recipe = write_recipe(tmp_path, tmp_path / "run", write_corpus(tmp_path / "c.jsonl"), max_steps=2)
    data = ["--data", "hybridzoo.training.data.MQARDataModule", "--data.vocab_size", "64", "--data.seq_len", "32",
            "--data.num_pairs", "4", "--data.num_train", "32", "--data.num_val", "16", "--data.batch_size", "8"]
    code, _, err = run_cli(["fit", "--config", recipe, *data, *QUIET], capsys)
    assert code == 0, err
    export = tmp_path / "run" / "export"
    assert HybridLM.from_pretrained(export).config.vocab_size == 64  # linked from the data module
    code, out, err = run_cli(["eval", export, "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["data"] == "MQARDataModule" and "bits_per_byte" not in result
    assert result["tokens"] == 16 * 4  # loss and accuracy only at the 4 query answers of 16 examples
    assert 0 <= result["mqar_accuracy"] == result["accuracy"] <= 1
    code, _, err = run_cli(["generate", export, "--prompt", "1 2 3"], capsys)
    assert code == 2 and "MQAR" in err


def test_print_config_overrides_and_defaults(tmp_path, capsys):
    recipe = write_recipe(tmp_path, tmp_path / "run", write_corpus(tmp_path / "c.jsonl"))
    code, out, _ = run_cli(["fit", "--config", recipe, "--trainer.max_steps", "7",
                            "--model.config.d_model", "24", "--print_config"], capsys)
    assert code == 0
    config = yaml.safe_load(out)
    assert config["trainer"]["max_steps"] == 7 and config["model"]["config"]["d_model"] == 24
    assert config["model"]["config"]["layers"] == "gdn attn"
    assert config["trainer"]["precision"] == ("bf16-mixed" if torch.cuda.is_available() else "32-true")
    assert config["trainer"]["gradient_clip_val"] == 1.0
    assert config["data"]["init_args"]["seq_len"] == 16
    assert not (tmp_path / "run").exists()  # printing writes nothing


def test_recipe_name_path_and_several_configs(tmp_path, capsys):
    from hybridzoo.zoo.recipes import recipe_path

    by_name = run_cli(["fit", "--config", "tiny-hybrid", "--print_config"], capsys)
    by_path = run_cli(["fit", "--config", recipe_path("tiny-hybrid"), "--print_config"], capsys)
    assert by_name[0] == by_path[0] == 0 and by_name[1] == by_path[1]
    config = yaml.safe_load(by_name[1])
    assert config["model"]["config"]["layers"] == "gdn mamba2 attn"
    assert config["data"]["class_path"].endswith("TextDataModule")
    assert config["trainer"]["default_root_dir"] == "runs/tiny-hybrid"
    # a second --config overrides the first; dotted options override both
    extra = tmp_path / "extra.yaml"
    extra.write_text("trainer:\n  max_steps: 11\n  default_root_dir: elsewhere\n")
    code, out, _ = run_cli(["fit", "--config", "tiny-hybrid", "--config", extra,
                            "--trainer.default_root_dir", tmp_path, "--print_config"], capsys)
    config = yaml.safe_load(out)
    assert code == 0 and config["trainer"]["max_steps"] == 11
    assert config["trainer"]["default_root_dir"] == str(tmp_path)
    assert config["model"]["config"]["d_model"] == 64  # still the packaged recipe's model


# ---- bad input: a clear message, exit status 2, nothing clobbered -------------------------------
@pytest.fixture
def previous_run(tmp_path):
    """A run directory holding a previous export that a failing command must leave untouched."""
    root = tmp_path / "run"
    (root / "export").mkdir(parents=True)
    (root / "export" / "model.safetensors").write_bytes(b"previous weights")
    (root / "export" / "config.json").write_text('{"previous": true}')
    return root


@pytest.mark.parametrize("case", ["missing path", "empty file", "seq_len too long", "unknown key",
                                  "unknown mixer", "unknown recipe"])
def test_bad_fit_input_is_a_clear_error(case, tmp_path, previous_run, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl")
    model = json.loads(json.dumps(TINY_MODEL))
    if case == "unknown key":
        model["config"]["gdn"]["bogus"] = 3
    elif case == "unknown mixer":
        model["config"]["layers"] = "gdn lstm"
    recipe = write_recipe(tmp_path, previous_run, corpus, model=model)
    args = ["fit", "--config", recipe, "--overwrite", "true", *QUIET]  # even when allowed to overwrite
    expected = {
        "missing path": "does not exist", "empty file": "holds no text", "seq_len too long": "seq_len",
        "unknown key": "bogus", "unknown mixer": "unknown mixer kind", "unknown recipe": "no-such-recipe",
    }[case]
    if case == "missing path":
        args += ["--data.init_args.paths", f"[{tmp_path / 'nowhere.txt'}]"]
    elif case == "empty file":
        (tmp_path / "empty.txt").write_text("")
        args += ["--data.init_args.paths", f"[{tmp_path / 'empty.txt'}]"]
    elif case == "seq_len too long":
        args += ["--data.init_args.seq_len", "100000"]
    elif case == "unknown recipe":
        args = ["fit", "--config", "no-such-recipe"]
    before = snapshot(previous_run)
    code, out, err = run_cli(args, capsys)
    assert code == 2
    assert expected in err and "Traceback" not in err + out and "Union" not in err
    after = snapshot(previous_run)
    assert {p: b for p, b in after.items() if p in before} == before  # nothing overwritten
    assert not any(p.suffix in (".ckpt", ".safetensors") for p in set(after) - set(before))


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_eval_and_generate_need_a_model(command, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("no model here")
    before = snapshot(tmp_path)
    args = [command, tmp_path] + (["--prompt", "x"] if command == "generate" else [])
    code, out, err = run_cli(args, capsys)
    assert code == 2 and "model.safetensors" in err and "config.json" in err
    assert "Traceback" not in err + out
    assert snapshot(tmp_path) == before
    code, _, err = run_cli([command, tmp_path / "missing"] + args[2:], capsys)
    assert code == 2 and "does not exist" in err


def installed_script() -> str:
    """The ``hybridzoo`` console script that ``pip install`` put beside this Python (skip without one)."""
    import shutil

    found = shutil.which("hybridzoo", path=str(Path(sys.executable).parent)) or shutil.which("hybridzoo")
    if found is None:
        pytest.skip("the hybridzoo console script is not installed (pip install -e .)")
    return found


def test_installed_console_script_runs_help_and_the_recipes_table():
    """The installed entry point itself (pyproject's [project.scripts]): the top-level help lists
    every command, and ``hybridzoo recipes`` prints a row per packaged recipe."""
    from hybridzoo.zoo.recipes import recipe_names

    script = installed_script()
    run = subprocess.run([script, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    for command in ("fit", "validate", "test", "eval", "generate", "recipes", "convert", "demo"):
        assert command in run.stdout
    run = subprocess.run([script, "recipes"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stderr
    names = recipe_names()
    assert names and all(name in run.stdout for name in names)
    assert "361,720" in run.stdout  # tiny-hybrid's parameters, as its recipe's comment states


def test_recipes_and_convert(capsys):
    code, out, err = run_cli(["recipes"], capsys)
    assert code == 0, err
    assert "tiny-hybrid" in out and "361,720" in out
    code, _, err = run_cli(["convert", "/nonexistent/src", "/nonexistent/out"], capsys)
    assert code == 2 and "error" in err


def test_fsdp_on_cpu_is_refused_clearly(tmp_path, previous_run, capsys):
    """Lightning's FSDP strategy needs CUDA devices: on a CPU it is refused before anything runs or
    is written (one error line, exit status 2). FSDP is covered only by GPU runs."""
    recipe = write_recipe(tmp_path, previous_run, write_corpus(tmp_path / "c.jsonl"))
    before = snapshot(previous_run)
    code, out, err = run_cli(["fit", "--config", recipe, "--trainer.strategy", "fsdp", "--trainer.accelerator",
                              "cpu", "--trainer.devices", "2", *QUIET], capsys)
    assert code == 2 and "fsdp" in err and "requires a GPU accelerator" in err
    assert "Traceback" not in err + out and snapshot(previous_run) == before


# ---- errors that point the right way (issue 56) -------------------------------------------------
def test_fit_and_eval_name_the_same_bad_jsonl_line(trained, tmp_path, previous_run, capsys):
    """A malformed line 102: fit reported json's own 'Invalid control character' (root_cause
    followed the context past ``raise ... from None``); now both commands name the file and line."""
    corpus = write_corpus(tmp_path / "c.jsonl", n_docs=150)
    lines = corpus.read_text().splitlines()
    lines[101] = '{"text": "a tab\tinside"}'  # a raw control character: not valid JSON
    corpus.write_text("\n".join(lines) + "\n")
    recipe = write_recipe(tmp_path, previous_run, corpus)
    code, out, fit_err = run_cli(["fit", "--config", recipe, "--overwrite", "true", *QUIET], capsys)
    assert code == 2 and "Traceback" not in fit_err + out
    assert f"{corpus}, line 102: not valid JSON" in fit_err
    code, _, eval_err = run_cli(["eval", trained / "run" / "export", "--data", corpus], capsys)
    assert code == 2
    message = lambda err: err.strip().splitlines()[-1].split("error: ", 1)[1]  # noqa: E731
    assert message(fit_err) == message(eval_err)


def test_eval_data_refuses_a_binary_file(trained, tmp_path, capsys):
    binary = tmp_path / "ls.txt"
    binary.write_bytes(Path("/bin/ls").read_bytes() if Path("/bin/ls").is_file() else b"\x7fELF\x00\x01")
    code, out, err = run_cli(["eval", trained / "run" / "export", "--data", binary], capsys)
    assert code == 2 and f"{binary}: NUL byte at offset" in err and "Traceback" not in err + out


@pytest.mark.parametrize("args,expected", [
    (["--bogus", "3"], "unrecognized arguments: --bogus 3"),
    (["--trainer.max_steps", "abc"], 'Parser key "trainer.max_steps": Expected a'),
    (["--data.init_args.seq_len", "abc"], 'Parser key "seq_len": Expected a'),
])
def test_a_bad_argument_is_one_line_without_the_usage(args, expected, tmp_path, capsys):
    """jsonargparse printed about 145 lines of usage before the error."""
    code, out, err = run_cli(["fit", "--config", "tiny-hybrid", *args], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "usage" not in err, err
    assert lines[0].startswith("hybridzoo fit: error: ") and expected in lines[0]
    assert "(see hybridzoo fit --help)" in lines[0]


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: 10\n  callbacks: [1\n")
    code, out, err = run_cli(["fit", "--config", "tiny-hybrid", "--config", bad], capsys)
    assert code == 2 and "usage" not in err
    assert f"{bad}, line 4, column 1: not valid YAML" in err and "line 3, column 14" in err


@pytest.mark.parametrize("form", ["separate", "joined"])
def test_a_negative_number_is_an_option_value(form, tmp_path, previous_run, capsys):
    """'--model.learning_rate -1e-3' said 'expected one argument': argparse took -1e-3 for an
    option. The value now reaches the learning-rate check and its message."""
    recipe = write_recipe(tmp_path, previous_run, write_corpus(tmp_path / "c.jsonl"))
    value = ["--model.learning_rate", "-1e-3"] if form == "separate" else ["--model.learning_rate=-1e-3"]
    code, out, err = run_cli(["fit", "--config", recipe, *value, *QUIET], capsys)
    assert code == 2 and "expected one argument" not in err
    assert "need learning_rate > 0" in err and "got -0.001" in err


def test_generate_on_cuda_without_cuda_is_one_line(trained, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_cli(["generate", trained / "run" / "export", "--prompt", "x", "--device", "cuda"], capsys)
    assert code == 2 and "Traceback" not in err + out
    assert "--device cuda: CUDA is not available on this machine" in err and "--device cpu" in err


def test_generate_and_eval_refuse_nan_or_inf_weights(trained, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    export = tmp_path / "export"
    shutil.copytree(trained / "run" / "export", export)
    tensors = load_file(str(export / "model.safetensors"))
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name].view(-1)[0] = float("nan")
    tensors[name].view(-1)[-1] = float("inf")
    save_file(tensors, str(export / "model.safetensors"))
    for command in (["generate", export, "--prompt", "def", "--device", "cpu"], ["eval", export]):
        code, out, err = run_cli(command, capsys)
        assert code == 2 and "Traceback" not in err + out
        assert f"tensor {name!r} holds 1 NaN and 1 infinite values" in err
