"""The runner of any model's trial: a Subject measured, its pair, dynamo's counters, a pair decided against
its aim."""

import pytest
import torch
from torch import nn

import rcnn.trial.runner as runner
from rcnn.measure.clock import Clock, ModuleSpanProbe
from rcnn.measure.stats import TimingPolicy
from rcnn.measure.step import STEP_PHASES
from rcnn.trial.knobs import knobs_for
from rcnn.trial.runner import ModelTrainer, Subject, decided_against, measure_trial

CPU = torch.device("cpu")
DEVICES = [pytest.param(CPU, id="cpu"), pytest.param(torch.device("cuda"), id="cuda", marks=pytest.mark.gpu)]
QUICK = TimingPolicy(warmup=1, max_warmup=1, iterations=2, max_iterations=2)


def toy_trainer(knobs) -> ModelTrainer:
    def build():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        return model, [torch.randn(knobs.batch_size, 8)], lambda m, x: m(x).square().mean()

    return ModelTrainer("toy", knobs, build, device=CPU)


def test_the_runner_measures_a_subject_then_steps_its_pair_beside_the_warm_trainer():
    built, paired = [], []

    def build(knobs):
        built.append(knobs)
        return toy_trainer(knobs)

    def pair(trainer, policy):
        paired.append((trainer.knobs, policy, len(trainer.batches)))
        return {"toy": {"step": [1.0, 2.0]}}

    knobs = knobs_for(CPU, batch_size=3)
    result = measure_trial(
        Subject(build, watched=("backward", "step"), pair=pair), knobs, device=CPU, policy=QUICK
    )
    assert built == [knobs] and paired == [(knobs, QUICK, 1)]
    assert (
        set(result.samples) == set(STEP_PHASES) and result.iterations == 2 and result.warmup_iterations == 1
    )
    assert result.paired == {"toy": {"step": [1.0, 2.0]}} and result.paired_error == ""
    assert result.kernels == [] and result.modules == [] and result.rois == 0


def test_a_pair_that_fails_leaves_the_trials_own_steps_and_says_why():
    def pair(trainer, policy):
        raise RuntimeError("out of memory\nwhile stepping the pair")

    subject = Subject(toy_trainer, watched=("step",), kernel_range=None, pair=pair)
    result = measure_trial(subject, knobs_for(CPU, batch_size=2), device=CPU, policy=QUICK, profile_steps=1)
    assert result.iterations == 2 and result.paired == {}
    assert result.paired_error == "RuntimeError: out of memory"
    assert result.kernels == [] and {row["module"] for row in result.modules} >= {"0", "2"}


def test_a_pair_is_decided_once_its_ratios_ci_lies_within_the_aim_or_beyond_it():
    decided = decided_against(1.05, "conv", "linear", "head_backward")
    linear = [10.0, 10.4, 9.8, 10.1, 10.2, 9.9, 10.0, 10.3]

    def rounds(conv: list[float]) -> dict:
        return {"conv": {"head_backward": conv}, "linear": {"head_backward": linear}}

    assert decided(rounds([3 * x for x in linear]))  # conv 3x: beyond at once
    assert decided(rounds([x * 0.99 for x in linear]))  # 0.99x every round: within
    assert not decided(rounds([x * f for x, f in zip(linear, (0.9, 1.2, 0.95, 1.15, 1.0, 1.1, 0.92, 1.18))]))
    two = {"conv": {"head_backward": [30.0, 31.0]}, "linear": {"head_backward": [10.0, 10.2]}}
    assert not decided(two)  # two rounds: no CI, no claim


def test_dynamo_counters_count_graph_breaks_with_their_reasons():
    def broken(x):
        x = x * 2
        torch._dynamo.graph_break()
        return x + 1

    counters = runner.DynamoCounters()
    torch._dynamo.reset()
    torch.compile(broken, backend="eager")(torch.ones(3))
    compiled = counters.compiled(compile_ms=5.0, compile_steps=1)
    assert compiled.graph_breaks >= 1 and compiled.compiled_graphs == 2
    assert (
        compiled.break_reasons.startswith(f"{compiled.graph_breaks} x ")
        and compiled.break_reasons.count("\n") >= 1
    )


def test_graph_breaks_at_the_timing_probes_hooks_are_listed_not_counted():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    # Hooks dynamo must not trace
    ModuleSpanProbe(model[0], model[2], Clock(CPU), label="head", eager_hooks=True)
    counters = runner.DynamoCounters()
    torch._dynamo.reset()
    torch.compile(model, backend="eager")(torch.randn(4, 8, requires_grad=True)).sum().backward()
    compiled = counters.compiled(compile_ms=5.0, compile_steps=1)
    assert compiled.graph_breaks == 0  # the model itself compiles whole
    assert "(the timing probe, not counted)\n" in compiled.break_reasons
