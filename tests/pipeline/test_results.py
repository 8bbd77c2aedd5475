import pytest

from pipeline.results import (ALL_SETTINGS, TRIAL_COLUMNS, comparisons_table, geomean_ratio, read_trials,
                              summarize_trials, write_trials)
from rcnn.data import DataError
from tests.conftest import fake_trials as fixture

def test_comparisons_per_setting_and_pooled():
    trials, samples = fixture()
    table = comparisons_table(trials, samples)
    per_setting = table[table["settings"] == 1]
    conv = per_setting[(per_setting["numerator"] == "conv") & (per_setting["phase"] == "head_backward")]
    assert len(conv) == 2  # the failed trial's setting has no complete pair
    assert conv["ratio"].tolist() == pytest.approx([4.0, 4.0], rel=0.02)
    assert (conv["ci_low"] < conv["ratio"]).all() and (conv["ratio"] < conv["ci_high"]).all()
    assert (conv["p_value"] < 1e-4).all()
    pooled = table[(table["batch_size"] == ALL_SETTINGS) & (table["numerator"] == "conv_as_linear")
                   & (table["phase"] == "backward")]
    assert pooled["ratio"].iloc[0] == pytest.approx(1.01, rel=0.01) and pooled["settings"].iloc[0] == 2

    summary = summarize_trials(trials, table)
    assert summary["trials"] == 7 and summary["complete"] == 6 and summary["failed"] == 1 and summary["not_run"] == 0
    assert summary["conv_over_linear_head_backward"] == pytest.approx(4.0, rel=0.02)
    assert summary["conv_over_linear_head_backward_ci_low"] < 4.0 < summary["conv_over_linear_head_backward_ci_high"]
    assert summary["best"] == {"head": "linear", "cudnn_benchmark": "n/a", "onednn": True, "amp": "off",
                               "channels_last": False, "batch_size": 1, "step_ms": pytest.approx(200, rel=0.02)}


def test_geomean_of_known_ratios():
    ratio, low, high = geomean_ratio([([2.0] * 9, [1.0] * 9), ([8.0] * 9, [1.0] * 9)])
    assert ratio == pytest.approx(4.0) and low == pytest.approx(4.0) and high == pytest.approx(4.0)


def test_missing_head_gives_no_ratio_not_an_error():
    trials, samples = fixture()
    only = trials.query("head != 'linear'")
    table = comparisons_table(only, samples)
    assert table.empty
    assert summarize_trials(only, table)["conv_over_linear_head_backward"] is None


def test_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "trials.csv"
    write_trials(fixture()[0], path)
    back = read_trials(path)
    assert list(back.columns) == list(TRIAL_COLUMNS) and back["cudnn_benchmark"].eq("n/a").all()
    path.write_text("trial,status\n0,complete\n")
    with pytest.raises(DataError, match="trials.csv: missing columns device"):
        read_trials(path)
    with pytest.raises(DataError, match="run the sweep stage first"):
        read_trials(tmp_path / "none.csv")
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DataError, match="trials.csv"):
        read_trials(path)
