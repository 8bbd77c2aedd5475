import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from rcnn.doctor.columns import MODULE_COLUMNS, OUTSIDE
from rcnn.doctor.ranks import BALANCED_WITHIN, RANK_COLUMNS, RanksView, _union_ms
from tests import launcher
from tests.conftest import ROOT
from tests.rcnn.doctor.ranks_worker import EXTRA_S
from tests.services import free_port

EXTRA_MS = EXTRA_S * 1e3


def _record(rank: int, tails: list[float], *, backward: float = 50.0, slow_ms: float = 0.0) -> dict:
    """One rank's gathered tables: steps of forward 5 ms and ``backward`` ms with these tails, and two
    modules, ``slow`` taking ``slow_ms`` more of its own backward."""
    steps = pd.DataFrame(
        {
            "forward_ms": 5.0,
            "backward_ms": backward,
            "tail_ms": tails,
            "reduce_ms": 3.0,
            "buckets": 1,
        }
    )
    modules = pd.DataFrame(
        {
            "calls": [1, 1, 0],
            "forward_ms": [1.0, 1.0, 3.0],
            "forward_inclusive_ms": [1.0, 1.0, 3.0],
            "backward_ms": [10.0, 10.0 + slow_ms, 5.0],
            "backward_inclusive_ms": [10.0, 10.0 + slow_ms, 5.0],
            "backward_cpu_ms": [10.0, 10.0, 5.0],
        },
        index=pd.Index(["fast", "slow", OUTSIDE], name="module"),
    )
    return {"rank": rank, "steps": steps, "modules": modules, "cores": {"core_waited": 0.01}}


def _noisy(value: float, n: int = 12) -> list[float]:
    return [value * (1 + 0.01 * ((i * 7) % 5 - 2)) for i in range(n)]


def test_the_step_splits_into_compute_communication_and_wait_and_the_straggler_is_named():
    # Rank 1 computes 40 ms longer: rank 0 waits 40 ms more at the end of its backward; both pay 2 ms of
    # transfer, the tail of the last one to arrive.
    view = RanksView.of(
        [_record(0, _noisy(42.0)), _record(1, _noisy(2.0), slow_ms=40.0)], backend="gloo", untimed=""
    )
    table = view.table.set_index("rank")
    assert list(view.table.columns) == list(RANK_COLUMNS)
    parts = table["compute_ms"] + table["communication_ms"] + table["wait_ms"]
    assert parts.to_numpy() == pytest.approx(table["step_ms"].to_numpy(), rel=0.05)
    assert table.loc[1, "wait_ms"] == 0 and table.loc[0, "wait_ms"] == pytest.approx(40.0, rel=0.05)
    assert table.loc[0, "communication_ms"] == pytest.approx(2.0, rel=0.05)
    s = view.summary
    assert (s["straggler"], s["module"]) == (1, "slow") and s["extra_ms"] == pytest.approx(40.0)
    assert s["ci_low"] > BALANCED_WITHIN
    assert (
        s["verdict"].startswith("Straggler: rank 1 computes")
        and "most of it in slow (+40.0 ms" in s["verdict"]
    )
    assert "rank 0 waits 40" in s["verdict"]
    spread = view.spread()
    assert spread.iloc[0]["module"] == "slow" and spread.iloc[0]["slowest_rank"] == 1
    assert OUTSIDE not in set(spread["module"])  # it holds the wait, not work


def test_a_straggler_whose_cores_were_shared_is_said_to_be_perhaps_the_machines():
    slow = _record(1, _noisy(2.0), slow_ms=40.0) | {"cores": {"core_waited": 0.4}}
    view = RanksView.of([_record(0, _noisy(42.0)), slow], backend="gloo", untimed="")
    assert view.summary["straggler"] == 1
    assert (
        "But rank 1's cores were shared (the threads waited 40% of their core time" in view.summary["verdict"]
    )
    assert view.table.set_index("rank")["cores_shared"].tolist()[0] == ""
    assert "rank 1's cores were shared: the threads waited 40%" in "\n".join(view.lines())


