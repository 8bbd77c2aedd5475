"""The stages as a user runs them: files in tmp_path, one-line errors, a two-trial sweep end to end."""

import hashlib
import json
import subprocess
import sys

import mlflow
import pandas as pd
import pytest

from pipeline import data, env, report, sweep
from pipeline.results import COMPARED_PHASES, read_trials
from rcnn.detector.schema import SWEEP_WALL_PARTS
from tests.conftest import ROOT, TINY_PARAMS
from tests.pipeline.helpers import SWEEP_FILES

pytestmark = (
    pytest.mark.slow
)  # every test runs a stage: in a subprocess, a sweep, or the env stage's measurements


def digest(folder):
    return hashlib.sha256(
        b"".join(p.name.encode() + p.read_bytes() for p in sorted(folder.iterdir()))
    ).hexdigest()


def sweep_paths(folder):
    return [
        a
        for k, v in {
            "data": "data",
            "env": "env.json",
            "trials": "t.csv",
            "comparisons": "c.csv",
            "kernels": "k.csv",
            "modules": "m.csv",
            "summary": "s.json",
        }.items()
        for a in (f"--{k}", str(folder / v))
    ]


def stage_cli(module, *args):
    return subprocess.run(
        [sys.executable, "-m", f"pipeline.{module}", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_data_and_env_are_reproducible(tmp_path, tiny_params):
    params = tiny_params()
    for name in ("a", "b"):
        assert data.main(["--params", str(params), "--out", str(tmp_path / name)]) == 0
        assert env.main(["--params", str(params), "--out", str(tmp_path / f"{name}.json")]) == 0
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    envs = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("a", "b")]
    assert envs[0]["fingerprint"] == envs[1]["fingerprint"]  # stable: what the sweep depends on
    assert envs[0]["ceilings"]["matmul_tflops"]["fp32"] > 0 and envs[0]["ceilings"]["copy_gbps"] > 0
    coco = json.loads((tmp_path / "a" / "annotations.json").read_text())
    assert len(coco["images"]) == 4 and len(coco["categories"]) == 2


def test_data_stage_replaces_only_its_own_files(tmp_path, tiny_params):
    params, out = str(tiny_params()), tmp_path / "data"
    assert data.main(["--params", params, "--out", str(out)]) == 0
    (out / "000009.png").write_bytes(b"left by a run with more images")
    assert data.main(["--params", params, "--out", str(out)]) == 0  # its own earlier files go, all of them
    assert sorted(p.name for p in out.iterdir()) == [
        "000000.png",
        "000001.png",
        "000002.png",
        "000003.png",
        "annotations.json",
    ]
    (out / "notes.txt").write_text("mine")
    before = digest(out)
    result = stage_cli("data", "--params", params, "--out", out)
    assert result.returncode == 2 and "holds files this command did not write (notes.txt)" in result.stderr
    assert digest(out) == before


@pytest.mark.parametrize(
    "override, message",
    [
        ({"sweep": {"space": {"head": ["mlp"]}}}, "sweep.space.head: 'mlp' is not allowed"),
        ({"sweep": {"space": {"batch_size": [0]}}}, "sweep.space.batch_size: 0 is too small"),
        ({"sweep": {"space": {"amp": ["fp8"]}}}, "sweep.space.amp: 'fp8' is not allowed"),
        ({"sweep": {"space": {"amp": ["fp16"]}}}, "sweep.space.amp: no value applies on cpu"),
        ({"timing": {"warmpu": 1}}, "timing.warmpu: unknown key"),
    ],
)
def test_bad_params_stop_with_one_line(tmp_path, tiny_params, override, message):
    result = stage_cli("sweep", "--params", tiny_params(override), *sweep_paths(tmp_path))
    assert result.returncode == 2
    assert message in result.stderr and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "t.csv").exists()


def test_missing_data_folder_and_source(tmp_path, tiny_params):
    result = stage_cli("sweep", "--params", tiny_params(), *sweep_paths(tmp_path))
    assert result.returncode == 2 and "data: data folder does not exist" in result.stderr
    assert data.main(["--params", str(tiny_params()), "--out", str(tmp_path / "data")]) == 0
    (tmp_path / "env.json").write_text('{"device": "cpu"}')
    result = stage_cli("sweep", "--params", tiny_params(), *sweep_paths(tmp_path))
    assert result.returncode == 2 and "env.json: needs 'fingerprint' and 'ceilings'" in result.stderr
    result = stage_cli(
        "data", "--params", tiny_params({"data": {"source": str(tmp_path / "coco")}}), "--out", tmp_path / "d"
    )
    assert result.returncode == 2 and "coco: data folder does not exist" in result.stderr


