"""What every stage shares: one-line errors for bad arguments, the user's mistakes and Ctrl-C; a traceback for
anything else."""

import subprocess
import sys

import pytest

from pipeline import data, sweep
from pipeline.common import Interrupted, run_stage, stage_parser
from pipeline.params import ParamsError, keyed
from rcnn.outputs import NotWritable
from rcnn.rules import ValueNotAllowed
from rcnn.trial.schema import ResultsError
from tests.conftest import ROOT


@pytest.mark.parametrize(
    "main, argv, line",
    [
        (data.main, [], "error: the following arguments are required: --out"),
        (data.main, ["--out", "x", "--nope"], "error: unrecognized arguments: --nope"),
        (
            sweep.main,
            ["--data", "d", "--env", "e", "--trials", "t"],
            "error: the following arguments are required: --comparisons, --kernels, --modules, --summary",
        ),
        (
            sweep.main,
            ["--data", "d", "--env", "e", "--join", "--wait-s", "soon"],
            "error: --wait-s: invalid float value: 'soon'",
        ),
    ],
)
def test_a_bad_stage_argument_is_one_line(capsys, main, argv, line):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize(
    "interrupt, line",
    [
        (KeyboardInterrupt(), "interrupted"),
        (Interrupted("interrupted: 3 of 8 trials complete"), "interrupted: 3 of 8 trials complete"),
    ],
)
def test_ctrl_c_in_a_stage_is_one_line_and_exit_130(capsys, tiny_params, interrupt, line):
    def stage(args, params):
        raise interrupt

    assert run_stage(stage, stage_parser(None), ["--params", str(tiny_params())]) == 130
    assert capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize(
    "error",
    [
        ParamsError("sweep.workers: 0 is too small; allowed: >= 1"),
        ResultsError("results/trials.csv: missing; run the sweep stage first"),
        NotWritable("results/x.csv: cannot write there (Permission denied)"),
    ],
)
def test_a_users_mistake_is_one_line_and_exit_2(capsys, tiny_params, error):
    def stage(args, params):
        raise error

    assert run_stage(stage, stage_parser(None), ["--params", str(tiny_params())]) == 2
    assert capsys.readouterr().err == f"error: {error}\n"


@pytest.mark.slow
def test_our_own_bug_keeps_its_traceback(tiny_params):
    """A ValueError or OSError from pandas, torch or this code is not the user's mistake: no one-line
    error."""
    params = str(tiny_params())
    script = (
        "from pipeline.common import run_stage, stage_parser\n"
        "def stage(args, params):\n    raise ValueError('a bug deep inside')\n"
        f"raise SystemExit(run_stage(stage, stage_parser(None), ['--params', {params!r}]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert (
        "Traceback (most recent call last)" in done.stderr and "ValueError: a bug deep inside" in done.stderr
    )


def test_the_library_key_is_named_as_params_yaml_names_it():
    with pytest.raises(ParamsError, match=r"^sweep\.space\.amp: no value applies"), keyed("sweep.space."):
        raise ValueNotAllowed("amp", "no value applies on cpu (bf16: this CPU has no native bf16)")
