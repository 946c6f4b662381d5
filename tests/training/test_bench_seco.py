"""benchmarks/seco.py (``python -m benchmarks seco``): its CPU smoke path, the JSON rows, and the K/V memory accounting.

The accounting is checked against sizes computed by hand from the recipes' numbers; the measured
memory growth (PyTorch profiler allocation events on the CPU) against that accounting; the
benchmark's full-backprop baseline against SeCO's gradients in float32.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from hybridzoo import HybridLM
from hybridzoo.training.seco_engine import seco_step
from tests.zoo.tiny import tiny_config

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def bench():
    import benchmarks.seco

    return benchmarks.seco


def test_parse_tokens_and_fit_line(bench):
    assert [bench.parse_tokens(t) for t in bench.DEFAULT_LENGTHS.split(",")] == [2**14, 2**15, 2**17, 2**18, 2**19, 2**20]
    assert bench.parse_tokens("5000") == 5000 and bench.parse_tokens("1.5k") == 1536
    with pytest.raises(ValueError, match="--lengths"):
        bench.parse_tokens("12x")
    slope, intercept = bench.fit_line([1.0, 2.0, 4.0], [7.0 + 3.0 * x for x in (1.0, 2.0, 4.0)])
    assert abs(slope - 3.0) < 1e-12 and abs(intercept - 7.0) < 1e-12


def test_kv_accounting_by_hand(bench):
    """Bytes per token = Σ over full-attention layers of 2 · n_kv_heads · head_dim · itemsize,
    x2 (store + gradient) or x1 (offload: gradient only) when the gradient has the store's dtype."""
    model = bench.build_model("tiny-hybrid-full-attn", CPU)  # gdn, mamba2, attn: 1 full attention layer
    # attention: n_heads 4 = n_kv_heads, head_dim 64 / 4 = 16
    kv_fp32, kv_bf16 = 2 * 4 * 16 * 4, 2 * 4 * 16 * 2
    assert bench.kv_bytes_per_token(model, torch.float32) == kv_fp32 == 512
    assert bench.kv_bytes_per_token(model, torch.bfloat16) == kv_bf16 == 256
    # one chunk boundary: gdn recurrent 2 heads x 16 x 32 fp32 + conv tail 3 x (2*2*16 + 2*32) bf16;
    # mamba2 recurrent 8 heads x d_state 16 x head_dim 16 fp32 + conv tail 3 x (128 + 2*16) bf16
    boundary = 2 * 16 * 32 * 4 + 3 * 128 * 2 + 8 * 16 * 16 * 4 + 3 * 160 * 2
    assert bench.boundary_bytes(model, torch.bfloat16) == boundary == 14016
    chunk = 128
    for offload, factor in ((False, 2), (True, 1)):
        # fp32 activations: the gradient buffer has the store's dtype, seed 001's 2x / 1x rule
        fp32 = bench.memory_model(model, torch.float32, chunk, offload)
        assert fp32["kv_formula"] == factor * kv_fp32
        boundary32 = (2 * 16 * 32 * 4 + 3 * 128 * 4 + 8 * 16 * 16 * 4 + 3 * 160 * 4) / chunk
        assert fp32["device"] == factor * kv_fp32 + (0 if offload else boundary32)
        # bf16 autocast: the engine keeps the K/V gradient in float32 (2x the bf16 K/V bytes)
        bf16 = bench.memory_model(model, torch.bfloat16, chunk, offload, rng_bytes_per_chunk=5056)
        assert bf16["kv_formula"] == factor * kv_bf16
        assert bf16["kv_grad"] == 2 * kv_bf16
        assert bf16["device"] == 2 * kv_bf16 + (0 if offload else kv_bf16 + boundary / chunk)
        assert bf16["host"] == 5056 / chunk + (kv_bf16 + boundary / chunk if offload else 0)
        # the gradient in the store's dtype gives back the 2x / 1x rule under bf16 too
        same = bench.memory_model(model, torch.bfloat16, chunk, offload, grad_dtype=torch.bfloat16)
        assert same["device"] - (0 if offload else boundary / chunk) == factor * kv_bf16


def test_kv_accounting_qwen35_attention(bench):
    """The Qwen3.5 recipe's attention (2 K/V heads of 256) at 4 layers (1 of them attention)."""
    model = HybridLM.from_recipe("qwen35-0.8b", vocab_size=256, n_layers=4, d_mlp=0)
    assert model.config.layer_kinds() == ["gdn", "gdn", "gdn", "attn"]
    assert bench.kv_bytes_per_token(model, torch.bfloat16) == 2 * 2 * 256 * 2  # 2 KiB; 6 layers: 12 KiB
    recurrent = HybridLM.from_recipe("gated-deltanet-340m", vocab_size=256, n_layers=2, d_mlp=0)
    assert bench.kv_bytes_per_token(recurrent, torch.bfloat16) == 0


