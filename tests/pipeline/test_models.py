"""The sweep for a model a spec names (params.yaml ``model:``): env -> data -> sweep -> report, its MLflow
experiment and its report folder; the user's factory module as what the sweep depends on; batch size auto."""

import html
import json
import sys

import mlflow
import numpy as np
import pandas as pd
import pytest
import yaml

from pipeline import compare, env, model_report, report, sweep
from pipeline.env import model_code
from pipeline.params import SpaceParams, parse_params
from pipeline.results import at_defaults, fastest_and_defaults, read_trials, trial_row, versus_defaults
from rcnn.doctor.specs import spec_slug
from rcnn.measure.batch import batches_below
from rcnn.trial.schema import MEASURED_COLUMNS
from tests.conftest import ROOT, TINY_PARAMS
from tests.fixtures.models import HUNGRY, hungry_limit
from tests.pipeline.helpers import SWEEP_FILES, prepare

FACTORY = "tests.fixtures.models:pooled"
# A model's params: the spec, the head knob at its default (it is the detector's only), tiny timing.
HEADS = list(SpaceParams().head)


def model_params(spec: str, space: dict | None = None, **sweep_keys) -> dict:
    return {
        "model": {"spec": spec, "image_size": 32},
        "sweep": {
            "profile_steps": 1,
            "cross_check": False,
            "space": {"head": HEADS, "channels_last": [False, True], **(space or {})},
            **sweep_keys,
        },
        "timing": {"warmup": 1, "max_warmup": 2, "iterations": 3, "max_iterations": 4, "max_seconds": 5},
    }


def with_model(tiny_params, model):
    """tiny_params whose written params.yaml has ``model`` in place of the tiny detector's mapping."""

    def write(override=None):
        path = tiny_params({k: v for k, v in (override or {}).items() if k != "model"})
        raw = yaml.safe_load(path.read_text())
        raw["model"] = (override or {}).get("model", model)
        path.write_text(yaml.safe_dump(raw))
        return path

    return write


def report_args(tmp_path):
    files = [a for k in ("trials", "comparisons", "kernels", "modules", "summary", "env")
             for a in (f"--{k}", str(tmp_path / SWEEP_FILES[k]))]  # fmt: skip
    return files + ["--out", str(tmp_path / "reports"), "--mlflow"]


@pytest.mark.slow  # four trials, the two fastest stepped in turn, a report
def test_a_factory_model_is_swept_and_reported_in_its_own_folder_and_experiment(
    tmp_path, tiny_params, monkeypatch
):
    params = model_params(FACTORY, {"compile": ["off", "head"]})
    args = prepare(tmp_path, with_model(tiny_params, FACTORY), params)
    assert sweep.main(args) == 0

    trials = read_trials(tmp_path / SWEEP_FILES["trials"])
    assert len(trials) == 2 and trials["status"].eq("complete").all()
    assert trials["model"].eq(FACTORY).all() and trials["head"].eq("n/a").all()
    assert trials["backbone"].eq("n/a").all() and trials["image_size"].eq(32).all()
    assert trials["head_backward_ms"].isna().all() and (trials["backward_ms"] > 0).all()
    summary = json.loads((tmp_path / SWEEP_FILES["summary"]).read_text())
    assert summary["model"] == FACTORY
    # Knob compile's box-head target is left out with its reason; the head is no knob here.
    assert not any(s["knob"] == "head" for s in summary["skipped"])
    against = summary["versus_defaults"]
    if against is not None:  # NHWC was the faster: the two stepped in turn, per sample
        assert against["rounds"] >= 3 and against["ci_low"] <= against["speedup"] <= against["ci_high"]
        assert against["fastest"]["channels_last"] is True and against["defaults"]["channels_last"] is False

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=[spec_slug(FACTORY)])
    assert (runs["tags.model"] == FACTORY).all()
    children = runs[runs["tags.mlflow.parentRunId"].notna()]
    assert set(trials["mlflow_run_id"]) <= set(children["run_id"])
    assert (against is not None) == ("fastest-vs-defaults" in set(children["tags.mlflow.runName"]))

    assert report.main(["--params", args[1], *report_args(tmp_path)]) == 0
    folder = tmp_path / "reports" / spec_slug(FACTORY)
    text = (folder / "report.md").read_text()
    assert text.startswith(f"# Which knob setting trains `{FACTORY}` fastest")
    assert "**Fastest per sample:" in text and "## Knob effects" in text and "channels_last" in text
    assert "compile=head: compiles the detector's box head" in text
    # The by-module tables: the profiled defaults, and where NHWC was the faster, it too, side by side
    defaults = "At oneDNN on, amp off, NCHW, bs 2" + (" (PyTorch's defaults)" if against else "")
    assert f"{defaults}: the top 8 modules" in text
    assert (against is not None) == ("At oneDNN on, amp off, NHWC, bs 2 (the fastest per sample)" in text)
    assert (against is not None) == ("defaults ms/sample" in text)
    assert (folder / "report.html").exists() and (folder / "figures" / "per_sample.png").exists()
    page = (folder / "modules.html").read_text()  # an icicle per profiled setting, the whole model
    assert page.count("<h2>") == 1 + (against is not None)
    assert (html.escape("(PyTorch's defaults)") in page) == (against is not None)
    assert not (tmp_path / "reports" / "report.md").exists()  # the detector's report is not written

    # Across models: this model's tables beside the detector's reference ones.
    monkeypatch.chdir(tmp_path)  # the project: compare writes inside it
    assert compare.main([str(folder / "tables"), str(ROOT / "reports" / "tables"), "--out", "compare"]) == 0
    text = (tmp_path / "compare" / "compare.md").read_text()
    model_row = next(line for line in text.splitlines() if line.startswith("| model "))
    assert FACTORY in model_row and "detector" in model_row
    speedup_row = next(line for line in text.splitlines() if "PyTorch's defaults, per sample" in line)
    assert (against is None) == (speedup_row.count("n/a") == 2)


