"""benchmarks/models.py on the CPU: peers of the same shape, interleaved repetitions, the row's ratios."""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
import torch

from benchmarks import models
from hybridzoo import HybridLM

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", list(models.PAIRS))
def test_each_peer_has_our_parameter_count(name):
    """The peer is built from our config: same widths, heads, layers, vocabulary, so the same
    parameter count (checked at the packaged size on the meta device, and at the smoke size)."""
    pair = models.PAIRS[name]
    for tiny in (True, False):
        config = pair.ours(tiny)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                peer, kind = pair.peer(config)
            except models.PeerMissing as error:
                pytest.skip(str(error))
            assert _count(HybridLM(config)) == _count(peer), (name, tiny)
            assert kind in ("hf", "logits")


@pytest.mark.parametrize("name", list(models.PAIRS))
def test_each_peer_starts_from_our_init_std(name):
    """The peer draws its weights with our ``init_std`` (transformers' and fla's
    ``initializer_range``, mamba_ssm's ``initializer_cfg``): the token embedding's std matches.
    (fla's GLA-340M config, which ``gla-340m`` follows, uses 0.006; fla's default is 0.02.)"""
    import dataclasses

    pair = models.PAIRS[name]
    config = dataclasses.replace(pair.ours(True), init_std=0.011)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            peer, _ = pair.peer(config)
        except models.PeerMissing as error:
            pytest.skip(str(error))
    embedding = peer.get_input_embeddings() if hasattr(peer, "get_input_embeddings") else peer.backbone.embedding
    assert float(embedding.weight.std()) == pytest.approx(0.011, rel=0.05), name
    assert float(HybridLM(config).embed.weight.std()) == pytest.approx(0.011, rel=0.05)


def test_run_pair_interleaves_and_reports_median_min_max(tmp_path):
    args = argparse.Namespace(cpu_smoke=True, batch=1, repeats=3, warmup=0, steps=1, no_peer=False)
    lines = []
    row = models.run_pair(models.PAIRS["attn-340m"], 16, args, torch.device("cpu"), log=lines.append)
    order = [line.split()[3] for line in lines]
    assert order == ["ours", "peer"] * 3  # ours, peer, ours, peer, ...
    ratios = [o["tokens_per_s"] / p["tokens_per_s"] for o, p in zip(row["ours"], row["peer_runs"])]
    spread = row["ratio_tokens_per_s"]
    assert spread["all"] == ratios and spread["min"] <= spread["median"] <= spread["max"]
    assert spread["median"] == sorted(ratios)[1]
    assert row["ours"][0]["params"] == row["peer_runs"][0]["params"]
    assert all(r["first_step_s"] > 0 and r["loss"] > 0 for r in row["ours"] + row["peer_runs"])


def test_a_missing_peer_is_skipped_with_a_message():
    args = argparse.Namespace(cpu_smoke=True, batch=1, repeats=1, warmup=0, steps=1, no_peer=False)
    lines = []
    row = models.run_pair(models.PAIRS["gated-deltanet-340m"], 16, args, torch.device("cpu"), log=lines.append)
    assert "runs on CUDA only" in row["peer_skipped"] and "peer skipped" in lines[0]
    assert len(row["ours"]) == 1 and row["peer_runs"] == [] and "ratio_tokens_per_s" not in row


def test_cli_refuses_few_repeats_and_unknown_pairs(capsys):
    with pytest.raises(SystemExit):
        models.parse_args(["--repeats", "2"])
    assert "at least 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        models.parse_args(["--pairs", "gla-340m,nope"])
    assert "unknown pair" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        models.parse_args(["--all-compile-threads", "-1"])
    assert "0 or more" in capsys.readouterr().err


def test_cpu_smoke_cli_writes_json(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "SMOKE_PAIRS", "attn-340m")
    out = tmp_path / "models.json"
    assert models.main(["--cpu-smoke", "--all-compile-threads", "4", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["settings"]["all_compile_threads"] == 4  # recorded (a CPU has no autotuner to change)
    assert record["settings"]["cpu_smoke"] and record["versions"]["torch"] == torch.__version__
    assert [row["pair"] for row in record["rows"]] == ["attn-340m"] and record["rows"][0]["ratio_tokens_per_s"]


def test_tokens_per_step_sets_the_batch_at_each_length():
    args = models.parse_args([])
    assert (models.batch_for(2048, args), models.batch_for(8192, args)) == (8, 2)  # 16384 tokens each
    assert models.batch_for(8192, models.parse_args(["--batch", "3"])) == 3
    with pytest.raises(ValueError, match="longer than --tokens-per-step"):
        models.batch_for(32768, args)


def test_first_step_runs_each_side_once_to_its_first_step():
    args = models.parse_args(["--first-step", "--repeats", "5"])
    assert (args.repeats, args.warmup, args.steps) == (1, 0, 1)
    lines = []
    args.cpu_smoke, args.batch = True, 1
    row = models.run_pair(models.PAIRS["attn-340m"], 16, args, torch.device("cpu"), log=lines.append)
    assert len(row["ours"]) == len(row["peer_runs"]) == 1 and row["ours"][0]["first_step_s"] > 0
    assert "attn-340m" in models.table([row]).splitlines()[1]


def test_no_peer_times_hybridzoo_alone():
    args = models.parse_args(["--first-step", "--no-peer"])
    args.cpu_smoke, args.batch = True, 1
    lines = []
    row = models.run_pair(models.PAIRS["attn-340m"], 16, args, torch.device("cpu"), log=lines.append)
    assert len(row["ours"]) == 1 and row["peer_runs"] == [] and "--no-peer" in row["peer_skipped"]
    assert "ratio_tokens_per_s" not in row and not any(" peer #" in line for line in lines)
