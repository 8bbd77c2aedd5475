"""The library installs on its own: a wheel built from the project, installed into a fresh virtual environment
(torch reused from this one, nothing of Optuna, MLflow or DVC needed), works from another folder."""

import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_the_wheel_installs_and_runs_from_anywhere(tmp_path):
    source = tmp_path / "source"  # built from a copy: the build's own folders stay out of the project
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "rcnn", source / "rcnn", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheels"),
            str(source),
        ],
        check=True,
    )
    (wheel,) = (tmp_path / "wheels").glob("roi_head_sweep-*.whl")

    env = tmp_path / "env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # torch and the rest from this environment, so nothing is downloaded; rcnn only from the wheel
    (tmp_path / "env" / site.split(str(env) + "/")[1] / "reuse.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = lambda *argv: subprocess.run(
        [str(python), *argv],
        cwd=elsewhere,
        capture_output=True,
        text=True,  # noqa: E731
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=600,
    )
    done = run(
        "-c",
        "import rcnn, torch; from rcnn.fix import linearize; "
        "m = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 7), torch.nn.Flatten()); "
        "print(rcnn.__file__); print(linearize(m, torch.randn(2, 4, 7, 7), mode='always'))",
    )
    assert done.returncode == 0, done.stderr
    assert str(env) in done.stdout and "covers-input" in done.stdout
    done = run("-c", "from importlib.metadata import requires; print(requires('roi-head-sweep'))")
    assert "torch" in done.stdout and not any(tool in done.stdout for tool in ("mlflow", "optuna", "dvc"))
    done = run(
        "-m",
        "rcnn.doctor",
        "torchvision:resnet18",
        "--image-size",
        "64",
        "--max-seconds",
        "1",
        "--top",
        "3",
        "--device",
        "cpu",
    )
    assert done.returncode == 0, done.stderr
    assert "Top 3 modules" in done.stdout