@pytest.mark.slow  # timm's resnet18 at 32 px: two trials, a report
def test_a_timm_model_goes_through_env_data_sweep_and_report(tmp_path, tiny_params):
    spec = "timm:resnet18"
    args = prepare(tmp_path, with_model(tiny_params, None), model_params(spec))
    env_json = json.loads((tmp_path / SWEEP_FILES["env"]).read_text())
    assert env_json["model_code"].startswith("timm ")  # the sweep reruns on a timm upgrade
    assert sweep.main(args) == 0
    trials = read_trials(tmp_path / SWEEP_FILES["trials"])
    assert trials["model"].eq(spec).all() and trials["status"].eq("complete").all() and len(trials) == 2
    assert report.main(["--params", args[1], *report_args(tmp_path)]) == 0
    text = (tmp_path / "reports" / "timm-resnet18" / "report.md").read_text()
    assert text.startswith("# Which knob setting trains `timm:resnet18` fastest") and "conv1" in text


def test_the_factory_module_is_what_the_sweep_depends_on(tmp_path, monkeypatch):
    """env.json's model_code (a params key of the sweep stage in dvc.yaml) changes with the factory's code."""
    package = tmp_path / "usermodels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = package / "net.py"
    source.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(3, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = model_code(parse_params({"model": "usermodels.net:build"}).model)
    assert first.startswith("sha256:")
    source.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(3, 4)\n")
    sys.modules.pop("usermodels.net", None)
    assert model_code(parse_params({"model": "usermodels.net:build"}).model) != first
    assert model_code(parse_params({}).model) == ""  # the detector: this repository's code only
    assert model_code(parse_params({"model": "timm:resnet18"}).model).startswith("timm ")
    sweep_stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["sweep"]
    assert {"results/env.json": ["fingerprint", "model_code"]} in sweep_stage["params"]


@pytest.mark.slow  # a sweep, then the typo
def test_a_spec_typo_is_one_line_and_loses_nothing_measured(tmp_path, tiny_params, capsys):
    args = prepare(tmp_path, with_model(tiny_params, None), model_params(FACTORY))
    assert sweep.main(args) == 0
    measured = {p: p.read_bytes() for p in (tmp_path / "optuna.journal", tmp_path / SWEEP_FILES["trials"])}
    capsys.readouterr()
    raw = yaml.safe_load((tmp_path / "params.yaml").read_text()) | {
        "model": {"spec": "timm:resnet1B", "image_size": 32}
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    assert sweep.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.spec: ") and "resnet18" in err[0]
    assert {p: p.read_bytes() for p in measured} == measured


@pytest.mark.slow  # the batch search builds and steps the model at each size tried
def test_batch_size_auto_sweeps_the_largest_that_fits_and_those_below(tmp_path, tiny_params):
    limit = hungry_limit(5.5)  # measured in this process, where the sweep stage runs below
    params = model_params(HUNGRY, {"batch_size": "auto", "channels_last": [False]}, memory_limit_mb=limit)
    params["model"] = {"spec": HUNGRY, "image_size": 16}
    # Its steps page in hundreds of MiB each: as few as the trials allow (what is asserted is which ran).
    params["timing"] |= {"max_warmup": 1, "iterations": 2, "max_iterations": 2}
    args = prepare(tmp_path, with_model(tiny_params, None), params)
    assert sweep.main(args) == 0
    said = json.loads((tmp_path / SWEEP_FILES["summary"]).read_text())["batch_search"]
    largest = int(said.split("the largest that fits is ")[1].split(" ")[0])
    assert 4 <= largest <= 6  # 5 where the stage's resident set is this process's when measured
    assert "does not (peak" in said and f"over the limit of {limit:.0f} MiB" in said
    trials = read_trials(tmp_path / SWEEP_FILES["trials"])
    assert sorted(trials["batch_size"]) == batches_below(largest)


def test_bad_model_params_are_one_line(tmp_path, tiny_params, capsys):
    cases = {
        "model.spec: 'resnet18' is not allowed; allowed: a model spec": {"model": "resnet18"},
        "model.backbone: applies to this project's detector only": {
            "model": {"spec": FACTORY, "backbone": "resnet50_fpn"}
        },
        "sweep.space.head: the box head is a knob of this project's detector only": {
            "model": FACTORY, "sweep": {"space": {"head": ["conv"]}}
        },
        "sweep.space.batch_size: auto finds the batch sizes of a spec's model": {
            "model": TINY_PARAMS["model"], "sweep": {"space": {"batch_size": "auto"}}
        },
        "sweep.memory_limit_mb: applies only with sweep.space.batch_size: auto": {
            "model": FACTORY, "sweep": {"memory_limit_mb": 100}
        },
        "sweep.space.batch_size: 'big' is not allowed; allowed: a list of batch sizes": {
            "model": FACTORY, "sweep": {"space": {"batch_size": "big"}}
        },
        "model.image_size: 8 is too small; allowed: >= 16": {"model": {"spec": FACTORY, "image_size": 8}},
    }  # fmt: skip
    for expected, override in cases.items():
        params = with_model(tiny_params, None)(override)
        assert env.main(["--params", str(params), "--out", str(tmp_path / "env.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], (expected, err)
    assert not (tmp_path / "env.json").exists()


def model_trials(step_ms: dict[tuple[bool, int], float]) -> pd.DataFrame:
    """A model's trials table: one complete trial per (channels_last, batch size), with its step median."""
    rows = [
        trial_row(
            dict.fromkeys(MEASURED_COLUMNS, float("nan")) | {"step_ms": ms},
            trial=number,
            status="complete",
            device="cpu",
            model=FACTORY,
            backbone="n/a",
            image_size=32,
            rois_per_image=float("nan"),
            head="n/a",
            cudnn_benchmark="n/a",
            onednn=True,
            amp="off",
            channels_last=layout,
            batch_size=size,
            linearize=False,
            tf32="n/a",
            compile="off",
            mlflow_run_id=None,
            worker=None,
            error=None,
        )  # fmt: skip
        for number, ((layout, size), ms) in enumerate(step_ms.items())
    ]
    return pd.DataFrame(rows)


def test_the_fastest_per_sample_against_the_defaults_reads_the_rounds_in_turn_where_there_are():
    # NHWC at batch 4: 8 ms per sample; the defaults (NCHW, the smallest batch, 2): 10 ms per sample
    trials = model_trials({(False, 2): 20.0, (True, 2): 19.0, (False, 4): 36.0, (True, 4): 32.0})
    assert at_defaults(trials)["trial"].tolist() == [0]
    assert fastest_and_defaults(trials) == (3, 0)
    rng = np.random.default_rng(0)
    own = {t: {"step": list(ms * rng.uniform(0.95, 1.05, 12))} for t, ms in zip(range(4), (20, 19, 36, 32))}
    unpaired = versus_defaults(trials, own)
    assert unpaired["rounds"] == 0 and unpaired["fastest"]["channels_last"] is True
    assert unpaired["ci_low"] < 1.25 < unpaired["ci_high"] and unpaired["defaults"]["batch_size"] == 2
    # Stepped in turn, the pair's rounds decide: here the fastest is 1.5x per sample
    in_turn = {"fastest": {"step": [24.0] * 6 + [24.4] * 6}, "defaults": {"step": [18.0] * 6 + [18.4] * 6}}
    record = {
        "fastest_trial": 3,
        "defaults_trial": 0,
        "in_turn": in_turn,
        "core_share": 0.6,
        "core_waited": 0.4,
    }
    paired = versus_defaults(trials, own, in_turn=record)
    assert paired["rounds"] == 12 and paired["speedup"] == pytest.approx(1.5, rel=0.01)
    assert paired["core_share"] == 0.6 and paired["core_waited"] == 0.4
    # The verdict in words, each case
    said = "\n".join(model_report.verdict(trials, {"versus_defaults": paired}))
    assert "**1.50x [" in said
    assert "faster per sample than PyTorch's defaults" in said
    assert (
        "stepped in turn after the sweep (12 rounds" in said
        and "**caution**: the rounds in turn did not have their CPU cores (the threads waited 40% of their "
        "core time for a core (their run-queue delay"
        in said
    )
    # an older record, no run-queue delay: the CPU share decides, and the caution says so
    older = paired | {"core_waited": None, "core_share": 0.5}
    assert "got 50% of the CPU time their threads could use (no run-queue delay or CPU pressure to read)" in (
        "\n".join(model_report.verdict(trials, {"versus_defaults": older}))
    )
    slower = paired | {
        "speedup": 0.8,
        "ci_low": 0.75,
        "ci_high": 0.85,
        "core_share": None,
        "core_waited": None,
    }
    assert "**not faster than PyTorch's defaults" in "\n".join(
        model_report.verdict(trials, {"versus_defaults": slower})
    )
    unsure = paired | {"ci_low": 0.9, "ci_high": 1.6}
    assert "within the 95% CI" in "\n".join(model_report.verdict(trials, {"versus_defaults": unsure}))
    fastest_default = model_trials({(False, 2): 10.0, (True, 2): 30.0})
    assert fastest_and_defaults(fastest_default) is None and versus_defaults(fastest_default, own) is None
    assert "the fastest setting swept" in "\n".join(model_report.verdict(fastest_default, {}))
    assert "not compared" in "\n".join(model_report.verdict(trials, {}))
