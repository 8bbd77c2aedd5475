"""Trials of any model a spec names: under the knobs, through the command line, the batch-size search."""

import re
import sys

import pytest
import torch

import rcnn.fix as fix
import rcnn.trial.models as models
import rcnn.trial.runner as runner
from rcnn.bench import main
from rcnn.doctor.columns import COMPILED
from rcnn.fix import DECIDING_ROUNDS, PathTiming
from rcnn.measure.device import compile_unavailable
from rcnn.measure.stats import TimingPolicy
from rcnn.measure.step import STEP_PHASES
from rcnn.rules import ValueNotAllowed
from rcnn.trial.knobs import knobs_for
from rcnn.trial.models import batch_sizes_in_turn, find_batch_size, per_sample_table, run_model_trial
from tests import launcher
from tests.conftest import ROOT
from tests.fixtures.models import HUNGRY

CPU = torch.device("cpu")
DEVICES = [pytest.param(CPU, id="cpu"), pytest.param(torch.device("cuda"), id="cuda", marks=pytest.mark.gpu)]
QUICK = TimingPolicy(warmup=1, max_warmup=1, iterations=2, max_iterations=2)
USERS_MODEL = "tests.fixtures.models:pooled"  # a plain classifier with a 1x1 conv stem


def test_any_models_trial_times_its_steps_under_the_knobs(monkeypatch):
    """The trial of a model the doctor takes: the model and batch built under the knobs (batch size, layout),
    the measure step's phases each step (no box head), linearize's swaps, the doctor's table when profiled."""
    built = []
    real = models.build_workload

    def recording(spec, **kwargs):
        built.append((spec, kwargs))
        return real(spec, **kwargs)

    monkeypatch.setattr(models, "build_workload", recording)
    # The 1x1 conv's GEMM timed faster, whatever this CPU's kernels say: the swap recorded is linearize's.
    gemm_faster = PathTiming(1.0, 0.5, 0.5, 0.45, 0.55, 0.5, 0.45, 0.55, DECIDING_ROUNDS)
    monkeypatch.setattr(fix.conv, "time_paths", lambda *args, **kwargs: gemm_faster)
    monkeypatch.setattr(runner, "LINEARIZE_TIMINGS", {})
    knobs = knobs_for(CPU, batch_size=3, channels_last=True, linearize=True)
    result = run_model_trial(
        USERS_MODEL, knobs, image_size=32, device=CPU, policy=QUICK, profile_steps=1, frames=4
    )
    sizes = {"batch_size": 3, "image_size": 32, "device": CPU, "frames": 4, "channels_last": True}
    assert built == [(USERS_MODEL, sizes)]
    assert set(result.samples) == set(STEP_PHASES) and result.iterations == 2
    for i, step in enumerate(result.samples["step"]):
        parts = sum(result.samples[p][i] for p in ("forward", "backward", "optimizer"))
        assert parts == pytest.approx(step, rel=1e-6, abs=0.01)
    assert result.rois == 0 and result.swapped == "features" and result.kernels == []
    assert {row["module"] for row in result.modules} >= {"features", "score"}


@pytest.mark.slow  # compiling the model twice (knob compile, then the doctor's map) takes about 30 s
@pytest.mark.skipif(bool(compile_unavailable(CPU)), reason="no torch.compile here")
def test_a_compiled_models_trial_records_its_table_by_module_from_the_compiled_kernels():
    knobs = knobs_for(CPU, compile="model")
    result = run_model_trial(
        USERS_MODEL, knobs, image_size=32, device=CPU, policy=QUICK, profile_steps=2, frames=4
    )
    rows = {row["module"]: row for row in result.modules}
    assert result.compiled is not None and {"features", "pool", "score"} <= set(rows)
    # Each module's row from the kernels that compute it, named in the compiled column
    for module in ("features", "score"):
        assert rows[module]["backward_ms"] > 0 and "backward: " in rows[module][COMPILED]


def test_a_models_trial_refuses_the_detectors_compile_target_before_building(monkeypatch):
    monkeypatch.setattr(models, "build_workload", lambda *args, **kwargs: pytest.fail("a model was built"))
    with pytest.raises(ValueNotAllowed, match="compile: head compiles the detector's box head, which this"):
        run_model_trial(USERS_MODEL, knobs_for(CPU, compile="head"), image_size=32, device=CPU, policy=QUICK)


