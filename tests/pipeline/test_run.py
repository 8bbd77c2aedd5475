"""The device check's command, proven on the CPU with the smoke preset before any GPU runs it."""

import subprocess
import sys
import tarfile

import pytest
import yaml

from pipeline.results import read_trials
from pipeline.run import stage_commands
from rcnn.measure.device import cxx_compiler
from tests.conftest import ROOT


def test_stage_commands_fill_params_in_file_order():
    dvc = {
        "stages": {"a": {"cmd": "python -m x --out data/${data.name}"}, "b": {"cmd": "python -m y\n  --n 1"}}
    }
    assert stage_commands(dvc, {"data": {"name": "d1"}}) == [
        ("a", "python -m x --out data/d1"),
        ("b", "python -m y --n 1"),
    ]


@pytest.mark.slow
def test_device_check_runs_every_stage_on_cpu(tmp_path):
    # The smoke preset without conv_as_linear (a third of the trials, through the code paths conv takes) and
    # without amp off, which every tiny sweep of the other tests runs: bf16 (profiled), and fp16, which does
    # not apply on CPU.
    preset = yaml.safe_load((ROOT / "presets" / "cpu-smoke.yaml").read_text())
    space = preset["sweep"]["space"]
    assert "conv_as_linear" in space["head"] and space["amp"] == ["off", "fp16", "bf16"]
    space |= {"head": ["linear", "conv"], "amp": ["fp16", "bf16"]}
    preset["sweep"]["profile_at"] = [{"amp": "bf16"}]
    (tmp_path / "preset.yaml").write_text(yaml.safe_dump(preset))
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", "scripts/device-check.sh", str(tmp_path / "preset.yaml"), str(out), sys.executable],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    log = (out / "log.txt").read_text()
    for stage in ("env", "data", "sweep", "report"):
        assert f"== stage {stage}:" in log
    assert "not swept on cpu: amp=fp16 (fp16 autocast with GradScaler is a CUDA setting" in log
    with tarfile.open(out / "run.tar.gz") as tar:
        names = set(tar.getnames())
        tar.extractall(tmp_path / "run", filter="data")
    assert {"./results/trials.csv", "./results/env.json", "./mlflow.db", "./reports/report.md"} <= names
    assert not any(n.startswith("./data/") for n in names)
    trials = read_trials(tmp_path / "run" / "results" / "trials.csv")
    # fp16, cudnn.benchmark and TF32 do not apply on CPU: no duplicates, nothing hidden; each head eager and
    # compiled, as on the GPU
    assert set(trials["head"]) == {"linear", "conv"} and trials["status"].eq("complete").all()
    assert not trials.duplicated(["head", "compile"]).any() and set(trials["amp"]) == {"bf16"}
    compiles = ["off", "head"] if cxx_compiler() else ["off"]  # without a C++ compiler: not applicable on CPU
    assert len(trials) == 2 * len(compiles) and trials["tf32"].eq("n/a").all()
    compiled = trials[trials["compile"] == "head"]
    assert len(compiled) == 2 * (len(compiles) - 1)
    assert (compiled["compile_steps"] >= 1).all() and (compiled["compiled_graphs"] >= 2).all()
    assert {"./results/comparisons.csv", "./results/kernels.csv", "./results/modules.csv"} <= names
    report = (out / "report.md").read_text()
    assert "## Verdict" in report and ("- does torch.compile close the conv/linear gap?" in report) == bool(
        len(compiled)
    )


@pytest.mark.slow
def test_bad_preset_fails_before_any_stage(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sweep: {device: tpu}\n")
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.run", "--params", str(bad), "--workdir", str(tmp_path / "w")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "sweep.device: 'tpu' is not allowed" in result.stderr
    assert not (tmp_path / "w").exists()
