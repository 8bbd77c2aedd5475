"""The stages as a user runs them: files in tmp_path, one-line errors, a two-trial sweep end to end."""
import hashlib
import json
import subprocess
import sys

import mlflow
import pandas as pd
import pytest

from pipeline import data, env, report, sweep
from pipeline.results import read_trials
from tests.conftest import ROOT


def digest(folder):
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sorted(folder.iterdir()))).hexdigest()


def sweep_paths(folder):
    return [a for k, v in {"data": "data", "env": "env.json", "trials": "t.csv", "comparisons": "c.csv",
                           "kernels": "k.csv", "summary": "s.json"}.items() for a in (f"--{k}", str(folder / v))]


def stage_cli(module, *args):
    return subprocess.run([sys.executable, "-m", f"pipeline.{module}", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


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
    assert sorted(p.name for p in out.iterdir()) == ["000000.png", "000001.png", "000002.png", "000003.png",
                                                     "annotations.json"]
    (out / "notes.txt").write_text("mine")
    before = digest(out)
    result = stage_cli("data", "--params", params, "--out", out)
    assert result.returncode == 2 and "holds files this command did not write (notes.txt)" in result.stderr
    assert digest(out) == before


@pytest.mark.parametrize("override, message", [
    ({"sweep": {"space": {"head": ["mlp"]}}}, "sweep.space.head: 'mlp' is not allowed"),
    ({"sweep": {"space": {"batch_size": [0]}}}, "sweep.space.batch_size: 0 is too small"),
    ({"sweep": {"space": {"amp": ["fp8"]}}}, "sweep.space.amp: 'fp8' is not allowed"),
    ({"sweep": {"space": {"amp": ["fp16"]}}}, "sweep.space.amp: no value applies on cpu"),
    ({"timing": {"warmpu": 1}}, "timing.warmpu: unknown key"),
])
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
    result = stage_cli("data", "--params", tiny_params({"data": {"source": str(tmp_path / "coco")}}),
                       "--out", tmp_path / "d")
    assert result.returncode == 2 and "coco: data folder does not exist" in result.stderr


@pytest.mark.slow
def test_two_trial_sweep_through_mlflow_and_report(tmp_path, tiny_params):
    params = tiny_params()
    paths = {k: tmp_path / v for k, v in {"data": "data", "env": "env.json", "trials": "trials.csv",
                                          "comparisons": "comparisons.csv", "kernels": "kernels.csv",
                                          "summary": "summary.json"}.items()}
    assert data.main(["--params", str(params), "--out", str(paths["data"])]) == 0
    assert env.main(["--params", str(params), "--out", str(paths["env"])]) == 0
    sweep_args = ["--params", str(params)] + [a for k, p in paths.items() for a in (f"--{k}", str(p))]
    assert sweep.main(sweep_args) == 0

    trials = read_trials(paths["trials"])
    assert sorted(trials["head"]) == ["conv", "linear"]  # exactly the applicable grid
    assert trials["status"].eq("complete").all() and trials["cudnn_benchmark"].eq("n/a").all()
    assert (trials["head_backward_ms"] > 0).all() and (trials["rois"] == 16).all()
    ci_low = trials["head_backward_ci_low_ms"]  # NaN where too few steps for an interval
    assert (ci_low.isna() | (ci_low <= trials["head_backward_ms"])).all()
    assert (trials["head_backward_gflop"] > 0).all() and (trials["head_backward_peak_fraction"] > 0).all()
    assert (trials["isolated_head_backward_ms"] > 0).all() and trials["iterations"].between(2, 3).all()
    summary = json.loads(paths["summary"].read_text())
    assert summary["complete"] == 2 and summary["conv_over_linear_head_backward"] > 0
    assert summary["drift"]["start"]["step_ms"] > 0 and summary["drift"]["end"]["step_ms"] > 0
    kernels = pd.read_csv(paths["kernels"])
    assert set(kernels["head"]) == {"conv", "linear"}  # both heads profiled at the first setting

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["test"])
    parents = runs[runs["tags.mlflow.parentRunId"].isna()]
    children = runs[runs["tags.mlflow.parentRunId"].notna()]
    baselines = children[children["tags.role"].notna()]
    children = children[children["tags.role"].isna()]
    assert len(parents) == 1 and len(children) == 2 and len(baselines) == 2
    assert (children["tags.mlflow.parentRunId"] == parents["run_id"].iloc[0]).all()
    assert set(children["run_id"]) == set(trials["mlflow_run_id"])
    assert children["metrics.head_backward_ms"].gt(0).all() and set(children["params.head"]) == {"conv", "linear"}
    assert set(children["tags.trial"]) == {"0", "1"} and children["tags.torch"].notna().all()

    # Rerun with nothing changed: the same study resumes, nothing is measured twice.
    assert sweep.main(sweep_args) == 0
    assert len(mlflow.search_runs(experiment_names=["test"])) == 5
    assert read_trials(paths["trials"])["mlflow_run_id"].tolist() == trials["mlflow_run_id"].tolist()

    out = tmp_path / "reports"
    assert report.main(["--params", str(params), "--out", str(out), "--mlflow"] + [
        a for k in ("trials", "comparisons", "kernels", "summary", "env") for a in (f"--{k}", str(paths[k]))]) == 0
    text = (out / "report.md").read_text()
    assert "## Verdict" in text and f"{summary['conv_over_linear_head_backward']:.2f}x" in text
    assert "aten::convolution_backward" in text and "Baseline" in text
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(parents["run_id"].iloc[0])}
    assert {"report.html", "figures", "trials.csv"} <= artifacts

    # A tracking store pointed elsewhere: the study still resumes, under a new parent run there.
    elsewhere = tiny_params({"tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'other.db'}"}})
    assert sweep.main(["--params", str(elsewhere)] + sweep_args[2:]) == 0
    assert json.loads(paths["summary"].read_text())["complete"] == 2
    assert (out / "figures" / "head_backward.png").stat().st_size > 1000
    assert len(pd.read_csv(out / "plots" / "head_backward.csv")) == 2


def test_report_on_malformed_trials_is_one_line(tmp_path, tiny_params):
    (tmp_path / "trials.csv").write_text("just,a,header\n")
    (tmp_path / "s.json").write_text("{}")
    (tmp_path / "e.json").write_text('{"fingerprint": {}, "ceilings": {}}')
    result = stage_cli("report", "--params", tiny_params(), "--trials", tmp_path / "trials.csv", "--summary",
                       tmp_path / "s.json", "--env", tmp_path / "e.json", "--comparisons", tmp_path / "c.csv",
                       "--kernels", tmp_path / "k.csv", "--out", tmp_path / "r")
    assert result.returncode == 2 and "trials.csv: missing columns" in result.stderr
