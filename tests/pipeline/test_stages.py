"""The stages as a user runs them: files in tmp_path, one-line errors, a two-trial sweep end to end."""

import hashlib
import json
import math
import re
import sys

import mlflow
import pandas as pd
import psutil
import pytest
import torch
from PIL import Image

from pipeline import data, env, report, sweep
from pipeline.results import COMPARED_PHASES, read_trials
from rcnn.detector.model import BACKBONE_CHANNELS, ROI_RESOLUTION
from rcnn.detector.roofline import head_flops
from rcnn.measure.device import amp_unavailable
from rcnn.measure.settings import AMP_DTYPES
from rcnn.measure.stats import against
from rcnn.trial.schema import SWEEP_WALL_PARTS
from tests import launcher
from tests.conftest import ROOT, TINY_PARAMS
from tests.pipeline.helpers import SWEEP_FILES

# Every test runs a stage: in a subprocess, a sweep, or the env stage's measurements
pytestmark = pytest.mark.slow


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
    return launcher.run([sys.executable, "-m", f"pipeline.{module}", *map(str, args)], cwd=ROOT, timeout=300)


def test_data_and_env_are_reproducible(tmp_path, tiny_params):
    params = tiny_params()
    for name in ("a", "b"):
        assert data.main(["--params", str(params), "--out", str(tmp_path / name)]) == 0
        assert env.main(["--params", str(params), "--out", str(tmp_path / f"{name}.json")]) == 0
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    envs = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("a", "b")]
    assert envs[0]["fingerprint"] == envs[1]["fingerprint"]  # stable: what the sweep depends on
    fingerprint, ceilings = envs[0]["fingerprint"], envs[0]["ceilings"]
    # This process's machine and library, on the device the params name (sweep.device: cpu).
    assert (fingerprint["device"], fingerprint["torch"], fingerprint["cpu_threads"]) == (
        "cpu",
        torch.__version__,
        torch.get_num_threads(),
    )
    assert "gpu" not in fingerprint
    # A matmul peak for exactly the dtypes the amp settings use on a CPU (no TF32 here), each a measured rate.
    usable = {dtype for amp, dtype in AMP_DTYPES.items() if amp_unavailable(amp, torch.device("cpu")) is None}
    assert set(ceilings["matmul_tflops"]) == usable and "fp32" in usable
    assert all(0 < v < math.inf for v in [*ceilings["matmul_tflops"].values(), ceilings["copy_gbps"]])
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


