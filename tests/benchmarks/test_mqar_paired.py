"""``python -m benchmarks mqar_paired``: hybridzoo and reference runs paired by recipe, rate, seed and variant."""

import json
import math

import pytest

from benchmarks import mqar_paired as paired


def test_sign_test_matches_binomial_tails_worked_by_hand():
    # 6 against 3: P(at most 3 of 9) = (1 + 9 + 36 + 84) / 512, doubled
    assert paired.sign_test(6, 3) == pytest.approx(2 * 130 / 512)
    assert paired.sign_test(3, 6) == paired.sign_test(6, 3)
    assert paired.sign_test(0, 6) == pytest.approx(2 / 64)
    assert paired.sign_test(5, 0) == pytest.approx(2 / 32)
    assert paired.sign_test(2, 2) == 1.0 and paired.sign_test(0, 0) == 1.0
    assert paired.sign_test(10, 3) == pytest.approx(2 * sum(math.comb(13, i) for i in range(4)) / 2 ** 13)
    with pytest.raises(ValueError):
        paired.sign_test(-1, 2)


def test_sign_test_agrees_with_scipy():
    stats = pytest.importorskip("scipy.stats")
    for higher, lower in ((6, 3), (0, 6), (10, 3), (7, 7), (1, 12)):
        expected = stats.binomtest(higher, higher + lower, 0.5).pvalue
        assert paired.sign_test(higher, lower) == pytest.approx(expected, rel=1e-9)


def _run(impl, seed, accuracy, lr=0.003, recipe="mqar-gla-s", variant="", status="ok", **extra):
    return dict(setting="gpu", recipe=recipe, variant=variant, impl=impl, lr=lr, seed=seed, status=status,
                accuracy=accuracy, **extra)