def test_balanced_ranks_name_no_straggler_and_too_few_steps_decide_nothing():
    balanced = RanksView.of([_record(0, _noisy(2.0)), _record(1, _noisy(2.0))], backend="gloo", untimed="")
    assert balanced.summary["straggler"] is None
    assert balanced.summary["verdict"].startswith("The ranks are balanced")
    few = RanksView.of([_record(0, [2.0, 9.0]), _record(1, [9.0, 2.0])], backend="gloo", untimed="")
    assert few.summary["straggler"] is None and math.isnan(few.summary["ci_low"])
    assert few.summary["verdict"].startswith("No straggler shown")


def test_ranks_that_compute_alike_but_wait_are_told_the_delay_lies_outside_the_steps():
    # rank 1 is late by 40 ms every step, but not in its forward or backward (its optimizer step, say)
    late = RanksView.of(
        [_record(0, _noisy(42.0), backward=90.0), _record(1, _noisy(2.0))], backend="gloo", untimed=""
    )
    verdict = late.summary["verdict"]
    assert late.summary["straggler"] is None and "Yet rank 0 waits 4" in verdict
    assert "outside the timed forward and backward" in verdict


def test_every_ranks_rows_carry_their_own_times_and_rank_0s_flags_alone():
    view = RanksView.of(
        [_record(0, _noisy(42.0)), _record(1, _noisy(2.0), slow_ms=40.0)], backend="gloo", untimed=""
    )
    leader = pd.DataFrame(
        {column: [math.nan] * 3 for column in MODULE_COLUMNS if column != "module"}
        | {"module": ["fast", "slow", OUTSIDE], "type": ["Linear", "Linear", ""], "flag": ["x", "", ""]}
    )[list(MODULE_COLUMNS)]
    leader[["backward_ms", "backward_gflop"]] = [[10.0, 1.0], [10.0, 1.0], [5.0, 0.0]]
    rows = view.by_module(leader, peak_tflops=1.0)
    assert list(rows.columns) == ["module", "rank", *MODULE_COLUMNS[1:]]
    theirs = rows[rows["rank"] == 1].set_index("module")
    assert theirs.loc["slow", "backward_ms"] == 50.0 and theirs.loc["fast", "flag"] == ""
    assert theirs["backward_share"].sum() == pytest.approx(1)
    assert theirs.loc["slow", "peak_fraction"] == pytest.approx(1.0 / 50.0)
    assert rows[rows["rank"] == 0].set_index("module").loc["fast", "flag"] == "x"
    # another rank's module faster than rank 0's ceiling raises it for every row: no fraction above 1
    raised = view.by_module(leader, peak_tflops=0.05).set_index(["rank", "module"])["peak_fraction"]
    assert raised.max() == pytest.approx(1.0)
    assert raised[(1, "fast")] == pytest.approx(1.0) and raised[(0, "fast")] == pytest.approx(1.0)
    assert raised[(1, "slow")] == pytest.approx(0.02 / 0.1)