def test_two_trial_sweep_through_mlflow_and_report(tmp_path, tiny_params, capsys):
    params = tiny_params({"sweep": {"cross_check": True}, "tracking": {"system_metrics_s": 1}})
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
    # The FLOPs are the head's own for its RoIs (counted apart, on the meta device); TFLOP/s are those FLOPs
    # over the measured median, and the peak fraction that over env.json's fp32 matmul peak (amp off, CPU).
    num_classes = len(json.loads((paths["data"] / "annotations.json").read_text())["categories"])
    peak = json.loads(paths["env"].read_text())["ceilings"]["matmul_tflops"]["fp32"]
    for row in trials.itertuples():
        forward, backward = head_flops(
            row.head,
            rois=row.rois,
            in_channels=BACKBONE_CHANNELS,
            resolution=ROI_RESOLUTION,
            representation_size=TINY_PARAMS["model"]["representation_size"],
            num_classes=num_classes,
        )
        # Each against the same quantity from the unrounded FLOPs: the table keeps 4 decimals (half a unit of
        # the last off), and the times this recomputes from were rounded too (a relative 1e-3 at most).
        tflops = (forward / 1e9 / row.head_forward_ms, backward / 1e9 / row.head_backward_ms)
        for obtained, expected in [
            ((row.head_forward_gflop, row.head_backward_gflop), (forward / 1e9, backward / 1e9)),
            ((row.head_forward_tflops, row.head_backward_tflops), tflops),
            ((row.head_forward_peak_fraction, row.head_backward_peak_fraction), (t / peak for t in tflops)),
        ]:
            for got, want in zip(obtained, expected):
                assert abs(got - want) <= 5e-5 + 1e-3 * abs(want), (got, want)
    # cross_check on: every trial has the head timed alone too (its backward is a difference of two noisy
    # times, negative at times on a loaded machine: no sign checked).
    assert trials[["isolated_head_forward_ms", "isolated_head_backward_ms"]].notna().all().all()

    # The comparisons: one setting, conv over linear, per phase, read where conv's trial stepped the two heads
    # in one twin detector after its own steps (checked against its MLflow run below), then pooled.
    comparisons = pd.read_csv(paths["comparisons"])
    assert sorted(comparisons["phase"]) == sorted(COMPARED_PHASES * 2)
    assert set(zip(comparisons["numerator"], comparisons["denominator"])) == {("conv", "linear")}
    for row in comparisons.itertuples():
        assert row.ci_low <= row.ratio <= row.ci_high or pd.isna(row.ci_low)
    per_setting = comparisons[comparisons["batch_size"] != "all"].set_index("phase")
    assert (per_setting["rounds"] >= timing["iterations"]).all()
    walls = trials.set_index("head")["wall_paired_s"]
    assert walls["conv"] > 0 and walls["linear"] == 0  # the reference head's trial steps no pair
    # The progress says where the pair's box-head ratio lies against the fix's aim, as the comparisons do
    said = re.search(
        r"in one twin step with linear: box-head backward (\S+)x \[(\S+), (\S+)\] over (\d+) steps, "
        r"(within|beyond|undecided) against 1.05x",
        capsys.readouterr().out,
    )
    head_row = per_setting.loc["head_backward"]
    assert said and said.groups() == (
        f"{head_row['ratio']:.2f}",
        f"{head_row['ci_low']:.2f}",
        f"{head_row['ci_high']:.2f}",
        f"{head_row['rounds']:.0f}",
        against(1.05, head_row["ci_low"], head_row["ci_high"]),
    )

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
    best, per_image = summary["best"], trials["step_ms"] / trials["batch_size"]
    fastest = trials.loc[per_image.idxmin()]  # the least time per image, not per step
    assert (best["head"], best["batch_size"]) == (fastest["head"], fastest["batch_size"])
    # The summary keeps 1 decimal
    assert (best["step_ms"], best["ms_per_image"]) == pytest.approx(
        (fastest["step_ms"], per_image.min()), abs=0.051
    )
    wall = summary["wall"]  # where the run's time went: the parts add up to it, timed steps a share of it
    assert set(wall["parts_s"]) == set(SWEEP_WALL_PARTS) and 0 < wall["measure_share"] < 1
    # Parts and total keep 0.1 s
    timed = wall["parts_s"]["measure"] + wall["parts_s"]["paired"]  # alone, and the twin with linear
    assert wall["measure_share"] == pytest.approx(timed / wall["total_s"], abs=0.2 / wall["total_s"] + 1e-3)
    assert wall["parts_s"]["paired"] == pytest.approx(trials["wall_paired_s"].sum(), abs=0.1)
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
    # Each child run's metrics are its row of the trials table (which keeps 4 decimals), its params the knobs.
    logged = children.set_index("run_id")
    by_run = trials.set_index("mlflow_run_id").loc[logged.index]
    for column in ("head_backward_ms", "step_ms", "head_backward_gflop", "iterations"):
        assert logged[f"metrics.{column}"].tolist() == pytest.approx(by_run[column].tolist(), abs=1e-4)
    assert logged["params.head"].tolist() == by_run["head"].tolist()
    conv_run = logged[logged["params.head"] == "conv"].iloc[0]  # its ratios to linear, in one twin step
    assert conv_run["tags.paired_with"] == "linear"
    assert conv_run["metrics.paired_rounds"] == per_setting.loc["step", "rounds"]
    for phase in COMPARED_PHASES:
        assert conv_run[f"metrics.paired_{phase}_ratio"] == pytest.approx(per_setting.loc[phase, "ratio"])
    assert logged.loc[logged["params.head"] == "linear", "metrics.paired_rounds"].isna().all()
    for run_id in children["run_id"]:  # the profiled trials (here both) carry their by-module table
        assert "modules.csv" in {a.path for a in mlflow.MlflowClient().list_artifacts(run_id)}
    assert set(children["tags.trial"]) == {"0", "1"} and children["tags.torch"].notna().all()
    # System metrics, sampled every second: on the parent run, and on every run that lasted past a sample.
    assert parents["metrics.system/cpu_utilization_percentage"].notna().all()
    used = parents["metrics.system/system_memory_usage_megabytes"]
    assert used.between(0, psutil.virtual_memory().total / 1e6, inclusive="right").all()  # used <= installed
    lasted = (children["end_time"] - children["start_time"]).dt.total_seconds() > 1.5
    assert lasted.any() and children.loc[lasted, "metrics.system/cpu_utilization_percentage"].notna().all()
    parent_metrics = mlflow.get_run(parents["run_id"].iloc[0]).data.metrics
    assert {part: parent_metrics[f"wall_{part}_s"] for part in SWEEP_WALL_PARTS} == wall["parts_s"]
    assert (parent_metrics["wall_total_s"], parent_metrics["wall_measure_share"]) == (
        wall["total_s"],
        wall["measure_share"],
    )
    assert parent_metrics["conv_over_linear_head_backward"] == summary["conv_over_linear_head_backward"]

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
    # Every figure is a PNG the report shows, drawn from the data under plots/ (what dvc plots reads).
    figures = {p.stem for p in (out / "figures").glob("*.png")}
    assert "head_backward" in figures and figures == {p.stem for p in (out / "plots").glob("*.csv")}
    for name in figures:
        with Image.open(out / "figures" / f"{name}.png") as image:
            assert image.format == "PNG" and min(image.size) > 100
        assert f"figures/{name}.png" in text
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
