"""Faults of the disk and the params file: a journal cut inside its last record, a results folder that
cannot be written or is full, an empty params file, the mode of the files written. Each ends in one line
naming the file, a non-zero exit, and nothing measured lost or measured twice."""

import errno
import json
import os
import signal
import stat
import subprocess

import mlflow
import optuna
import pytest

from pipeline import data, env, sweep
from pipeline.common import run_stage, stage_parser
from pipeline.params import ParamsError
from pipeline.study import mend_journal
from rcnn import outputs
from tests.conftest import write_tiny_params
from tests.pipeline.helpers import prepare


def child_runs(folder):
    """The sweep's trial runs in ``folder``'s MLflow store, with their status."""
    mlflow.set_tracking_uri(f"sqlite:///{folder / 'mlflow.db'}")
    found = mlflow.search_runs(experiment_names=["test"])
    return found[found["tags.trial"].notna()] if "tags.trial" in found else found.iloc[:0]


def journal_lines(folder):
    return (folder / "optuna.journal").read_bytes().split(b"\n")


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A finished tiny sweep (2 trials), copied for each test that cuts or blocks its files."""
    folder = tmp_path_factory.mktemp("swept")
    args = prepare(folder, lambda override: write_tiny_params(folder, override), None)
    assert sweep.main(args) == 0
    return folder, args


def copy_of(swept, tmp_path):
    """The swept folder copied to ``tmp_path`` (its params' paths rewritten), and its sweep arguments."""
    folder, args = swept
    subprocess.run(["cp", "-a", f"{folder}/.", str(tmp_path)], check=True)
    params = tmp_path / "params.yaml"
    params.write_text(params.read_text().replace(str(folder), str(tmp_path)))
    return [a.replace(str(folder), str(tmp_path)) for a in args]


@pytest.mark.slow
def test_a_journal_cut_in_its_last_record_is_mended_before_the_rerun_appends(swept, tmp_path, capsys):
    args = copy_of(swept, tmp_path)
    journal = tmp_path / "optuna.journal"
    whole = journal.read_bytes()
    complete_before = (tmp_path / "trials.csv").read_text()
    runs_before = len(child_runs(tmp_path))
    cut = whole[: len(whole) - len(journal_lines(tmp_path)[-2]) // 2 - 1]  # half of the last record gone
    journal.write_bytes(cut)
    capsys.readouterr()

    assert sweep.main(args) == 0
    out = capsys.readouterr().out
    copies = list(tmp_path.glob("optuna.journal.torn-*"))
    assert len(copies) == 1 and copies[0].read_bytes() == cut  # the file as it was, kept
    assert f"{journal}: its last record was cut" in out and str(copies[0]) in out
    # Every line now a record (the rerun appended after a whole line, not onto the torn one), and the study
    # still holds both trials complete: nothing measured again.
    assert all(json.loads(line) for line in journal_lines(tmp_path)[:-1])
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    assert [t.state for t in study.trials].count(optuna.trial.TrialState.COMPLETE) == 2
    assert len(child_runs(tmp_path)) == runs_before
    assert (tmp_path / "trials.csv").read_text() == complete_before


def test_a_journal_damaged_before_its_end_stops_with_one_line_and_is_left_as_it_is(tmp_path):
    journal = tmp_path / "optuna.journal"
    damaged = b'{"op_code": 0}\nnot a record\n{"op_code": 1}\n'
    journal.write_bytes(damaged)
    with pytest.raises(ParamsError, match=r"optuna.journal line 2 is not a journal record"):
        mend_journal(journal)
    assert journal.read_bytes() == damaged and not list(tmp_path.glob("*.torn-*"))


@pytest.mark.parametrize(
    "content, kept",
    [
        (b'{"op_code": 0}\n{"op_code": 1}\n', None),  # whole: left alone
        (b'{"op_code": 0}\n{"op_co', b'{"op_code": 0}\n'),  # cut inside its last record
        (
            b'{"op_code": 0}\n{"op_code": 1}',
            b'{"op_code": 0}\n{"op_code": 1}\n',
        ),  # only its newline unwritten
        (b'{"op_code": 0}\n\x00\x00\x00\x00', b'{"op_code": 0}\n'),  # zeros a crash left at the end
        (b'{"op_co', b""),  # its only record cut
    ],
)
def test_mend_journal_drops_exactly_the_torn_record_or_completes_its_newline(tmp_path, content, kept):
    journal = tmp_path / "optuna.journal"
    journal.write_bytes(content)
    said = mend_journal(journal)
    assert journal.read_bytes() == (content if kept is None else kept)
    assert (said is None) == (kept is None)
    assert [p.read_bytes() for p in tmp_path.glob("optuna.journal.torn-*")] == (
        [] if kept is None else [content]
    )


def test_two_mends_keep_two_copies(tmp_path):
    journal = tmp_path / "optuna.journal"
    for torn in (b'{"op_code": 0}\n{"a', b'{"op_code": 0}\n{"b'):
        journal.write_bytes(torn)
        mend_journal(journal)
    assert sorted(p.read_bytes() for p in tmp_path.glob("optuna.journal.torn-*")) == [
        b'{"op_code": 0}\n{"a',
        b'{"op_code": 0}\n{"b',
    ]


def fail_replacing(monkeypatch, name, code):
    """os.replace onto ``name`` raises OSError ``code``, as a full disk or an immutable file makes it."""
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if os.path.basename(dst) == name:
            raise OSError(code, os.strerror(code), str(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(outputs.os, "replace", replace)


def fail_writing(monkeypatch, name, code):
    """Writing the temporary file of ``name`` raises OSError ``code`` (ENOSPC: a disk that filled)."""
    real = outputs.os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise OSError(code, os.strerror(code))

    def fdopen(fd, *args, **kwargs):
        f = real(fd, *args, **kwargs)
        return Full(f) if f"{name}." in os.readlink(f"/proc/self/fd/{fd}") else f

    monkeypatch.setattr(outputs.os, "fdopen", fdopen)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, code",
    [(fail_replacing, errno.EPERM), (fail_writing, errno.ENOSPC)],
    ids=["immutable-file", "disk-full"],
)
def test_a_results_file_that_cannot_be_written_stops_with_one_line_and_the_rerun_measures_nothing(
    swept, tmp_path, capsys, monkeypatch, fault, code
):
    args = copy_of(swept, tmp_path)
    earlier = (tmp_path / "trials.csv").read_text()
    runs_before = len(child_runs(tmp_path))
    with monkeypatch.context() as patch:
        fault(patch, "trials.csv", code)
        capsys.readouterr()
        assert sweep.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {tmp_path / 'trials.csv'}: cannot write it (errno {code}, {os.strerror(code)}); the file as "
        "it was is untouched"
    ]
    assert (tmp_path / "trials.csv").read_text() == earlier
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".trials.csv.")]  # no temporary file left
    assert sweep.main(args) == 0  # the fault gone, the tables written from the study
    assert len(child_runs(tmp_path)) == runs_before  # nothing measured again
    assert child_runs(tmp_path)["status"].eq("FINISHED").all()