def test_the_buckets_in_flight_are_counted_once_where_they_overlap():
    assert _union_ms([(0.0, 0.010), (0.005, 0.020), (0.030, 0.031)]) == pytest.approx(21.0)
    assert _union_ms([]) == 0


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """Two gloo ranks through the cases of tests/rcnn/doctor/ranks_worker.py: what each rank saw."""
    out = tmp_path_factory.mktemp("ranks")
    cases = [
        "straggler",
        "balanced",
        "inner",
        "accumulation",
        "unused",
        "static",
        "differ",
        "options",
        "same",
    ]
    cases.append("own_hook")
    done = launcher.run(
        [sys.executable, "-m", "tests.rcnn.doctor.ranks_worker", str(free_port()), str(out), *cases],
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _ranks(folder: Path) -> pd.DataFrame:
    return pd.read_csv(folder / "rank0" / "ranks.csv").set_index("rank")


@pytest.mark.slow  # two processes
@pytest.mark.parametrize("case", ["straggler", "inner", "unused", "static"])
def test_a_slow_module_on_rank_1_is_named_and_rank_0_waits_about_its_extra_work(two_ranks, case):
    folder = two_ranks / case
    assert not list(folder.glob("rank*/error.txt"))
    ranks = _ranks(folder)
    assert ranks.loc[0, "wait_ms"] == pytest.approx(EXTRA_MS, rel=0.4)
    assert ranks.loc[1, "wait_ms"] < 0.2 * EXTRA_MS
    parts = ranks["compute_ms"] + ranks["communication_ms"] + ranks["wait_ms"]
    assert parts.to_numpy() == pytest.approx(ranks["step_ms"].to_numpy(), rel=0.05)
    assert (ranks["reduce_ms"] > 0).all() and (ranks["buckets"] == 1).all()
    report = (folder / "rank0" / "report.txt").read_text()
    assert "Straggler: rank 1 computes" in report and "most of it in 2 (+" in report  # 2: the Slowed layer
    assert "(DistributedDataParallel, rank 0 of 2)" in report
    table = pd.read_csv(folder / "rank0" / "table.csv")
    assert set(table["rank"]) == {0, 1} and table.columns[1] == "rank"
    saved = json.loads((folder / "rank0" / "written.json").read_text())
    assert {"modules.csv", "ranks.csv", "report.html"} <= set(saved)
    page = (folder / "rank0" / "saved" / "report.html").read_text()
    assert 'id="rank-select"' in page and 'id="icicle-rank-1"' in page
    # rank 1 writes nothing unless asked; asked, its own files as one process would
    assert json.loads((folder / "rank1" / "written.json").read_text()) == []
    own = json.loads((folder / "rank1" / "own.json").read_text())
    assert "modules.csv" in own and "ranks.csv" not in own
    assert "rank 1 of 2" in (folder / "rank1" / "report.txt").read_text()


@pytest.mark.slow  # two processes
def test_balanced_ranks_have_no_straggler(two_ranks):
    report = (two_ranks / "balanced" / "rank0" / "report.txt").read_text()
    assert "Straggler:" not in report
    assert "The ranks are balanced: the slowest, rank " in report  # both sleep 20 ms: a noise of 1% at most
    assert _ranks(two_ranks / "balanced")["wait_ms"].max() < 0.2 * EXTRA_MS


@pytest.mark.slow  # two processes
def test_no_sync_accumulation_reduces_once_a_step(two_ranks):
    ranks = _ranks(two_ranks / "accumulation")
    assert (ranks["buckets"] == 1).all()  # two backwards a step, one reduction
    # rank 1 sleeps in both micro-batches' backwards; rank 0 waits for both at the one reduction
    assert ranks.loc[0, "wait_ms"] == pytest.approx(2 * EXTRA_MS, rel=0.4)
    assert "Straggler: rank 1" in (two_ranks / "accumulation" / "rank0" / "report.txt").read_text()


@pytest.mark.slow  # two processes
def test_ranks_whose_models_or_watches_differ_are_refused_in_one_line(two_ranks):
    for rank in (0, 1):
        said = (two_ranks / "differ" / f"rank{rank}" / "error.txt").read_text()
        assert said.startswith("ValueNotAllowed: model: rank ") and "differs from rank" in said
        assert "\n" not in said
        said = (two_ranks / "options" / f"rank{rank}" / "error.txt").read_text()
        assert said.startswith("ValueNotAllowed: watch: rank ") and "'steps': 9" in said


@pytest.mark.slow  # two processes
def test_a_watched_model_trains_as_one_never_watched_and_a_second_watch_times_its_reductions(two_ranks):
    folder = two_ranks / "same"
    assert float((folder / "rank0" / "differs.txt").read_text()) < 1e-6
    assert float((folder / "rank1" / "differs.txt").read_text()) < 1e-6
    for again in ("first", "second"):
        ranks = pd.read_csv(folder / "rank0" / again / "ranks.csv")
        assert (ranks["reduce_ms"] > 0).all() and (ranks["buckets"] == 1).all()


@pytest.mark.slow  # two processes
def test_a_models_own_communication_hook_is_kept_and_its_reductions_are_said_untimed(two_ranks):
    ranks = _ranks(two_ranks / "own_hook")
    assert ranks["reduce_ms"].isna().all() and ranks["buckets"].isna().all()
    assert ranks.loc[0, "wait_ms"] == pytest.approx(EXTRA_MS, rel=0.4)  # the tail is timed still
    report = (two_ranks / "own_hook" / "rank0" / "report.txt").read_text()
    assert "(not timed: the model's own communication hook (allreduce_hook) runs it)" in report


@pytest.mark.slow  # two processes, and the timeout
@pytest.mark.parametrize("fault", ["stall", "dead"])
def test_a_rank_that_stalls_or_dies_ends_the_other_in_one_line_within_the_timeout(tmp_path, fault):
    done = launcher.run(
        [sys.executable, "-m", "tests.rcnn.doctor.ranks_worker", str(free_port()), str(tmp_path), fault],
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = (tmp_path / fault / "rank0" / "error.txt").read_text()
    assert said.startswith("RanksLost: watch: rank 0 of 2: the ranks could not gather their tables (")
    assert said.endswith("a rank died, or stalled past the 3 s timeout") and "\n" not in said
    assert float((tmp_path / fault / "rank0" / "seconds.txt").read_text()) < 3 + 5  # rank 1 sleeps 600 s


@pytest.mark.slow  # torchrun and two cold processes
def test_torchrun_runs_the_doctor_on_two_ranks_and_rank_0_alone_prints_and_writes(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [
        str(torchrun),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "rcnn.doctor",
        "tests.fixtures.models:box_head_like",
        "--batch-size",
        "2",
        "--image-size",
        "64",
        "--max-seconds",
        "4",
        "--out",
        str(tmp_path / "out"),
    ]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("Top 15 modules by their own backward time") == 1  # rank 0's printout alone
    assert "DistributedDataParallel over 2 ranks" in done.stdout and "\nRanks (2, gloo;" in done.stdout
    out = tmp_path / "out"
    assert {"modules.csv", "ranks.csv", "report.html", "env.json"} <= {p.name for p in out.iterdir()}
    assert set(pd.read_csv(out / "modules.csv")["rank"]) == {0, 1}
    assert json.loads((out / "env.json").read_text())["ranks"]["world"] == 2


@pytest.mark.slow  # a new process each
@pytest.mark.parametrize(
    "args, message",
    [
        (["--fix"], "--fix: under torchrun"),
        (["--compile", "model"], "--compile: model under torchrun"),
        (["--rank-timeout", "0"], "--rank-timeout"),
    ],
)
def test_what_does_not_apply_across_ranks_is_refused_in_one_line(tmp_path, args, message):
    env = os.environ | {"PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "RANK": "0"}
    done = launcher.run(
        [
            sys.executable,
            "-m",
            "rcnn.doctor",
            "tests.fixtures.models:box_head_like",
            "--device",
            "cpu",
            *args,
        ],
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow  # two processes, a headless Chromium
def test_chromium_draws_each_ranks_icicle_behind_the_rank_selector(two_ranks):
    from tests import browser
    from tests.rcnn.doctor.test_pictures import table  # it needs plotly, as the page does

    browser.require_chromium()
    dom = browser.dump_dom(two_ranks / "straggler" / "rank0" / "saved" / "report.html")
    assert dom.count('<g class="iciclelayer">') == 3 + 2  # the page's own three, and one per rank
    assert re.findall(r'<option value="(\d)">', dom) == ["0", "1"]
    assert table(dom, "ranks")["rank"].tolist() == [0, 1]


def test_a_failed_reduction_is_told_from_a_models_own_error():
    from rcnn.doctor.ranks import lost_rank

    gloo = "[../third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer"
    assert lost_rank(RuntimeError(gloo))
    assert lost_rank(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    assert not lost_rank(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_gather_timeout_that_is_no_time_is_refused_in_one_line(timeout):
    from torch import nn

    from rcnn.doctor import watch
    from rcnn.rules import ValueNotAllowed

    with pytest.raises(ValueNotAllowed, match="gather_timeout: .*allowed: seconds > 0"):
        watch(nn.Linear(2, 2), gather_timeout=timeout)
