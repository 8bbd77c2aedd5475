"""A real COCO folder's everyday quirks, through the data stage and a sweep: every trial completes."""

import pytest

from pipeline import sweep
from pipeline.results import read_trials
from rcnn.detector.data import describe_dropped
from tests.coco import QUIRKY_DROPPED, QUIRKY_KEPT, write_quirky_coco
from tests.pipeline.helpers import prepare


@pytest.mark.slow
def test_quirky_coco_folder_trains_in_every_trial(tmp_path, tiny_params, capsys):
    source = write_quirky_coco(tmp_path / "coco")
    args = prepare(
        tmp_path,
        tiny_params,
        {
            "data": {"source": str(source), "num_images": len(QUIRKY_KEPT)},
            "sweep": {"profile_steps": 0, "cross_check": False},
        },
    )
    lines = capsys.readouterr().out.splitlines()
    wrote = next(i for i, line in enumerate(lines) if line.startswith("wrote "))
    assert lines[wrote].startswith(f"wrote {len(QUIRKY_KEPT)} images, {len(QUIRKY_KEPT)} boxes, 3 classes")
    assert lines[wrote + 1] == f"dropped: {describe_dropped(QUIRKY_DROPPED)}"
    assert "2 crowd regions" in lines[wrote + 1]  # worded for a person, not a dict

    assert sweep.main(args) == 0
    trials = read_trials(tmp_path / "trials.csv")
    assert len(trials) == 2 and (trials["status"] == "complete").all(), trials.get("error")
