"""``python -m benchmarks mqar_takeoff``: take-off counts per group and Fisher's exact test."""

import json
import math

import pytest

from benchmarks import mqar_takeoff as takeoff


def test_fisher_exact_matches_the_hypergeometric_tables_worked_by_hand():
    # Fisher's tea tasting: 3 of 4 against 1 of 4; tables as or less likely: x = 0, 1, 3, 4 of C(8,4) = 70
    assert takeoff.fisher_exact(3, 4, 1, 4) == pytest.approx((1 + 16 + 16 + 1) / 70)
    assert takeoff.fisher_exact(4, 4, 0, 4) == pytest.approx(2 / 70)
    assert takeoff.fisher_exact(2, 4, 2, 4) == pytest.approx(1.0)
    # 9 of 9 against 3 of 9: only x = 9 (and its mirror x = 3 has equal prob) among k = 12
    p9 = math.comb(9, 9) * math.comb(9, 3) / math.comb(18, 12)
    p8 = math.comb(9, 8) * math.comb(9, 4) / math.comb(18, 12)
    assert p9 < p8 and takeoff.fisher_exact(9, 9, 3, 9) == pytest.approx(2 * p9)
    with pytest.raises(ValueError):
        takeoff.fisher_exact(5, 4, 1, 4)


def test_fisher_exact_agrees_with_scipy():
    stats = pytest.importorskip("scipy.stats")
    for a, n1, b, n2 in ((13, 27, 21, 27), (15, 18, 13, 27), (0, 5, 5, 5), (7, 20, 3, 11)):
        expected = stats.fisher_exact([[a, n1 - a], [b, n2 - b]]).pvalue
        assert takeoff.fisher_exact(a, n1, b, n2) == pytest.approx(expected, rel=1e-9)


def _run(impl, seed, accuracy, variant="", lr=0.01, status="ok", **extra):
    return dict(setting="gpu", recipe="mqar-mamba2-s", variant=variant, impl=impl, lr=lr, seed=seed,
                status=status, accuracy=accuracy, **extra)


def test_groups_count_take_offs_against_the_baseline(tmp_path, capsys):
    runs = [_run("hybridzoo", s, a) for s, a in enumerate((0.001, 0.3, 0.002, 0.5))]
    runs += [_run("reference", s, a) for s, a in enumerate((0.4, 0.3, 0.2, 0.001))]
    runs += [_run("hybridzoo", s, 0.6, variant="+ssd-kernel") for s in range(3)]
    runs += [_run("hybridzoo", 9, 0.9, lr=0.003),                       # another learning rate
             _run("hybridzoo", 8, 0.9, status="failed"),                # not finished
             _run("hybridzoo", 7, 0.9, stopped="time limit")]           # cut: not counted
    (tmp_path / "runs").mkdir()
    for i, r in enumerate(runs[:6]):
        (tmp_path / "runs" / f"{i}.json").write_text(json.dumps(r))
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs[6:]}))
    loaded = takeoff.load_runs([tmp_path / "runs", tmp_path / "results.json"])
    assert len(loaded) == len(runs) - 2
    rows = {r["group"]: r for r in takeoff.take_off_rows(takeoff.groups_of(loaded, "mqar-mamba2-s", 0.01),
                                                          0.07, "hybridzoo")}
    assert set(rows) == {"hybridzoo", "reference", "hybridzoo+ssd-kernel"}
    assert (rows["hybridzoo"]["took_off"], rows["hybridzoo"]["runs"]) == (2, 4)
    assert (rows["reference"]["took_off"], rows["reference"]["runs"]) == (3, 4)
    assert rows["hybridzoo"]["median"] == pytest.approx((0.002 + 0.3) / 2)
    assert rows["hybridzoo"]["p_vs_baseline"] is None
    assert rows["hybridzoo+ssd-kernel"]["p_vs_baseline"] == pytest.approx(takeoff.fisher_exact(3, 3, 2, 4))
    assert takeoff.main([str(tmp_path / "runs"), str(tmp_path / "results.json"), "--lr", "0.01"]) == 0
    assert "| reference | 4 | 3 of 4 |" in capsys.readouterr().out
