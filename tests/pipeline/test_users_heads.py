"""A user's own box head in the sweep: the question's two heads, verbatim, by package.module:factory."""

import json
import shutil

import pandas as pd
import pytest

from pipeline import sweep, sweep_setup
from pipeline.params import load_params
from pipeline.results import read_trials
from tests.conftest import ROOT
from tests.pipeline.helpers import SWEEP_FILES, prepare

QUESTION = {"linear": "tests.fixtures.question_heads:linear", "conv": "tests.fixtures.question_heads:conv"}


@pytest.mark.slow
def test_the_questions_heads_through_a_tiny_sweep(tmp_path, tiny_params):
    args = prepare(
        tmp_path, tiny_params, {"sweep": {"space": {"head": [QUESTION["linear"], QUESTION["conv"]]}}}
    )
    assert sweep.main(args) == 0
    trials = read_trials(tmp_path / SWEEP_FILES["trials"])
    assert sorted(trials["head"]) == sorted(QUESTION.values()) and trials["status"].eq("complete").all()
    assert (trials["head_backward_gflop"] > 0).all()  # the head's FLOPs are counted through the factory too
    comparisons = pd.read_csv(tmp_path / SWEEP_FILES["comparisons"])
    # linear was not swept: heads are compared with the sweep's first head, the question's FastRCNNHead.
    assert set(zip(comparisons["numerator"], comparisons["denominator"])) == {
        (QUESTION["conv"], QUESTION["linear"])
    }
    # ... the users' conv head's trial stepped a twin with that first head: paired ratios per setting
    assert (comparisons.query("amp != 'all'")["rounds"] > 0).all()
    paired = trials.set_index("head")["wall_paired_s"]
    assert paired[QUESTION["conv"]] > 0 and paired[QUESTION["linear"]] == 0
    summary = json.loads((tmp_path / SWEEP_FILES["summary"]).read_text())
    ratio = summary[
        "tests.fixtures.question_heads.conv_over_tests.fixtures.question_heads.linear_head_backward"
    ]
    assert ratio == pytest.approx(
        comparisons.query("phase == 'head_backward' and amp == 'all'")["ratio"].iloc[0], abs=1e-3
    )
    modules = pd.read_csv(tmp_path / SWEEP_FILES["modules"], keep_default_na=False).set_index(
        ["head", "module"]
    )
    # FastRCNNHeadConv's 7x7 conv is found where the question put it, and flagged.
    flag = modules.loc[(QUESTION["conv"], "roi_heads.box_head.feature_head.0"), "flag"]
    assert flag.startswith("gemm-in-disguise:covers-input")
    linear_head = modules.loc[QUESTION["linear"]].filter(like="roi_heads.box_head", axis=0)
    assert len(linear_head) and "gemm-in-disguise" not in "".join(linear_head["flag"])


def test_a_change_to_a_users_head_renames_the_study(tmp_path, tiny_params, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "myheads.py").write_text("from tests.fixtures.question_heads import conv\n")
    params = load_params(tiny_params())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "annotations.json").write_text("{}")
    name = lambda: sweep_setup.study_name(params, {"head": ["myheads:conv"]}, {}, tmp_path / "data")  # noqa: E731
    before = name()
    assert name() == before
    (tmp_path / "myheads.py").write_text("from tests.fixtures.question_heads import conv  # tuned\n")
    assert name() != before


def test_an_edit_anywhere_in_the_library_renames_the_study(tmp_path, tiny_params, monkeypatch):
    library = tmp_path / "rcnn"
    shutil.copytree(ROOT / "rcnn", library, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(sweep_setup, "LIBRARY", library)
    params = load_params(tiny_params())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "annotations.json").write_text("{}")
    name = lambda: sweep_setup.study_name(params, {"head": ["conv"]}, {}, tmp_path / "data")  # noqa: E731
    before = name()
    clock = library / "measure" / "clock.py"
    clock.write_text(clock.read_text() + "# tuned\n")
    edited = name()
    assert edited != before
    clock.rename(library / "measure" / "timer.py")  # the same code under another name: another library
    assert name() not in (before, edited)


@pytest.mark.slow  # runs the data and env stages first: seconds
def test_a_users_head_that_cannot_be_imported_is_one_line(tmp_path, tiny_params, capsys):
    args = prepare(tmp_path, tiny_params, {"sweep": {"space": {"head": ["linear", "no_such_heads:conv"]}}})
    assert sweep.main(args) == 2
    assert capsys.readouterr().err.startswith("error: sweep.space.head: cannot import 'no_such_heads'")


@pytest.mark.slow
def test_the_linearize_knob_measures_a_head_with_and_without_the_fix(tmp_path, tiny_params):
    args = prepare(
        tmp_path,
        tiny_params,
        {"sweep": {"space": {"head": ["conv", QUESTION["conv"]], "linearize": [False, True]}}},
    )
    assert sweep.main(args) == 0
    trials = read_trials(tmp_path / SWEEP_FILES["trials"]).set_index(["head", "linearize"])
    assert len(trials) == 4 and trials["status"].eq("complete").all()
    assert (trials.xs(False, level="linearize")["swapped"].fillna("") == "").all()
    for head in ("conv", QUESTION["conv"]):  # the built-in conv head and the user's, alike
        swapped = trials.loc[(head, True), "swapped"]
        # mode auto: those of the eligible convolutions where the GEMM was shown faster (95% CI) at this size
        assert pd.isna(swapped) or all(
            name.startswith(("roi_heads.", "backbone.", "rpn.")) for name in swapped.split()
        )
    comparisons = pd.read_csv(tmp_path / SWEEP_FILES["comparisons"])
    assert set(comparisons["linearize"].astype(str)) == {"False", "True", "all"}
