"""Confined writes, catalogued: each bad path, run through the real command line in a scratch copy of the
project (its .git included), stops with exit 2 and one line, and leaves every file of the project and of a
sentinel folder next to it exactly as it was."""

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.run import stage_commands
from tests import launcher
from tests.conftest import ROOT, copy_project, merged

SECRET = "s3cr3t-pw"


def tree_digest(*folders: Path) -> dict[str, str]:
    """Every file, folder and link under ``folders``: path -> content hash (or kind)."""
    digest = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            key = str(path)
            if path.is_symlink():
                digest[key] = f"link -> {os.readlink(path)}"
            elif path.is_dir():
                digest[key] = "folder"
            else:
                digest[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A copy of the project as a new user has it (its files, tracked or new, and .git) with tiny params, the
    data and env stages run once; and a sentinel folder beside it."""
    base = tmp_path_factory.mktemp("confined")
    project = copy_project(base / "project")
    shutil.copytree(ROOT / ".git", project / ".git")
    sentinel = base / "sentinel"
    (sentinel / "keep").mkdir(parents=True)
    (sentinel / "keep" / "work.txt").write_text("uncommitted work\n")
    (sentinel / "img.png").write_bytes((project / "reports" / "figures" / "pareto.png").read_bytes())
    for stage in ("env", "data"):
        assert run(project, stage_argv(project, stage)).returncode == 0
    return project


def stage_argv(project: Path, stage: str) -> list[str]:
    """The stage's command exactly as dvc.yaml (filled from the project's params) has DVC run it."""
    raw = yaml.safe_load((project / "params.yaml").read_text())
    dvc_yaml = yaml.safe_load((project / "dvc.yaml").read_text())
    return shlex.split(dict(stage_commands(dvc_yaml, raw))[stage])


def run(project: Path, argv: list[str]) -> subprocess.CompletedProcess:
    assert argv[0] == "python"
    env = os.environ | {"PYTHONDONTWRITEBYTECODE": "1"}  # no __pycache__: every file must stay as it was
    return launcher.run([sys.executable, *argv[1:]], cwd=project, env=env, timeout=300)  # forked warm


def with_arg(argv: list[str], flag: str, value: str) -> list[str]:
    return argv[: argv.index(flag) + 1] + [value] + argv[argv.index(flag) + 2 :]


def coco_folder(project: Path, file_name: str, link: Path | None = None) -> None:
    folder = project / "coco"
    folder.mkdir(exist_ok=True)
    if link is not None:
        (folder / file_name).unlink(missing_ok=True)
        (folder / file_name).symlink_to(link)
    (folder / "annotations.json").write_text(
        json.dumps(
            {
                "images": [{"id": 1, "file_name": file_name, "width": 64, "height": 64}],
                "annotations": [
                    {"id": 1, "image_id": 1, "category_id": 1, "bbox": [4, 4, 20, 20], "iscrowd": 0}
                ],
                "categories": [{"id": 1, "name": "a"}],
            }
        )
    )


def crowd_only(project: Path) -> None:
    coco_folder(project, "img.png")
    (project / "coco" / "img.png").write_bytes((project.parent / "sentinel" / "img.png").read_bytes())
    coco = json.loads((project / "coco" / "annotations.json").read_text())
    coco["annotations"][0]["iscrowd"] = 1
    (project / "coco" / "annotations.json").write_text(json.dumps(coco))


def users_owner_file(project: Path) -> None:
    (project / "notes").mkdir(exist_ok=True)
    (project / "notes" / "optuna.journal.owner").write_text("who owns what: my notes\n")


def user_report(project: Path) -> None:
    (project / "notes").mkdir(exist_ok=True)
    (project / "notes" / "report.md").write_text("# My notes\n")


SENTINEL = "../sentinel"
# id, the command (a dvc.yaml stage, with params override and argument replacements, or a plain argv),
# what is set up first, and what the one line must say.
CASES = [
    (
        "data-name-parent",
        ("data", {"data": {"name": "../../sentinel"}}, {}),
        None,
        "data.name: '../../sentinel' is not a plain folder name",
    ),
    (
        "data-name-absolute",
        ("data", {"data": {"name": "/tmp"}}, {}),
        None,
        "data.name: '/tmp' is not a plain",
    ),
    (
        "data-name-dot",
        ("data", {"data": {"name": "."}}, {}),
        None,
        "data.name: '.' is not a plain folder name",
    ),
    (
        "data-out-outside",
        ("data", {}, {"--out": SENTINEL}),
        None,
        "--out: ../sentinel resolves outside the project",
    ),
    (
        "data-out-project-root",
        ("data", {}, {"--out": "."}),
        None,
        "--out: . holds files this command did not write",
    ),
    (
        "data-out-source-folder",
        ("data", {}, {"--out": "pipeline"}),
        None,
        "--out: pipeline holds files this command",
    ),
    (
        "data-out-symlink-out",
        ("data", {}, {"--out": "data/link"}),
        lambda p: (p / "data" / "link").symlink_to(p.parent / "sentinel"),
        "--out: data/link resolves outside the project",
    ),
    (
        "data-source-is-output",
        ("data", {"data": {"source": "data/synthetic"}}, {}),
        None,
        "data.source: data/synthetic is the output folder itself",
    ),
    (
        "coco-file-name-parent",
        ("data", {"data": {"source": "coco", "name": "imported"}}, {}),
        lambda p: coco_folder(p, "../../sentinel/img.png"),
        "../../sentinel/img.png",
    ),
    (
        "coco-file-name-absolute",
        ("data", {"data": {"source": "coco", "name": "imported"}}, {}),
        lambda p: coco_folder(p, str(p.parent / "sentinel" / "img.png")),
        "sentinel/img.png",
    ),
    (
        "coco-file-name-symlink-out",
        ("data", {"data": {"source": "coco", "name": "imported"}}, {}),
        lambda p: coco_folder(p, "img.png", link=p.parent / "sentinel" / "img.png"),
        "img.png",
    ),
    (
        "coco-no-usable-image",
        ("data", {"data": {"source": "coco", "name": "imported"}}, {}),
        crowd_only,
        "no image has a usable box (1 crowd region",
    ),
    (
        "env-out-params",
        ("env", {}, {"--out": "params.yaml"}),
        None,
        "--out: params.yaml exists and is not an env.json this command wrote",
    ),
    ("env-out-outside", ("env", {}, {"--out": f"{SENTINEL}/env.json"}), None, "resolves outside the project"),
    (
        "storage-params-yaml",
        ("sweep", {"sweep": {"storage": "params.yaml"}}, {}),
        None,
        "sweep.storage: params.yaml exists and is not an Optuna journal this command wrote",
    ),
    (
        "storage-source-file",
        ("sweep", {"sweep": {"storage": "pipeline/sweep.py"}}, {}),
        None,
        "sweep.storage: pipeline/sweep.py exists and is not an Optuna journal",
    ),
    (
        "storage-empty-source-file",
        ("sweep", {"sweep": {"storage": "tests/__init__.py"}}, {}),
        None,
        "sweep.storage: tests/__init__.py exists and is not an Optuna journal",
    ),
    (
        "storage-lock-users-file",
        ("sweep", {"sweep": {"storage": "notes/optuna.journal"}}, {}),
        users_owner_file,
        "sweep.storage: notes/optuna.journal.owner exists and is not a journal's lock file",
    ),
    (
        "storage-sqlite-outside",
        ("sweep", {"sweep": {"storage": f"sqlite:///{SENTINEL}/optuna.db"}}, {}),
        None,
        "sweep.storage: ../sentinel/optuna.db resolves outside the project",
    ),
    (
        "storage-sqlite-params",
        ("sweep", {"sweep": {"storage": "sqlite:///params.yaml"}}, {}),
        None,
        "sweep.storage: params.yaml exists and is not an SQLite database",
    ),
    (
        "tracking-sqlite-outside",
        ("sweep", {"tracking": {"mlflow_uri": f"sqlite:///{SENTINEL}/mlflow.db"}}, {}),
        None,
        "tracking.mlflow_uri: ../sentinel/mlflow.db resolves outside the project",
    ),
    (
        "storage-outside",
        ("sweep", {"sweep": {"storage": f"{SENTINEL}/optuna.journal"}}, {}),
        None,
        "sweep.storage: ../sentinel/optuna.journal resolves outside the project",
    ),
    (
        "storage-password",
        ("sweep", {"sweep": {"storage": f"postgresql://u:{SECRET}@127.0.0.1:1/db"}}, {}),
        None,
        "sweep.storage: ",
    ),
    (
        "tracking-password",
        ("sweep", {"tracking": {"mlflow_uri": f"http://u:{SECRET}@127.0.0.1:1"}}, {}),
        None,
        "tracking.mlflow_uri: ",
    ),
    (
        "sweep-trials-dvc-yaml",
        ("sweep", {}, {"--trials": "dvc.yaml"}),
        None,
        "--trials: dvc.yaml exists and is not a results table this command wrote",
    ),
    (
        "sweep-kernels-source",
        ("sweep", {}, {"--kernels": "rcnn/heads.py"}),
        None,
        "--kernels: rcnn/heads.py exists and is not a results table",
    ),
    (
        "sweep-summary-outside",
        ("sweep", {}, {"--summary": f"{SENTINEL}/summary.json"}),
        None,
        "--summary: ../sentinel/summary.json resolves outside the project",
    ),
    (
        "report-out-outside",
        ("report", {}, {"--out": SENTINEL}),
        None,
        "--out: ../sentinel resolves outside the project",
    ),
    (
        "report-out-user-notes",
        ("report", {}, {"--out": "notes"}),
        user_report,
        "--out: notes/report.md exists and is not the report this command wrote",
    ),
    (
        "compare-out-outside",
        ["python", "-m", "pipeline.compare", "reports/h200", "reports/h200", "--out", SENTINEL],
        None,
        "--out: ../sentinel resolves outside the project",
    ),
    (  # the installed doctor runs anywhere: its --out may lie outside the project, never over foreign files
        "doctor-out-outside-foreign",
        ["python", "-m", "rcnn.doctor", "tests.fixtures.models:sleepy", "--out", SENTINEL],
        None,
        "--out: ../sentinel holds files this command did not write",
    ),
    (
        "doctor-out-source-folder",
        ["python", "-m", "rcnn.doctor", "tests.fixtures.models:sleepy", "--out", "rcnn"],
        None,
        "--out: rcnn holds files this command did not write",
    ),
    (
        "run-workdir-project",
        ["python", "-m", "pipeline.run", "--params", "params.yaml", "--workdir", "."],
        None,
        "--workdir: . is not empty and was not made by pipeline.run",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("command, setup, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_path_stops_with_one_line_and_touches_nothing(scratch, command, setup, message):
    if setup:
        setup(scratch)
    params = scratch / "params.yaml"
    good = params.read_text()
    argv = command
    if isinstance(command, tuple):
        stage, override, replaced = command
        params.write_text(yaml.safe_dump(merged(yaml.safe_load(good), override)))
        argv = stage_argv(scratch, stage)
        for flag, value in replaced.items():
            argv = with_arg(argv, flag, value)
    before = tree_digest(scratch, scratch.parent / "sentinel")
    try:
        result = run(scratch, argv)
        after = tree_digest(scratch, scratch.parent / "sentinel")
    finally:
        params.write_text(good)

    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr, result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert after == before


def test_every_stage_and_path_param_has_a_case():
    """A new stage in dvc.yaml, or a path-like param, comes with its bad-path case."""
    stages = set(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    covered = {c[1][0] for c in CASES if isinstance(c[1], tuple)}
    assert stages <= covered, f"stages without a case: {sorted(stages - covered)}"
    overridden = {
        f"{section}.{key}"
        for c in CASES
        if isinstance(c[1], tuple)
        for section, values in c[1][1].items()
        for key in values
    }
    assert {"data.name", "data.source", "sweep.storage"} <= overridden
