"""The library installs on its own: a wheel built from the project, installed into a fresh virtual environment
(torch reused from this one, nothing of Optuna, MLflow or DVC needed), works from another folder."""

import json
import shutil
import subprocess
import sys
import sysconfig
import venv

import pandas as pd
import pytest

from tests.conftest import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: only the tools' absence is checked
    tomllib = None


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
    venv.create(env, with_pip=False)  # this environment's pip installs into it (--python): no ensurepip
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
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
    )

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
    # The fix, from the installed wheel: the one 7x7 conv that covers its input is swapped for the same
    # product as a GEMM, and the model computes what it did before.
    done = run("-c", FIX_SCRIPT)
    assert done.returncode == 0, done.stderr
    fixed = json.loads(done.stdout)
    assert fixed["rcnn"].startswith(str(env / site.split(str(env) + "/")[1]) + "/rcnn/")
    assert fixed["swaps"] == [["0", "covers-input", [2, 4, 7, 7], True]]
    assert fixed["class"] == "Conv2dAsLinear" and fixed["max_abs_diff"] < 1e-5

    # Exactly the dependencies pyproject declares: none of the pipeline's tools.
    done = run(
        "-c",
        "import json; from importlib.metadata import requires; print(json.dumps(requires('roi-head-sweep')))",
    )
    required = [r for r in json.loads(done.stdout) if "extra ==" not in r]  # the zoo extra: optional
    assert not any(tool in " ".join(required) for tool in ("mlflow", "optuna", "dvc"))
    if tomllib:
        declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        assert sorted(required) == sorted(declared)

    # The doctor from another folder: its table on stdout is the top 3 of the modules.csv it writes, whose
    # backward shares add up to the step's backward.
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
        "--out",
        "doctor",
    )
    assert done.returncode == 0, done.stderr
    modules = pd.read_csv(elsewhere / "doctor" / "modules.csv")
    assert modules["backward_share"].sum() == pytest.approx(1, abs=0.01)
    top = modules[modules["module"] != "(outside modules)"].nlargest(3, "backward_ms")["module"]
    table = done.stdout.split("Top 3 modules")[1].split("\n\n")[0].splitlines()[2:]  # after the header
    shown = [line.split()[0] for line in table if not line.strip().startswith("(outside")]
    assert shown == top.tolist()
    env_json = json.loads((elsewhere / "doctor" / "env.json").read_text())
    assert (env_json["model"], env_json["options"]["image_size"], env_json["fingerprint"]["device"]) == (
        "torchvision:resnet18",
        64,
        "cpu",
    )


FIX_SCRIPT = """
import json, rcnn, torch
from rcnn.fix import linearize
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 7), torch.nn.Flatten())
x = torch.randn(2, 4, 7, 7)
before = m(x)
swaps = linearize(m, x, mode="always")
print(json.dumps({
    "rcnn": rcnn.__file__,
    "swaps": [[s.module, s.kind, list(s.input_shape), s.swapped] for s in swaps],
    "class": type(m[0]).__name__,
    "max_abs_diff": (m(x) - before).abs().max().item(),
}))
"""
