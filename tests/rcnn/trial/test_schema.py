"""Each knob is declared once (rcnn.trial.schema.KNOBS): params.yaml, the bench's flags, the grid, the
tables, the knob effects' baseline and the report's labels all follow the declaration."""

import re
import shutil
import sys

import pytest

from rcnn.trial.schema import KNOB, KNOBS, TRIAL_COLUMNS, setting_label
from tests import launcher
from tests.conftest import ROOT

DUMMY = (
    'Knob("dummy", (False, True), "a knob that changes nothing", baseline=False, flag="--dummy", '
    'label=lambda v: "dummy" if v else "")'
)

CHECK = """
import torch
from pipeline.analysis import DEFAULTS
from pipeline.params import ProfileAt, SpaceParams, parse_params
from rcnn.trial.knobs import Knobs, applicable_space, knobs_for
from rcnn.trial.schema import TRIAL_COLUMNS, setting_label
from rcnn.bench import _parser

params = parse_params({"sweep": {"space": {"dummy": [True]}, "profile_at": [{"dummy": True}]}})
assert SpaceParams().dummy == (False, True) and params.sweep.space.dummy == (True,)
assert params.sweep.profile_at == (ProfileAt(dummy=True),)
grid, skipped = applicable_space(params.sweep.space.as_dict(), torch.device("cpu"))
assert grid["dummy"] == [True], grid
assert _parser().parse_args(["--dummy"]).dummy is True and _parser().parse_args([]).dummy is False
assert knobs_for(torch.device("cpu"), dummy=True) == Knobs(dummy=True, onednn=True)
assert "dummy" in TRIAL_COLUMNS and DEFAULTS["dummy"] is False
assert setting_label({"amp": "off", "dummy": "True"}) == "amp off, dummy", setting_label({"dummy": "True"})
print("ok")
"""


@pytest.mark.slow  # in a subprocess, on a copy of the library
def test_a_knob_declared_in_one_place_reaches_params_the_flags_and_the_grid(tmp_path):
    for folder in ("rcnn", "pipeline"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    schema = tmp_path / "rcnn" / "trial" / "schema.py"
    text = schema.read_text()
    assert text.count("\n)\nKNOB = ") == 1
    schema.write_text(text.replace("\n)\nKNOB = ", f"\n    {DUMMY},\n)\nKNOB = "))
    done = launcher.run([sys.executable, "-c", CHECK], cwd=tmp_path, timeout=300)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr[-3000:]


def test_the_declarations_are_consistent():
    for knob in KNOBS:
        assert knob.flag.startswith("--") and knob.help
        assert all(type(v) is knob.kind for v in knob.space)
        if knob.rule is not None:
            assert all(knob.rule.problem(v) is None for v in knob.space)
        if knob.device:
            assert knob.kind is bool and knob.backend and knob.baseline is not None
    assert TRIAL_COLUMNS[7 : 7 + len(KNOBS)] == tuple(KNOB)  # the setup columns, then the knobs in order


def test_every_knobs_help_reads_in_the_bench_commands_help_as_written():
    from rcnn.bench import _parser

    shown = " ".join(_parser().format_help().split())  # argparse wraps lines and formats %
    assert "option_strings" not in shown  # a bare % in a help text prints the option's whole dict
    assert "(default: None)" not in shown and not re.search(r"\(default:? [^)]*\) \(default", shown)  # once
    for knob in KNOBS:
        assert " ".join(knob.help.split()) in shown, knob.name


def test_a_setting_label_says_each_applicable_knob():
    setting = {
        "cudnn_benchmark": "n/a",
        "onednn": "False",
        "amp": "bf16",
        "channels_last": "True",
        "batch_size": "2",
        "linearize": "True",
        "tf32": "n/a",
        "compile": "head",
    }
    assert setting_label(setting) == "oneDNN off, amp bf16, NHWC, bs 2, linearized, compiled head"
    assert setting_label(setting, skip=("batch_size", "compile")) == "oneDNN off, amp bf16, NHWC, linearized"
    cuda = {
        **setting,
        "cudnn_benchmark": True,
        "onednn": None,
        "tf32": False,
        "linearize": False,
        "compile": "off",
    }
    assert setting_label(cuda) == "bench on, amp bf16, NHWC, bs 2, TF32 off"


def test_the_repo_params_sweep_the_declared_space():
    """The full grid's preset states the declarations' defaults, not a second set; params.yaml (make repro)
    narrows oneDNN and the batch size alone."""
    from dataclasses import replace

    from pipeline.params import SpaceParams, load_params

    assert load_params(ROOT / "presets" / "full-cpu.yaml").sweep.space == SpaceParams()
    narrowed = replace(SpaceParams(), onednn=(True,), batch_size=(2,))
    assert load_params(ROOT / "params.yaml").sweep.space == narrowed
