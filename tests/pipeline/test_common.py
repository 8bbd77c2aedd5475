"""What every stage shares: one-line errors for bad arguments and for Ctrl-C."""
import pytest

from pipeline import data, sweep
from pipeline.common import Interrupted, run_stage, stage_parser


@pytest.mark.parametrize("main, argv, line", [
    (data.main, [], "error: the following arguments are required: --out"),
    (data.main, ["--out", "x", "--nope"], "error: unrecognized arguments: --nope"),
    (sweep.main, ["--data", "d", "--env", "e", "--trials", "t"],
     "error: the following arguments are required: --comparisons, --kernels, --summary"),
    (sweep.main, ["--data", "d", "--env", "e", "--join", "--wait-s", "soon"],
     "error: --wait-s: invalid float value: 'soon'"),
])
def test_a_bad_stage_argument_is_one_line(capsys, main, argv, line):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize("interrupt, line", [(KeyboardInterrupt(), "interrupted"),
                                             (Interrupted("interrupted: 3 of 8 trials complete"),
                                              "interrupted: 3 of 8 trials complete")])
def test_ctrl_c_in_a_stage_is_one_line_and_exit_130(capsys, tiny_params, interrupt, line):
    def stage(args, params):
        raise interrupt

    assert run_stage(stage, stage_parser(None), ["--params", str(tiny_params())]) == 130
    assert capsys.readouterr().err == line + "\n"
