"""The library's vocabulary loads without torch, and so do the stages that only read result files."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize(
    "modules",
    [
        "rcnn.trial.schema, rcnn.detector.schema, rcnn.measure.settings, rcnn.measure.stats, "
        "rcnn.doctor.columns, rcnn.rules, pipeline.params",
        # pandas and matplotlib's import: seconds
        pytest.param("pipeline.report, pipeline.compare", marks=pytest.mark.slow),
    ],
)
def test_imports_no_torch(modules):
    check = f"import {modules}, sys; assert 'torch' not in sys.modules and 'torchvision' not in sys.modules"
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