def test_two_trial_sweep_through_mlflow_and_report(tmp_path, tiny_params):
    params = tiny_params({"tracking": {"system_metrics_s": 1}})
    paths = {k: tmp_path / v for k, v in SWEEP_FILES.items()}
    assert data.main(["--params", str(params), "--out", str(paths["data"])]) == 0
    assert env.main(["--params", str(params), "--out", str(paths["env"])]) == 0
    sweep_args = ["--params", str(params)] + [a for k, p in paths.items() for a in (f"--{k}", str(p))]
    assert sweep.main(sweep_args) == 0

    trials = read_trials(paths["trials"])
    assert sorted(trials["head"]) == ["conv", "linear"]  # exactly the applicable grid
    assert trials["status"].eq("complete").all() and trials["cudnn_benchmark"].eq("n/a").all()
    assert trials["trial"].is_unique and trials["mlflow_run_id"].notna().all()
    # Each row's phases nest as a step does: the box head inside the backward and the forward, both inside the
    # step.
    assert (trials["head_backward_ms"] > 0).all() and (
        trials["head_backward_ms"] <= trials["backward_ms"]
    ).all()
    assert (trials["head_forward_ms"] <= trials["forward_ms"]).all()
    assert (trials[["forward_ms", "backward_ms", "optimizer_ms"]].max(axis=1) <= trials["step_ms"]).all()
    assert (trials["rois"] == trials["batch_size"] * trials["rois_per_image"]).all()
    timing = TINY_PARAMS["timing"]  # the stopping rule's bounds, as the tiny params set them
    assert trials["iterations"].between(timing["iterations"], timing["max_iterations"]).all()
    assert trials["warmup_iterations"].between(timing["warmup"], timing["max_warmup"]).all()
    for phase in ("head_backward", "step"):  # NaN where too few steps for an interval
        low, median, high = (trials[f"{phase}_{s}"] for s in ("ci_low_ms", "ms", "ci_high_ms"))
        assert (low.isna() | ((low <= median) & (median <= high))).all()
    assert (trials["head_backward_gflop"] > 0).all() and (trials["head_backward_peak_fraction"] > 0).all()
    # cross_check on: every trial has the head timed alone too (its backward is a difference of two noisy
    # times, negative at times on a loaded machine: no sign checked).
    assert trials[["isolated_head_forward_ms", "isolated_head_backward_ms"]].notna().all().all()

    # The comparisons are the trials' medians divided: one setting, conv over linear, per phase, then pooled.
    comparisons = pd.read_csv(paths["comparisons"])
    assert sorted(comparisons["phase"]) == sorted(COMPARED_PHASES * 2)
    assert set(zip(comparisons["numerator"], comparisons["denominator"])) == {("conv", "linear")}
    medians = trials.set_index("head")
    for row in comparisons.itertuples():
        assert row.ratio == pytest.approx(
            medians.loc["conv", f"{row.phase}_ms"] / medians.loc["linear", f"{row.phase}_ms"], rel=1e-3
        )
        assert row.ci_low <= row.ratio <= row.ci_high or pd.isna(row.ci_low)

    summary = json.loads(paths["summary"].read_text())
    statuses = trials["status"].value_counts()
    assert summary["trials"] == len(trials) and summary["complete"] == statuses.get("complete", 0) == 2
    assert summary["failed"] == summary["timeout"] == summary["not_run"] == 0
    pooled = comparisons[
        (comparisons["settings"] == 1)
        & (comparisons["batch_size"] == "all")
        & (comparisons["phase"] == "head_backward")
    ]
    assert summary["conv_over_linear_head_backward"] == pytest.approx(pooled["ratio"].iloc[0], abs=1e-3)
    assert summary["conv_as_linear_over_linear_head_backward"] is None  # that head was not swept
    best = summary["best"]
    assert (best["head"], best["batch_size"]) in set(zip(trials["head"], trials["batch_size"]))
    wall = summary["wall"]  # where the run's time went: the parts add up to it, timed steps a share of it
    assert set(wall["parts_s"]) == set(SWEEP_WALL_PARTS) and 0 < wall["measure_share"] < 1
    assert sum(wall["parts_s"].values()) == pytest.approx(wall["total_s"], rel=0.01, abs=0.3)
    baselines = summary["drift"]["start"]["wall_s"]["measure"] + summary["drift"]["end"]["wall_s"]["measure"]
    assert wall["parts_s"]["measure"] == pytest.approx(trials["wall_measure_s"].sum() + baselines, abs=0.1)
    assert wall["parts_s"]["compile"] == 0
    drift = summary["drift"]
    assert drift["step_drift"] == pytest.approx(
        drift["end"]["step_ms"] / drift["start"]["step_ms"] - 1, abs=1e-3
    )
    kernels = pd.read_csv(paths["kernels"])
    assert set(kernels["head"]) == {"conv", "linear"}  # both heads profiled at the first setting
    assert (
        set(kernels["trial"]) <= set(trials["trial"])
        and kernels["share"].between(0, 1, inclusive="right").all()
    )
    # ... and timed by module: the conv head's 7x7 conv is a GEMM in disguise, the linear head has none.
    modules = pd.read_csv(paths["modules"], keep_default_na=False).set_index(["head", "module"])
    assert set(modules.index.get_level_values("head")) == {"conv", "linear"}
    assert modules.loc[("conv", "roi_heads.box_head.0"), "flag"].startswith("gemm-in-disguise:covers-input")
    linear_box_head = modules.loc["linear"].filter(like="roi_heads.box_head", axis=0)
    assert len(linear_box_head) and not linear_box_head["flag"].str.contains("gemm-in-disguise").any()
    for head in ("conv", "linear"):  # the rows add up to the step's backward; shares to one
        assert modules.loc[head, "backward_share"].sum() == pytest.approx(1)

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["test"])
    parents = runs[runs["tags.mlflow.parentRunId"].isna()]
    children = runs[runs["tags.mlflow.parentRunId"].notna()]
    baselines = children[children["tags.role"].notna()]
    children = children[children["tags.role"].isna()]
    assert len(parents) == 1 and len(children) == 2 and len(baselines) == 2
    assert (children["tags.mlflow.parentRunId"] == parents["run_id"].iloc[0]).all()
    assert set(children["run_id"]) == set(trials["mlflow_run_id"])
    assert children["metrics.head_backward_ms"].gt(0).all() and set(children["params.head"]) == {
        "conv",
        "linear",
    }
    for run_id in children["run_id"]:  # the profiled trials (here both) carry their by-module table
        assert "modules.csv" in {a.path for a in mlflow.MlflowClient().list_artifacts(run_id)}
    assert set(children["tags.trial"]) == {"0", "1"} and children["tags.torch"].notna().all()
    # System metrics, sampled every second: on the parent run, and on every run that lasted past a sample.
    assert parents["metrics.system/cpu_utilization_percentage"].notna().all()
    assert parents["metrics.system/system_memory_usage_megabytes"].gt(0).all()
    lasted = (children["end_time"] - children["start_time"]).dt.total_seconds() > 1.5
    assert lasted.any() and children.loc[lasted, "metrics.system/cpu_utilization_percentage"].notna().all()
    parent_metrics = mlflow.get_run(parents["run_id"].iloc[0]).data.metrics
    assert parent_metrics["wall_measure_s"] > 0 and 0 < parent_metrics["wall_measure_share"] < 1

    # Rerun with nothing changed: the same study resumes, nothing is measured twice.
    assert sweep.main(sweep_args) == 0
    assert len(mlflow.search_runs(experiment_names=["test"])) == 5
    assert read_trials(paths["trials"])["mlflow_run_id"].tolist() == trials["mlflow_run_id"].tolist()

    out = tmp_path / "reports"
    assert (
        report.main(
            ["--params", str(params), "--out", str(out), "--mlflow"]
            + [
                a
                for k in ("trials", "comparisons", "kernels", "modules", "summary", "env")
                for a in (f"--{k}", str(paths[k]))
            ]
        )
        == 0
    )
    text = (out / "report.md").read_text()
    assert "## Verdict" in text and f"{summary['conv_over_linear_head_backward']:.2f}x" in text
    assert "fastest setting, by time per image" in text
    assert "aten::convolution_backward" in text and "Baseline" in text
    assert "## Backward by module" in text and "The conv head's 7x7 conv (roi_heads.box_head.0)" in text
    assert "## Where the sweep's time went" in text and "| measure " in text
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(parents["run_id"].iloc[0])}
    assert {"report.html", "figures", "trials.csv"} <= artifacts

    # A tracking store pointed elsewhere: the study still resumes, under a new parent run there.
    elsewhere = tiny_params({"tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'other.db'}"}})
    assert sweep.main(["--params", str(elsewhere)] + sweep_args[2:]) == 0
    assert json.loads(paths["summary"].read_text())["complete"] == 2
    assert (out / "figures" / "head_backward.png").stat().st_size > 1000
    assert pd.read_csv(out / "plots" / "head_backward.csv")["head"].tolist() == trials["head"].tolist()


def test_report_on_malformed_trials_is_one_line(tmp_path, tiny_params):
    (tmp_path / "trials.csv").write_text("just,a,header\n")
    (tmp_path / "s.json").write_text("{}")
    (tmp_path / "e.json").write_text('{"fingerprint": {}, "ceilings": {}}')
    result = stage_cli(
        "report",
        "--params",
        tiny_params(),
        "--trials",
        tmp_path / "trials.csv",
        "--summary",
        tmp_path / "s.json",
        "--env",
        tmp_path / "e.json",
        "--comparisons",
        tmp_path / "c.csv",
        "--kernels",
        tmp_path / "k.csv",
        "--out",
        tmp_path / "r",
    )
    assert result.returncode == 2 and "trials.csv: missing columns" in result.stderr