@pytest.mark.slow
def test_a_results_file_marked_immutable_is_refused_before_measuring(tmp_path, tiny_params, capsys):
    args = prepare(tmp_path, tiny_params, None)
    trials = tmp_path / "trials.csv"
    trials.write_text("trial,status,mlflow_run_id\n")
    if subprocess.run(["chattr", "+i", str(trials)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem (or user) cannot mark a file immutable")
    try:
        capsys.readouterr()
        assert sweep.main(args) == 2
    finally:
        subprocess.run(["chattr", "-i", str(trials)], check=True)
    assert capsys.readouterr().err.strip() == (
        f"error: {trials}: marked immutable or append-only (chattr +i or +a); allowed: a file it may replace"
    )
    assert not (tmp_path / "optuna.journal").exists()  # refused before the study was opened


@pytest.mark.slow
def test_a_full_filesystem_is_refused_before_measuring(tmp_path, tiny_params, capsys, monkeypatch):
    args = prepare(tmp_path, tiny_params, None)
    real = outputs.shutil.disk_usage
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: real(path)._replace(free=3 * 2**20))
    capsys.readouterr()
    assert sweep.main(args) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'trials.csv'}: 3 MB free on its filesystem; allowed: at least "
        f"{outputs.MIN_FREE_MB} MB free"
    )
    assert not (tmp_path / "optuna.journal").exists()


@pytest.mark.parametrize(
    "text, problem",
    [
        ("", "empty"),
        ("# only a comment\n", "empty"),
        ("- env\n- data\n", "a YAML list"),
        ("42\n", "a YAML int"),
    ],
)
@pytest.mark.parametrize("stage", [env, data, sweep])
def test_an_empty_or_non_mapping_params_file_stops_every_stage_with_one_line(
    tmp_path, capsys, stage, text, problem
):
    params = tmp_path / "params.yaml"
    params.write_text(text)
    extra = {
        env: ["--out", str(tmp_path / "env.json")],
        data: ["--out", str(tmp_path / "data")],
        sweep: [
            *("--data", str(tmp_path / "data"), "--env", str(tmp_path / "env.json")),
            *(a for k in ("trials", "comparisons", "kernels", "modules", "summary") for a in (f"--{k}", k)),
        ],
    }[stage]
    capsys.readouterr()
    assert stage.main(["--params", str(params), *extra]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {params}: {problem}; allowed: a mapping of sections (env, data, sweep, ...), as the "
        "project's params.yaml"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # nothing written


@pytest.mark.slow
def test_files_written_get_the_mode_the_umask_gives(swept, tmp_path):
    folder, _ = swept
    mask = os.umask(0o027)
    try:
        outputs.write_atomic(tmp_path / "a.csv", "x\n")
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "a.csv").stat().st_mode) == 0o640
    expected = 0o666 & ~mask
    for name in ("trials.csv", "comparisons.csv", "summary.json", "env.json", "data/annotations.json"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == expected, name


def test_sigterm_outside_the_trials_ends_a_stage_with_one_line(tmp_path, tiny_params, capsys):
    """Anywhere in a stage (here its body, not a trial) SIGTERM ends it as Ctrl-C would: a line, exit 143."""

    def body(args, params):
        signal.raise_signal(signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the stage")

    capsys.readouterr()
    assert run_stage(body, stage_parser(None), ["--params", str(tiny_params())]) == 143
    assert capsys.readouterr().err.strip() == "terminated"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the stage's handler gone with it
