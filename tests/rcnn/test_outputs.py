"""Where a command may write: inside the project, over nothing it did not write."""

import re

import pytest

from pipeline.study import JOURNAL, OWNER, owner_of
from rcnn.outputs import (
    CSV,
    PNG,
    SQLITE,
    OutputError,
    check_folder,
    check_output,
    check_sqlite_url,
    claim_folder,
    csv_with,
    json_object,
    project_root,
    text_start,
)


def test_project_is_the_nearest_folder_with_dvc_yaml(tmp_path):
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "presets" / "deep").mkdir(parents=True)
    assert project_root(tmp_path / "presets" / "deep") == tmp_path.resolve()
    lone = tmp_path.parent / f"{tmp_path.name}-lone"
    lone.mkdir()
    assert project_root(lone) == lone.resolve()


def test_outputs_outside_the_project_are_refused_symlinks_followed(tmp_path):
    root = tmp_path / "project"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")
    for path in (tmp_path / "elsewhere" / "t.csv", root / ".." / "t.csv", root / "link" / "t.csv"):
        with pytest.raises(OutputError, match="resolves outside the project"):
            check_output(path, CSV, root=root.resolve(), what="--trials")
    assert (
        check_output(root / "new" / "t.csv", CSV, root=root.resolve(), what="--trials")
        == root.resolve() / "new" / "t.csv"
    )


@pytest.mark.parametrize(
    "kind, ours, foreign",
    [
        (csv_with("trial", "status"), "trial,status,x\n1,complete,2\n", "stages:\n  a: {}\n"),
        (json_object("a summary", "trials"), '{\n  "trials": 3\n}\n', '{"other": 1}'),
        (text_start("the report", "# Why"), "# Why it is slow\n", "# Notes\n"),
        (JOURNAL, '{"op_code": 0, "worker_id": "a"}\n', "data:\n  name: x\n"),
        (OWNER, "pid 12 on host, since 2026-01-01 00:00:00\n", "my notes\n"),
        (SQLITE, "SQLite format 3\0...", "a,b\n"),
        (CSV, "a,b\n1,2\n", "just text\n"),
    ],
)
def test_an_existing_file_is_replaced_only_if_it_has_the_layout_written(tmp_path, kind, ours, foreign):
    (tmp_path / "ours").write_text(ours)
    (tmp_path / "foreign").write_text(foreign)
    check_output(tmp_path / "ours", kind, root=tmp_path, what="--x")
    with pytest.raises(OutputError, match=r"^--x: .*foreign exists and is not .* this command wrote"):
        check_output(tmp_path / "foreign", kind, root=tmp_path, what="--x")


def test_an_empty_journal_is_ours_only_beside_its_lock_file(tmp_path):
    # Optuna creates the journal empty; the stage took the lock beside it first. An empty source file
    # (a package's __init__.py) has no lock beside it.
    (tmp_path / "__init__.py").write_text("")
    with pytest.raises(OutputError, match="__init__.py exists and is not an Optuna journal"):
        check_output(tmp_path / "__init__.py", JOURNAL, root=tmp_path, what="sweep.storage")
    (tmp_path / "optuna.journal").write_text("")
    owner_of(tmp_path / "optuna.journal").write_text("pid 1 on host, since 2026-01-01 00:00:00\n")
    check_output(tmp_path / "optuna.journal", JOURNAL, root=tmp_path, what="sweep.storage")


@pytest.mark.parametrize(
    "url, problem",
    [
        ("sqlite:///../elsewhere.db", "resolves outside the project"),
        ("sqlite:///notes.txt", "notes.txt exists and is not an SQLite database"),
        ("sqlite+pysqlite:///notes.txt?timeout=5", "notes.txt exists and is not an SQLite database"),
        ("sqlite:///mlflow.db", None),
        ("postgresql://u@host/db", None),  # a server: nothing is written here
        ("http://127.0.0.1:5000", None),
    ],
)
def test_sqlite_urls_are_output_paths(tmp_path, monkeypatch, url, problem):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine\n")
    if problem:
        with pytest.raises(OutputError, match=problem):
            check_sqlite_url(url, root=tmp_path.resolve(), what="tracking.mlflow_uri")
    else:
        check_sqlite_url(url, root=tmp_path.resolve(), what="tracking.mlflow_uri")


def test_png_and_folders(tmp_path):
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n....")
    check_folder(tmp_path, {"figures/a.png": PNG, "report.md": CSV}, root=tmp_path, what="--out")
    (tmp_path / "figures" / "a.png").write_text("a,b\n")
    with pytest.raises(OutputError, match="a.png exists and is not a PNG image"):
        check_folder(tmp_path, {"figures/a.png": PNG}, root=tmp_path, what="--out")
    with pytest.raises(OutputError, match="is a folder"):
        check_output(tmp_path / "figures", CSV, root=tmp_path, what="--out")


def test_a_folder_is_claimed_only_when_it_holds_what_the_command_writes(tmp_path):
    owned = re.compile(r"\d{6}\.png|annotations\.json")
    data = tmp_path / "data"
    assert claim_folder(data, owned, root=tmp_path, what="--out") == []  # absent
    data.mkdir()
    assert claim_folder(data, owned, root=tmp_path, what="--out") == []  # empty
    (data / "000000.png").write_bytes(b"")
    (data / "annotations.json").write_text("{}")
    assert sorted(p.name for p in claim_folder(data, owned, root=tmp_path, what="--out")) == [
        "000000.png",
        "annotations.json",
    ]
    for foreign in ("notes.txt", "sub/"):
        (data / foreign.rstrip("/")).mkdir() if foreign.endswith("/") else (data / foreign).write_text("mine")
        with pytest.raises(
            OutputError, match=rf"holds files this command did not write \({foreign.rstrip('/')}\)"
        ):
            claim_folder(data, owned, root=tmp_path, what="--out")
        path = data / foreign.rstrip("/")
        path.rmdir() if path.is_dir() else path.unlink()
    (data / "000001.png").symlink_to(tmp_path / "x.png")  # a name it writes, but a link it never made
    with pytest.raises(OutputError, match="000001.png"):
        claim_folder(data, owned, root=tmp_path, what="--out")


def test_without_a_root_a_folder_anywhere_is_claimed_by_the_same_rules(tmp_path):
    owned = re.compile(r"modules\.csv")
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    with pytest.raises(OutputError, match="resolves outside the project"):
        claim_folder(elsewhere, owned, root=project, what="--out")
    assert claim_folder(elsewhere, owned, what="--out") == []  # absent: allowed anywhere
    elsewhere.mkdir()
    (elsewhere / "modules.csv").write_text("module\n")
    assert [p.name for p in claim_folder(elsewhere, owned, what="--out")] == ["modules.csv"]
    (elsewhere / "thesis.tex").write_text("mine")
    with pytest.raises(OutputError, match=r"holds files this command did not write \(thesis.tex\)"):
        claim_folder(elsewhere, owned, what="--out")
