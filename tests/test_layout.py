"""The library's rooms import one way: commands -> detector -> trial -> doctor -> fix -> measure -> the shared
plumbing, never back, and none of them imports the pipeline or its tools; a trial of any model loads nothing
of the detector; and no source file is longer than a reader can hold."""

from __future__ import annotations

import sys

import pytest

from tests import launcher
from tests.conftest import ROOT
from tests.imports import imported_names

# Each room may import its own modules and those of the rooms below it.
ROOMS = ["plumbing", "measure", "fix", "doctor", "trial", "detector", "commands"]
ROOM_OF = {
    "rcnn.measure": "measure",
    "rcnn.fix": "fix",
    "rcnn.disguise": "fix",
    "rcnn.doctor": "doctor",
    "rcnn.trial": "trial",
    "rcnn.detector": "detector",
    "rcnn.bench": "commands",  # python -m rcnn.bench: the detector's trials and any model's
    "rcnn.heads": "commands",  # an alias of rcnn.detector.heads
}
# The sweep's; the doctor's --mlflow imports mlflow on its own
TOOLS = (
    "pipeline",
    "optuna",
    "mlflow",
    "dvc",
)


def room(module: str) -> str:
    return next(
        (r for prefix, r in ROOM_OF.items() if module == prefix or module.startswith(prefix + ".")),
        "plumbing",
    )


def library_modules() -> dict[str, object]:
    files = sorted((ROOT / "rcnn").rglob("*.py"))
    names = {}
    for path in files:
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def wrong_way(module: str, path) -> list[str]:
    rank = ROOMS.index(room(module))
    found = []
    for name in sorted(imported_names(path, module)):
        if name.split(".")[0] in TOOLS and not (name == "mlflow" and module == "rcnn.doctor.command"):
            found.append(f"{module} imports {name}")
        elif name.startswith("rcnn.") and ROOMS.index(room(name)) > rank:
            found.append(f"{module} ({room(module)}) imports {name} ({room(name)})")
    return found


@pytest.mark.parametrize("module", sorted(library_modules()))
def test_the_library_imports_one_way(module):
    assert not wrong_way(module, library_modules()[module])


def test_a_wrong_way_import_is_caught(tmp_path):
    measure = tmp_path / "clock.py"
    measure.write_text("from rcnn.detector.model import build_detector\nimport optuna\n")
    found = wrong_way("rcnn.measure.clock", measure)
    assert "rcnn.measure.clock (measure) imports rcnn.detector.model (detector)" in found
    assert "rcnn.measure.clock imports optuna" in found
    plumbing = tmp_path / "rules.py"
    plumbing.write_text("from rcnn.doctor.columns import ROOT\n")
    assert wrong_way("rcnn.rules", plumbing)[0].startswith("rcnn.rules (plumbing) imports rcnn.doctor")


def test_the_doctors_zoos_name_modules_of_a_room_above_it():
    """The doctor finds a zoo (the detector) by a 'module:builder' string, not an import: each must resolve
    to a builder in a room that may import the doctor."""
    import importlib

    from rcnn.doctor.workloads import ZOOS

    for spec in ZOOS.values():
        module, _, builder = spec.partition(":")
        assert ROOMS.index(room(module)) > ROOMS.index("doctor"), spec
        assert callable(getattr(importlib.import_module(module), builder)), spec


MOST_LINES = 600  # a source file a reader can hold


def test_no_source_file_is_over_600_lines():
    lines = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in ("rcnn", "pipeline")
        for path in (ROOT / folder).rglob("*.py")
    }
    assert {path: count for path, count in lines.items() if count > MOST_LINES} == {}


# In a fresh interpreter (forked warm: torch loaded, nothing of this project): the runner imported and a trial
# of a torchvision model run load no module of the detector's room; the bench's command for that model loads
# only the detector's torch-free rules.
ANY_MODEL_ALONE = """
import sys
import torch
from rcnn.measure.stats import TimingPolicy
from rcnn.trial.knobs import knobs_for
from rcnn.trial.models import run_model_trial
from rcnn.trial.runner import measure_trial

policy = TimingPolicy(warmup=1, max_warmup=1, iterations=2, max_iterations=2)
cpu = torch.device("cpu")
result = run_model_trial(
    "torchvision:squeezenet1_0", knobs_for(cpu, batch_size=1), image_size=32, device=cpu, policy=policy
)
assert result.iterations == 2, result
loaded = sorted(name for name in sys.modules if name.startswith("rcnn.detector"))
assert not loaded, loaded

from rcnn.bench import main  # the command: the detector's flags' rules (torch-free), nothing else of it

argv = ["--model", "torchvision:squeezenet1_0", "--image-size", "32", "--batch-size", "1", "--warmup", "1",
        "--iterations", "2", "--max-iterations", "2", "--device", "cpu"]
assert main(argv) == 0
loaded = sorted(name for name in sys.modules if name.startswith("rcnn.detector"))
assert loaded == ["rcnn.detector", "rcnn.detector.schema"], loaded
print("ok")
"""


@pytest.mark.slow  # two trials in a new process: seconds
def test_a_trial_of_any_model_loads_nothing_of_the_detector():
    out = launcher.run([sys.executable, "-c", ANY_MODEL_ALONE], cwd=ROOT)
    assert out.returncode == 0 and out.stdout.endswith("\nok\n"), out.stdout[-2000:] + out.stderr[-2000:]
