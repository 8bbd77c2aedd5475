import math

import pandas as pd
import pytest

from pipeline.results import TRIAL_COLUMNS, head_ratios, read_trials, summarize_trials, write_trials
from rcnn.data import DataError


def table() -> pd.DataFrame:
    rows = []
    for bs, scale in ((1, 1.0), (2, 2.0)):
        for head, head_bwd, bwd in (("linear", 10, 100), ("conv", 40, 130), ("conv_as_linear", 11, 101)):
            rows.append({"trial": len(rows), "status": "complete", "head": head, "cudnn_benchmark": "n/a",
                         "amp": "off", "channels_last": False, "batch_size": bs,
                         "head_backward_ms": head_bwd * scale, "backward_ms": bwd * scale,
                         "step_ms": bwd * scale * 2})
    rows.append({"trial": len(rows), "status": "failed", "head": "conv", "cudnn_benchmark": "n/a", "amp": "off",
                 "channels_last": True, "batch_size": 1, "error": "RuntimeError: boom"})
    return pd.DataFrame(rows).reindex(columns=TRIAL_COLUMNS)


def test_ratios_per_setting_and_headline():
    ratios = head_ratios(table())
    assert len(ratios) == 2  # the failed trial's setting has no complete head
    assert ratios["conv_over_linear_head_backward"].tolist() == [4.0, 4.0]
    assert ratios["conv_over_linear_backward"].tolist() == [1.3, 1.3]
    summary = summarize_trials(table())
    assert summary["trials"] == 7 and summary["complete"] == 6 and summary["failed"] == 1
    assert summary["conv_as_linear_over_linear_head_backward"] == 1.1
    assert summary["best"] == {"head": "linear", "cudnn_benchmark": "n/a", "amp": "off", "channels_last": False,
                               "batch_size": 1, "step_ms": 200.0}


def test_missing_head_gives_nan_not_an_error():
    only = table().query("head != 'linear'")
    assert math.isnan(head_ratios(only)["conv_over_linear_head_backward"].iloc[0])
    assert summarize_trials(only)["conv_over_linear_head_backward"] is None


def test_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "trials.csv"
    write_trials(table(), path)
    back = read_trials(path)
    assert list(back.columns) == list(TRIAL_COLUMNS) and back["cudnn_benchmark"].eq("n/a").all()
    path.write_text("trial,status\n0,complete\n")
    with pytest.raises(DataError, match="trials.csv: missing columns device"):
        read_trials(path)
    with pytest.raises(DataError, match="run the sweep stage first"):
        read_trials(tmp_path / "none.csv")