def test_cli_times_any_model_per_step_and_per_sample(capsys):
    argv = ["--model", USERS_MODEL, "--image-size", "32", "--batch-size", "4", "--warmup", "1",
            "--iterations", "3", "--max-iterations", "3", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{USERS_MODEL} at 32 px, oneDNN on, amp off, NCHW, bs 4 on cpu: "), out
    medians = {m[1]: float(m[2]) for m in re.finditer(r"^(\w+) +([\d.]+) +[\d.]+-[\d.]+ ", out, re.M)}
    assert list(medians) == list(STEP_PHASES), out
    per_sample = re.search(
        r"^per sample: step ([\d.]+) ms \[95% CI [\d.]+, [\d.]+\] \(batch of 4\)$", out, re.M
    )
    assert per_sample and float(per_sample[1]) == pytest.approx(medians["step"] / 4, abs=0.1), out


def test_cli_refuses_a_model_spec_that_names_nothing_with_one_line(capsys):
    assert main(["--model", "resnet18", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --model: 'resnet18' is not a model spec; allowed: ") and err.count("\n") == 1
    )


# The search and the command in a process of their own: a process that already ran many models reuses freed
# memory it holds, so the peak resident set it reads does not grow with the batch as a fresh one's does.
BATCH_SEARCH = """
import sys
from tests.fixtures.models import HUNGRY, hungry_limit
from rcnn.bench import main

limit = hungry_limit(5.5)  # batch 5 fits, 6 does not
sys.exit(main(["--model", HUNGRY, "--image-size", "16", "--batch-size", "auto", "--memory-limit-mb",
               f"{limit}", "--warmup", "1", "--iterations", "2", "--max-iterations", "2", "--device", "cpu"]))
"""


@pytest.mark.slow  # the model built and stepped at each batch size tried: seconds
def test_the_batch_size_search_finds_the_largest_batch_under_a_memory_limit():
    with pytest.raises(ValueNotAllowed, match="memory_limit_mb: none set; a batch size search on cpu needs"):
        find_batch_size(HUNGRY, knobs_for(CPU), image_size=16, device=CPU, limit_mb=None)

    done = launcher.run([sys.executable, "-c", BATCH_SEARCH], cwd=ROOT)
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    # The search the command printed, every size it tried in order: doubling, then bisecting.
    tried = re.search(r"the largest batch that fits is (\d+); tried (.*)", out)
    assert tried and tried[1] == "5", out
    assert re.findall(r"(\d+) (fits|does not) \(peak", tried[2]) == [
        ("1", "fits"), ("2", "fits"), ("4", "fits"), ("8", "does not"), ("6", "does not"), ("5", "fits")
    ], out  # fmt: skip
    assert "3 batch sizes stepped in turn, 2 rounds, fastest per sample first:" in out, out
    rows = re.findall(r"^ +(\d+) +[\d.]+ +[\d.]+ \[[\w.]+, [\w.]+\] +([\d.]+) \[", out, re.M)
    assert sorted(int(size) for size, _ in rows) == [1, 2, 5] and rows[0][1] == "1.00", out
    assert re.search(r"^fastest per sample: batch [125]\b", out, re.M), out


def test_batch_sizes_rank_by_time_per_sample_against_the_fastest_paired():
    times = {
        1: {"step": [10.0, 11.0, 10.0]},
        2: {"step": [16.0, 16.0, 18.0]},
        4: {"step": [40.0, 44.0, 40.0]},
    }
    table = per_sample_table(times)
    assert list(table.batch_size) == [2, 1, 4]  # 8, 10 and 10 ms a sample
    assert list(table.per_sample_ms) == [8.0, 10.0, 10.0] and list(table.step_ms) == [16.0, 10.0, 40.0]
    assert table.vs_fastest.iloc[0] == 1.0 and table.vs_fastest.iloc[1] == pytest.approx(1.25)


def test_batch_sizes_are_stepped_in_turn_under_the_other_knobs():
    knobs = knobs_for(CPU, channels_last=True)
    times = batch_sizes_in_turn(USERS_MODEL, knobs, [1, 3], image_size=32, device=CPU, policy=QUICK)
    assert set(times) == {1, 3}
    assert all({p: len(v) for p, v in times[size].items()} == dict.fromkeys(STEP_PHASES, 2) for size in times)
