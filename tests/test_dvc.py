"""dvc.yaml: each stage depends on every file of this project its command imports, computed from the code, so
DVC reruns a stage whenever code it runs changes."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, copy_project
from tests.imports import import_closure, module_file

STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def stage_module(stage: dict) -> str:
    cmd = " ".join(stage["cmd"]) if isinstance(stage["cmd"], list) else stage["cmd"]
    found = re.findall(r"\bpython -m ([\w.]+)", cmd)
    assert len(found) == 1, f"expected one 'python -m <module>' in {cmd!r}"
    return found[0]


def dep_paths(stage: dict) -> list[str]:
    return [dep if isinstance(dep, str) else next(iter(dep)) for dep in stage.get("deps", [])]


def covered(path: str, deps: list[str]) -> bool:
    """Whether a dep names the file or a folder above it."""
    return any(path == dep.rstrip("/") or path.startswith(dep.rstrip("/") + "/") for dep in deps)


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_stage_depends_on_every_file_its_command_imports(stage):
    module = stage_module(STAGES[stage])
    closure = import_closure(module)
    assert module_file(module) is not None, f"stage {stage}: {module} is not a module of this project"
    missing = sorted(path for path in closure if not covered(path, dep_paths(STAGES[stage])))
    assert not missing, (
        f"stage {stage} (python -m {module}) imports files its deps in dvc.yaml do not cover: "
        + ", ".join(missing)
    )


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_stage_lists_no_source_file_it_does_not_import(stage):
    """A listed module the stage does not run would rerun it for nothing (a folder may hold more)."""
    closure = import_closure(stage_module(STAGES[stage]))
    stale = [dep for dep in dep_paths(STAGES[stage]) if dep.endswith(".py") and dep not in closure]
    assert not stale, f"stage {stage} lists files its command does not import: {', '.join(stale)}"


def test_the_closure_follows_every_import_form(tmp_path, monkeypatch):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    files = {
        "pkg/__init__.py": "",
        "pkg/main.py": "import pkg.a\nfrom pkg import b\nfrom . import c\n"
        "def f():\n    from .sub.d import x\n",
        "pkg/a.py": "import os\n",
        "pkg/b.py": "from .sub import e\n",
        "pkg/c.py": "",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "x = 1\n",
        "pkg/sub/e.py": "",
        "pkg/unused.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr("tests.imports.ROOT", tmp_path)
    assert import_closure("pkg.main") == set(files) - {"pkg/unused.py"}


def scratch_project(folder: Path) -> Path:
    """A copy of the project's files (tracked or new, not ignored) as a new git repository with one commit,
    the tiny params and the .venv linked in."""
    copy_project(folder)
    (folder / ".venv").symlink_to(ROOT / ".venv")
    for argv in (
        ["init", "-q"],
        ["config", "user.name", "test"],
        ["config", "user.email", "test@example.com"],
        ["add", "-A"],
        ["commit", "-q", "-m", "tiny params"],
    ):
        subprocess.run(["git", *argv], cwd=folder, check=True)
    # A link: .gitignore's /.venv/ names a folder
    (folder / ".git" / "info" / "exclude").write_text(".venv\n")
    return folder


def experiments(shown: list[dict]) -> list[dict]:
    """The experiments' data in ``dvc exp show --json``: under each baseline commit, not the workspace."""
    return [
        rev["data"]
        for commit in shown
        if commit.get("rev") != "workspace"
        for exp in commit.get("experiments") or []
        for rev in exp["revs"]
    ]


def scalars(value: dict, prefix: str = "") -> dict:
    """A metrics file as dvc shows it: its numbers, strings and booleans by key path (nulls and lists left
    out)."""
    flat = {}
    for key, item in value.items():
        if isinstance(item, dict):
            flat |= scalars(item, f"{prefix}{key}.")
        elif isinstance(item, (int, float, str, bool)):
            flat[f"{prefix}{key}"] = item
    return flat


@pytest.mark.slow  # dvc exp run of the pipeline on a scratch copy, then the env stage again
def test_the_readme_experiment_command_on_a_models_spec_reports_in_its_own_folder_and_exp_show_lists_it(
    tmp_path,
):
    line = next(
        line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("make exp ")
    )
    target, args = shlex.split(line, comments=True)[1:]
    assert target == "exp" and args.startswith("ARGS=-S "), line
    project = scratch_project(tmp_path / "project")
    # The README's command with the changes the tiny grid runs, on a model's spec (one experiment, not two:
    # each runs the whole pipeline); the head left as it is. -o: never rebuild the shared .venv from here.
    spec, heads = "tests.fixtures.models:pooled", "[linear, conv, conv_as_linear]"
    overrides = f"-S 'sweep.space.batch_size=[1]' -S model={spec} -S 'sweep.space.head={heads}'"
    argv = ["make", "-o", ".venv/bin/.installed", target, f"ARGS={overrides}"]
    result = subprocess.run(argv, cwd=project, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (project / "reports" / "tests.fixtures.models-pooled" / "report.md").exists()
    unchanged = subprocess.run(["git", "status", "--porcelain", "reports"], cwd=project, capture_output=True)
    assert unchanged.stdout.decode().splitlines() == ["?? reports/tests.fixtures.models-pooled/"]

    shown = subprocess.run(
        [".venv/bin/dvc", "exp", "show", "--json"], cwd=project, capture_output=True, text=True, check=True
    )
    summary = json.loads((project / "results" / "summary.json").read_text())
    runs = experiments(json.loads(shown.stdout))
    assert len(runs) == 1, shown.stdout
    params = runs[0]["params"]["params.yaml"]["data"]
    assert params["sweep"]["space"]["batch_size"] == [1] and params["model"] == spec
    assert summary and scalars(runs[0]["metrics"]["results/summary.json"]["data"]) == scalars(summary)

    # Editing the factory's module changes env.json's model_code, a params key of the sweep stage.
    with open(project / "tests" / "fixtures" / "models.py", "a") as module:
        module.write("\n# edited\n")
    bin_ = project / ".venv" / "bin"  # first on PATH, as make puts it: the stages run `python`
    env = os.environ | {"PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(
        [bin_ / "dvc", "repro", "env"], cwd=project, env=env, capture_output=True, check=True, timeout=300
    )
    status = subprocess.run(
        [bin_ / "dvc", "status", "sweep"], cwd=project, env=env, capture_output=True, text=True, check=True
    )
    assert "model_code" in status.stdout, status.stdout