def test_runs_pair_by_recipe_rate_seed_and_variant(tmp_path, capsys):
    runs = [_run("hybridzoo", 0, 0.70), _run("reference", 0, 0.60),          # higher by 0.10
            _run("hybridzoo", 1, 0.20), _run("reference", 1, 0.50),          # lower by 0.30
            _run("hybridzoo", 2, 0.4005), _run("reference", 2, 0.4000),      # level within 0.001
            _run("hybridzoo", 0, 0.90, lr=0.01), _run("reference", 0, 0.10, lr=0.01),  # another rate: paired too
            _run("hybridzoo", 3, 0.9),                                        # no reference run: unpaired
            _run("hybridzoo", 4, 0.9), _run("hybridzoo", 4, 0.1), _run("reference", 4, 0.5),  # a rerun: left out
            _run("hybridzoo", 0, 0.5, variant="-fp32"), _run("reference", 0, 0.4, variant="-fp32"),  # its own row
            _run("hybridzoo", 0, 0.5, variant="+ssd-kernel"),                 # no reference of that variant
            _run("hybridzoo", 0, 0.3, recipe="mqar-gdn-s"), _run("reference", 0, 0.3, recipe="mqar-gdn-s"),
            _run("hybridzoo", 5, 0.9, status="failed"), _run("reference", 5, 0.1),  # unfinished: unpaired
            _run("hybridzoo", 6, 0.9, stopped="time limit"), _run("reference", 6, 0.1)]  # cut: unpaired
    runs += [dict(_run("hybridzoo", 7, 0.3), id="a", commit="c", steps=3000),
             dict(_run("reference", 7, 0.2), id="b", commit="c", steps=3000)]
    runs += runs[-2:]                                                         # the same two runs read twice
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs[:10]}))
    (tmp_path / "runs").mkdir()
    for i, r in enumerate(runs[10:]):
        (tmp_path / "runs" / f"{i}.json").write_text(json.dumps(r))
    loaded = paired.load_runs([tmp_path / "results.json", tmp_path / "runs"])
    pairs, reruns = paired.pairs_of(loaded)
    assert reruns == 1
    assert set(pairs) == {("mqar-gla-s", "gpu", ""), ("mqar-gla-s", "gpu", "-fp32"), ("mqar-gdn-s", "gpu", "")}
    gla = pairs[("mqar-gla-s", "gpu", "")]
    assert [(p["lr"], p["seed"]) for p in gla] == [(0.003, 0), (0.003, 1), (0.003, 2), (0.003, 7), (0.01, 0)]
    assert [p["difference"] for p in gla] == pytest.approx([0.10, -0.30, 0.0005, 0.10, 0.80])
    rows = {(r["recipe"], r["variant"]): r for r in paired.summary_rows(pairs, tol=0.001)}
    g = rows[("mqar-gla-s", "")]
    assert (g["pairs"], g["higher"], g["lower"], g["level"]) == (5, 3, 1, 1)
    assert g["mean_difference"] == pytest.approx((0.10 - 0.30 + 0.0005 + 0.10 + 0.80) / 5)
    assert g["median_difference"] == pytest.approx(0.10)
    assert g["sign_p"] == pytest.approx(paired.sign_test(3, 1)) and g["learning_rates"] == [0.003, 0.01]
    assert (rows[("mqar-gla-s", "-fp32")]["higher"], rows[("mqar-gdn-s", "")]["level"]) == (1, 1)
    only = paired.pairs_of(loaded, recipes=["mqar-gla-s"], lr=0.01)[0]
    assert list(only) == [("mqar-gla-s", "gpu", "")] and len(only[("mqar-gla-s", "gpu", "")]) == 1
    out = tmp_path / "rows.json"
    assert paired.main([str(tmp_path / "results.json"), str(tmp_path / "runs"), "--recipe", "mqar-gla-s",
                        "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| mqar-gla-s | gpu | 5 | 3 | 1 | 1 | +0.140 |" in text and "| mqar-gla-s -fp32 | gpu | 1 | 1 |" in text
    assert "1 cell(s) with a seed run more than once" in text
    assert json.loads(out.read_text())["rows"][0]["pairs"] == 5


def test_nothing_to_pair_fails_clearly(tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps({"runs": [_run("hybridzoo", 0, 0.5)]}))
    assert paired.main([str(tmp_path / "results.json")]) == 1
    assert "no seed has a finished run of both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        paired.main([str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit):
        paired.main([str(tmp_path / "results.json"), "--tol", "-1"])


def test_take_off_pairs_and_a_pooled_row(tmp_path, capsys):
    """``--take-off``: the pairs where only one side reaches the threshold, McNemar's exact p on
    them (the sign test of those counts: 1 against 3 is 0.625, worked by hand as
    2 * (1 + 4) / 16); ``--pool``: a row over every pair of the rows shown."""
    runs = [_run("hybridzoo", 0, 0.50), _run("reference", 0, 0.01),          # only hybridzoo takes off
            _run("hybridzoo", 1, 0.01), _run("reference", 1, 0.40),          # only the reference
            _run("hybridzoo", 2, 0.30), _run("reference", 2, 0.60),          # both: concordant
            _run("hybridzoo", 3, 0.02), _run("reference", 3, 0.01),          # neither
            _run("hybridzoo", 0, 0.01, variant="-fp32"), _run("reference", 0, 0.20, variant="-fp32"),
            _run("hybridzoo", 1, 0.07, variant="-fp32"), _run("reference", 1, 0.06, variant="-fp32"),  # at T: takes off
            _run("hybridzoo", 0, 0.01, recipe="mqar-gla-l"), _run("reference", 0, 0.90, recipe="mqar-gla-l")]
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs}))
    pairs, _ = paired.pairs_of(paired.load_runs([tmp_path / "results.json"]))
    rows = {(r["recipe"], r["variant"]): r for r in paired.summary_rows(pairs, 0.001, take_off=0.07, pool=True)}
    assert (rows[("mqar-gla-s", "")]["only_hybridzoo"], rows[("mqar-gla-s", "")]["only_reference"]) == (1, 1)
    assert (rows[("mqar-gla-s", "-fp32")]["only_hybridzoo"], rows[("mqar-gla-s", "-fp32")]["only_reference"]) == (1, 1)
    pooled = rows[("all", "")]
    assert (pooled["pairs"], pooled["only_hybridzoo"], pooled["only_reference"]) == (7, 2, 3)
    assert pooled["mcnemar_p"] == pytest.approx(1.0)
    assert paired.sign_test(1, 3) == pytest.approx(2 * (1 + 4) / 16)
    assert "take_off" not in paired.summary_rows(pairs, 0.001)[0]  # without --take-off: no such columns
    assert paired.main([str(tmp_path / "results.json"), "--recipe", "mqar-gla-l,mqar-gla-s", "--take-off", "0.07",
                        "--pool"]) == 0
    text = capsys.readouterr().out
    assert "| only hybridzoo takes off (>= 0.07) | only the reference | McNemar p |" in text
    assert "| all |  | 7 |" in text and text.strip().splitlines()[-1].endswith("| 2 | 3 | 1.000 |")
    with pytest.raises(SystemExit):
        paired.main([str(tmp_path / "results.json"), "--take-off", "0"])