def test_smoke_rows_and_memory_growth(bench, tmp_path):
    out = tmp_path / "seco.json"
    result = bench.benchmark(["tiny-hybrid-full-attn"], [512, 1024], list(bench.MODES), 64, CPU, out,
                             log=lambda *a: None)
    written = json.loads(out.read_text())
    assert written["rows"] == json.loads(json.dumps(result["rows"]))
    rows = {(r["tokens"], r["mode"]): r for r in written["rows"]}
    assert set(rows) == {(t, m) for t in (512, 1024) for m in bench.MODES}
    for (tokens, mode), row in rows.items():
        assert row["status"] == "ok", row
        assert row["step_s"] > 0 and row["optim_s"] >= 0 and row["growth_bytes"] > 0
        assert row["num_chunks"] == (tokens // 64 if mode != "full" else 1)
    info = written["recipes"]["tiny-hybrid-full-attn"]
    assert info["check"]["ok"] and info["parameters"] > 0
    for tokens in (512, 1024):
        assert rows[tokens, "seco"]["loss"] == pytest.approx(rows[tokens, "full"]["loss"], rel=2e-2)
        assert rows[tokens, "seco_offload"]["grad_rel_err_vs"] == "seco"
        assert rows[tokens, "seco_offload"]["grad_rel_err"] < 1e-6   # same math, stores elsewhere
        assert rows[tokens, "full"]["grad_rel_err"] < 3e-2           # bf16 autocast
    # measured growth per token (CPU: every allocation is "device" memory) = the K/V accounting
    for mode in ("seco", "seco_offload"):
        fit = written["summary"]["memory_fits"][f"tiny-hybrid-full-attn/{mode}"]
        model = info["memory_model"][mode]
        assert fit["predicted_bytes_per_token"] == model["device"] + model["host"]
        assert 0.95 < fit["measured_over_predicted"] < 1.1, fit
    assert written["summary"]["memory_fits"]["tiny-hybrid-full-attn/full"]["bytes_per_token"] > \
        10 * written["summary"]["memory_fits"]["tiny-hybrid-full-attn/seco"]["bytes_per_token"]
    assert set(written["summary"]["time_ratios"]["tiny-hybrid-full-attn"]["1024"]) == \
        {"seco_over_full", "seco_offload_over_full", "offload_over_seco"}


def test_full_backprop_baseline_is_the_seco_gradient_in_fp32(bench):
    result = bench.benchmark(["tiny-hybrid-full-attn"], [384], ["seco", "full"], 128, CPU, None,
                             autocast_dtype=None, log=lambda *a: None)
    full = [r for r in result["rows"] if r["mode"] == "full"][0]
    assert full["status"] == "ok" and full["grad_rel_err_vs"] == "seco"
    assert full["grad_rel_err"] < 1e-4


def test_out_of_memory_is_recorded_and_the_run_goes_on(bench, tmp_path, monkeypatch):
    real = bench.train_step
    calls = []

    def fake(model, optimizer, batch, mode, *args):
        calls.append((batch["input_ids"].shape[1], mode))
        if mode == "full" and batch["input_ids"].shape[1] >= 512:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")
        return real(model, optimizer, batch, mode, *args)

    monkeypatch.setattr(bench, "train_step", fake)
    out = tmp_path / "oom.json"
    bench.benchmark(["tiny-recurrent"], [256, 512, 768], ["seco", "full"], 128, CPU, out, log=lambda *a: None)
    rows = {(r["tokens"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[256, "full"]["status"] == "ok"
    assert rows[512, "full"]["status"] == "did not fit" and "out of memory" in rows[512, "full"]["note"]
    assert rows[768, "full"]["status"] == "did not fit" and (768, "full") not in calls  # not even tried
    assert all(rows[t, "seco"]["status"] == "ok" for t in (256, 512, 768))
    # --resume keeps the finished rows and runs nothing again
    calls.clear()
    bench.benchmark(["tiny-recurrent"], [256, 512, 768], ["seco", "full"], 128, CPU, out, resume=True,
                    log=lambda *a: None)
    assert calls == [] and len(json.loads(out.read_text())["rows"]) == 6


def test_cli_and_plot_with_a_stub_matplotlib(bench, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cli.json"
    assert bench.main(["--cpu-smoke", "--recipes", "tiny-recurrent", "--lengths", "256,512", "--modes",
                       "seco,seco_offload,full", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["settings"]["cpu_smoke"] and len(result["rows"]) == 6
    # plot(): matplotlib is not installed on the CPU machines, so drive it with a recording stub
    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getattr__(self, attr):
            return lambda *args, **kwargs: calls.append((self.name, attr, args, kwargs))

    axes = [[Recorder("ax")]]
    pyplot = types.SimpleNamespace(subplots=lambda *a, **k: (Recorder("fig"), axes), close=lambda fig: None)
    matplotlib = types.SimpleNamespace(use=lambda backend: None, pyplot=pyplot)
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    path = bench.plot(result, tmp_path / "cli.png")
    assert path == tmp_path / "cli.png"
    lines = [c for c in calls if c[:2] == ("ax", "plot")]
    assert len(lines) == 3 + 2  # three measured modes + the memory model's lines for the two SeCO modes
    assert ("fig", "savefig") in [c[:2] for c in calls]


def test_plot_with_matplotlib(bench, tmp_path):
    pytest.importorskip("matplotlib")
    result = bench.benchmark(["tiny-recurrent"], [256, 384], ["seco", "full"], 128, CPU, None, grad_check=False,
                             log=lambda *a: None)
    path = bench.plot(result, tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sliced_loss_lowers_the_measured_peak(bench):
    """SeCO's ``loss_slice``: with a large vocabulary the logits are a chunk's biggest activation;
    computing them 32 tokens at a time instead of the whole 256-token chunk must lower the peak
    (CPU allocator, float32: whole-chunk logits, their loss input and gradient are ~4 MB each)."""
    torch.manual_seed(0)
    model = HybridLM(tiny_config(["gdn", "attn"], vocab_size=4096))
    ids = torch.randint(0, 4096, (1, 512))
    peaks = {}
    for loss_slice in (None, 32):
        with bench.MemoryProbe(CPU) as probe:
            seco_step(model, {"input_ids": ids, "labels": ids}, 256, loss_slice=loss_slice)
        model.zero_grad(set_to_none=True)
        peaks[loss_slice] = probe.above_static
    logits_bytes = 256 * 4096 * 4
    assert peaks[32] < peaks[None] - 2 * logits_bytes, peaks


def test_step_flops_counts_linear_weights_and_visible_attention_pairs(bench):
    """qwen35-0.8b's numbers by hand: 6 FLOPs per token per matmul weight (its 752,393,024
    parameters, the tied embedding counted once, as the LM head, less those of no matmul: norms,
    the Gated DeltaNet's depthwise convolutions and per-head decay parameters), and 7 · H · D per
    visible (query, key) pair in each of its 6 attention layers (8 heads of 256); a window caps the
    pairs at tokens · window."""
    with torch.device("meta"):
        model = HybridLM.from_recipe("qwen35-0.8b")
    no_matmul = ("norm", "conv", "A_log", "dt_bias")
    linear = 752_393_024 - sum(p.numel() for name, p in model.named_parameters() if any(n in name for n in no_matmul))
    for tokens in (1, 4096, 2**20):
        expected = 6 * linear * tokens + 6 * 7 * 8 * 256 * tokens * (tokens + 1) / 2
        assert bench.step_flops(model, tokens) == pytest.approx(expected, rel=1e-12)
    with torch.device("meta"):
        windowed = HybridLM.from_recipe("qwen35-0.8b", attn={"window": 1000})
    assert bench.step_flops(windowed, 4096) == pytest.approx(6 * linear * 4096 + 6 * 7 * 8 * 256 * 4096 * 1000,
                                                             rel=1e-12)


def test_predictions_and_summary_keep_settings_apart(bench):
    """Rows of one recipe and mode measured with two attention backwards (same lengths) are two
    settings: the prediction of a longer row uses its own setting's rows only (two rows at one
    length made a ZeroDivisionError before), and the summary names each setting."""
    def row(tokens, step_s, flash, mode="seco"):
        return {"recipe": "r", "mode": mode, "tokens": tokens, "chunk_size": 8, "loss_slice": 4,
                "flash_backward": flash, "status": "ok", "step_s": step_s, "us_per_token": step_s / tokens * 1e6,
                "peak_bytes": 1000 + 10 * tokens, "model_flops": 100.0 * tokens}
    rows = [row(32, 1.0, False), row(64, 4.0, False), row(32, 0.5, True), row(64, 1.0, True)]
    assert bench._predict_seconds(rows, dict(rows[0], tokens=128), True) == pytest.approx(16.0)  # t^2
    assert bench._predict_seconds(rows, dict(rows[2], tokens=128), True) == pytest.approx(2.0)   # t^1
    assert bench._predict_seconds(rows[:1] + rows[2:3], dict(rows[0], tokens=64), True) == pytest.approx(4.0)
    rows.append(row(32, 0.4, False, mode="full"))
    model = {"device": 10, "host": 0, "kv_formula": 8}
    result = {"meta": {"device_memory_bytes": 1}, "recipes": {"r": {"memory_model": {"seco": model}}}, "rows": rows}
    summary = bench.summarize(result)
    names = {"r [chunk 8, loss_slice 4, triton backward]", "r [chunk 8, loss_slice 4, flash backward]"}
    assert set(summary["target"]) == names == set(summary["time_ratios"])
    flash = summary["target"]["r [chunk 8, loss_slice 4, flash backward]"]
    assert flash["same_length_ratio"] == pytest.approx(0.5 / 0.4)
    assert flash["time_per_token_ratio"] == pytest.approx((1.0 / 64) / (0.4 / 32))
    assert flash["work_normalized_ratio"] == pytest.approx((1.0 / 6400) / (0.4 / 3200))
    assert summary["memory_fits"]["r [chunk 8, loss_slice 4, flash backward]/seco"]["bytes_per_token"] == \
        pytest.approx(10.0)
