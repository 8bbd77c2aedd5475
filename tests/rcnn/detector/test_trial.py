import math
import re
import sys
import time

import pytest
import torch
from torch import nn

import rcnn.detector.trial as bench
from rcnn.bench import main
from rcnn.detector.data import synthetic_samples
from rcnn.detector.model import BACKBONES, build_detector
from rcnn.detector.trial import Trainer, isolated_head_ms, run_trial
from rcnn.detector.twin import TwinTrainer
from rcnn.doctor.attribution import ModuleTimer
from rcnn.measure.stats import TimingPolicy
from rcnn.rules import ValueNotAllowed
from rcnn.trial.knobs import Knobs, backend_flags
from rcnn.trial.runner import decided_against
from rcnn.trial.schema import PAIR_AIM, PHASES
from tests import launcher
from tests.conftest import ROOT, TINY_CONFIG

CPU = torch.device("cpu")
DEVICES = [pytest.param(CPU, id="cpu"), pytest.param(torch.device("cuda"), id="cuda", marks=pytest.mark.gpu)]
SAMPLES = synthetic_samples(num_images=4, image_size=64, num_classes=2, seed=0)
QUICK = TimingPolicy(warmup=1, max_warmup=1, iterations=2, max_iterations=2)


def assert_phases_add_up(samples: dict[str, list[float]]) -> None:
    """Each step's forward, backward and optimizer are consecutive spans of the step: their sum is the step
    (to the
    clock's rounding), and the box head's forward and backward lie inside the forward and the backward."""
    for i, step in enumerate(samples["step"]):
        forward, backward, optimizer = (samples[p][i] for p in ("forward", "backward", "optimizer"))
        assert forward + backward + optimizer == pytest.approx(step, rel=1e-6, abs=0.01), i
        assert 0 < samples["head_forward"][i] < forward and 0 < samples["head_backward"][i] < backward, i


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head", ["linear", "conv", "conv_as_linear"])
def test_trial_times_every_phase(head, device):
    result = run_trial(
        TINY_CONFIG, Knobs(head=head, batch_size=2), SAMPLES, device=device, policy=QUICK, profile_steps=1
    )
    assert result.iterations == 2 and result.warmup_iterations == 1  # QUICK's bounds, exactly
    assert result.rois == 2 * TINY_CONFIG.rois_per_image  # fixed box-head input shape
    assert all(len(result.samples[p]) == 2 for p in PHASES)
    assert_phases_add_up(result.samples)
    row = result.row()
    assert {"head_backward_ci_low_ms", "step_p90_ms", "precision_met", "warmup_iterations"} <= set(row)
    assert all(row[f"{p}_ms"] == result.median(p) for p in PHASES) and row["rois"] == result.rois
    # Whether the measured steps had their cores: a share of their threads' CPU time on the CPU, none on CUDA
    assert (0 < row["core_share"] <= 1.5) if device.type == "cpu" else math.isnan(row["core_share"])
    # The profile of the head's backward names the operators the head runs: conv kernels or a GEMM.
    ops = {k["name"] for k in result.kernels if k["kind"] == "op"}
    assert ("aten::convolution_backward" in ops) == (head == "conv") and ("aten::mm" in ops) == (
        head != "conv"
    )
    assert all(0 < k["share"] <= 1 for k in result.kernels)


class LoggedClock:
    """A clock that logs each mark it takes, with the name of who took it, in the order taken."""

    def __init__(self, clock, who: str, log: list) -> None:
        self.clock, self.who, self.log = clock, who, log

    def mark(self):
        stamp = self.clock.mark()
        self.log.append((self.who, stamp))
        return stamp

    def __getattr__(self, name: str):
        return getattr(self.clock, name)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["linear", "conv"])
def test_head_spans_lie_inside_the_forward_and_the_backward(head):
    knobs = Knobs(head=head, batch_size=2, onednn=True)
    log: list = []
    with backend_flags(knobs):
        trainer = Trainer(TINY_CONFIG, knobs, SAMPLES, device=CPU)
        clock = trainer.clock
        trainer.clock, trainer.head.clock = LoggedClock(clock, "step", log), LoggedClock(clock, "head", log)
        try:
            trainer.step(0)
        finally:
            trainer.close()
    # Step start, [head forward], forward end, [head backward], backward end, step end; the clock never goes
    # back.
    assert [who for who, _ in log] == ["step", "head", "head", "step", "head", "head", "step", "step"]
    stamps = [stamp for _, stamp in log]
    assert stamps == sorted(stamps)


def test_a_trainer_step_is_the_measure_step_with_the_heads_spans_and_the_doctors_modules():
    knobs = Knobs(head="linear", batch_size=1)
    with backend_flags(knobs):
        trainer = Trainer(TINY_CONFIG, knobs, SAMPLES, device=CPU)
        timer = ModuleTimer(trainer.model, trainer.clock)
        try:
            ms = trainer.step(0, modules=timer)
            table, totals = timer.step_table()
            trainer.model = lambda images, targets: {"loss": torch.tensor(float("nan"), requires_grad=True)}
            with pytest.raises(FloatingPointError, match="^non-finite loss nan at step 3$"):
                trainer.step(3)
        finally:
            timer.remove()
            trainer.close()
    assert list(ms) == list(PHASES)
    assert_phases_add_up({phase: [value] for phase, value in ms.items()})
    # The doctor's forward and backward lie inside the step's, once each.
    assert 0 < totals["forward_ms"] <= ms["forward"] and 0 < totals["backward_ms"] <= ms["backward"]
    assert table.loc["roi_heads.box_head", "calls"] == 1


# (policy, batch size, warm-up steps, timed steps): the policy's bounds decide how many steps run.
POLICIES = {
    # Step times cannot settle in fewer than settle_window (2) steps, so warm-up runs to max_warmup; precision
    # needs at least 6 samples, so measuring runs to max_iterations.
    "to-max-iterations": (
        TimingPolicy(warmup=0, max_warmup=2, iterations=1, max_iterations=3, rel_precision=1e-4),
        1,
        2,
        3,
    ),
    # Out of time after the first steps: no more than the least number.
    "out-of-time": (
        TimingPolicy(warmup=1, max_warmup=1, iterations=2, max_iterations=50, max_seconds=0.001),
        2,
        1,
        2,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("policy, batch_size, warmup, iterations", POLICIES.values(), ids=POLICIES.keys())
def test_the_policy_bounds_the_steps_and_rois_follow_the_batch(policy, batch_size, warmup, iterations):
    result = run_trial(
        TINY_CONFIG, Knobs(head="linear", batch_size=batch_size), SAMPLES, device=CPU, policy=policy
    )
    assert (result.warmup_iterations, result.iterations) == (warmup, iterations)
    assert all(len(result.samples[p]) == iterations for p in PHASES)
    assert not result.precision_met and result.precision > policy.rel_precision
    assert result.rois == batch_size * TINY_CONFIG.rois_per_image
    assert_phases_add_up(result.samples)


@pytest.mark.slow
def test_without_the_probe_head_times_are_nan_and_the_rest_is_timed():
    result = run_trial(
        TINY_CONFIG, Knobs(head="conv", batch_size=1), SAMPLES, device=CPU, policy=QUICK, probe=False
    )
    for phase in ("head_forward", "head_backward"):
        assert all(math.isnan(ms) for ms in result.samples[phase]) and math.isnan(result.row()[f"{phase}_ms"])
    for i, step in enumerate(result.samples["step"]):
        parts = [result.samples[p][i] for p in ("forward", "backward", "optimizer")]
        assert all(ms > 0 for ms in parts) and sum(parts) == pytest.approx(step, rel=1e-6, abs=0.01)


@pytest.mark.slow
def test_channels_last_and_onednn_off_hold_for_every_step(monkeypatch):
    seen = []  # per box-head forward: oneDNN's switch, and whether every conv weight is channels_last

    def build_watched(config, head):
        model = build_detector(config, head)
        convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
        model.roi_heads.box_head.register_forward_hook(
            lambda *_: seen.append(
                (
                    torch.backends.mkldnn.enabled,
                    all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs),
                )
            )
        )
        return model

    monkeypatch.setattr(bench, "build_detector", build_watched)
    result = run_trial(
        TINY_CONFIG,
        Knobs(head="conv", channels_last=True, batch_size=1, onednn=False),
        SAMPLES,
        device=CPU,
        policy=QUICK,
    )
    assert seen == [(False, True)] * (result.warmup_iterations + result.iterations)  # warm-up and timed steps
    assert torch.backends.mkldnn.enabled  # oneDNN restored after the trial


@pytest.mark.slow
@pytest.mark.parametrize("head", ["linear", "conv"])
def test_isolated_head_is_timed_under_the_knobs(monkeypatch, head):
    seen = set()  # oneDNN's switch at each timed call of the head

    def watched_autocast(amp, device):
        seen.add(torch.backends.mkldnn.enabled)
        return bench_autocast(amp, device)

    bench_autocast = bench.autocast
    monkeypatch.setattr(bench, "autocast", watched_autocast)
    forward, backward = isolated_head_ms(
        TINY_CONFIG, Knobs(head=head, onednn=False), rois=16, device=CPU, min_run_time=0.05
    )
    assert seen == {False} and torch.backends.mkldnn.enabled
    # A difference of two noisy medians: its sign is not checked
    assert forward > 0 and math.isfinite(backward)


def test_settings_that_do_not_apply_are_refused_before_any_work(monkeypatch):
    monkeypatch.setattr(bench, "build_detector", lambda *args: pytest.fail("a detector was built"))
    with pytest.raises(ValueNotAllowed, match="amp: fp16 does not apply on cpu"):
        run_trial(TINY_CONFIG, Knobs(amp="fp16"), SAMPLES, device=CPU, policy=QUICK)
    import rcnn.measure.device

    # bf16 alone applies where the CPU has it natively; without oneDNN it does not, whatever the CPU
    monkeypatch.setattr(rcnn.measure.device, "cpu_has_native_bf16", lambda: True)
    with pytest.raises(ValueNotAllowed, match="amp with onednn: as set, does not apply on cpu"):
        run_trial(TINY_CONFIG, Knobs(amp="bf16", onednn=False), SAMPLES, device=CPU, policy=QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("backbone", list(BACKBONES))
def test_detectors_build_and_keep_fixed_size(backbone):
    config = TINY_CONFIG.__class__(**{**TINY_CONFIG.__dict__, "backbone": backbone})
    model = build_detector(config, "conv").eval()
    with torch.no_grad():
        images = model.transform([torch.rand(3, 64, 64)])[0].tensors
    assert images.shape[-2:] == (64, 64)
    assert model.roi_heads.fg_bg_sampler.batch_size_per_image == config.rois_per_image


def test_unknown_backbone():
    config = TINY_CONFIG.__class__(**{**TINY_CONFIG.__dict__, "backbone": "vgg"})
    with pytest.raises(ValueNotAllowed, match="backbone: 'vgg' is not allowed; allowed: resnet50_fpn"):
        build_detector(config, "linear")


@pytest.mark.slow
def test_cli_prints_a_table_whose_phases_add_up(capsys):
    argv = ["--head", "linear", "--backbone", "mobilenet_v3_fpn", "--image-size", "64",
            "--rois-per-image", "8",
            "--representation-size", "32", "--num-images", "2", "--warmup", "1", "--iterations", "3",
            "--max-iterations", "3", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r", \d+ RoIs per step, \d+ warm-up and 3 timed steps, precision", out), out
    medians = {m[1]: float(m[2]) for m in re.finditer(r"^(\w+) +([\d.]+) +[\d.]+-[\d.]+ ", out, re.M)}
    assert list(medians) == list(PHASES), out
    # Medians of a sum need not add up, but on 3 steps of consecutive spans they come close.
    parts = medians["forward"] + medians["backward"] + medians["optimizer"]
    assert parts == pytest.approx(medians["step"], rel=0.15), out
    assert medians["head_backward"] < medians["backward"] and medians["head_forward"] < medians["forward"]
    assert re.search(r"^peak memory \d+ MiB$", out, re.M), out


def test_cli_error_is_one_line(capsys):
    assert main(["--amp", "fp16", "--device", "cpu", "--num-images", "2", "--image-size", "64"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_cli_refuses_tf32_on_a_cpu(capsys):
    assert main(["--tf32", "--device", "cpu", "--num-images", "2", "--image-size", "64"]) == 2
    assert (
        capsys.readouterr().err
        == "error: --tf32: True does not apply on cpu: TF32 is not used on CPU (pinned, "
        "reported as n/a)\n"
    )


@pytest.mark.slow  # a whole trial through the command line: seconds
def test_cli_reports_what_compiling_cost(capsys, slow_compiler):
    assert (
        main(
            [
                "--compile",
                "head",
                "--device",
                "cpu",
                "--num-images",
                "2",
                "--image-size",
                "64",
                "--backbone",
                "mobilenet_v3_fpn",
                "--rois-per-image",
                "8",
                "--representation-size",
                "32",
                "--warmup",
                "1",
                "--iterations",
                "2",
                "--max-iterations",
                "2",
            ]
        )
        == 0
    )
    assert re.search(
        r"compile=head: \d+\.\d s in 1 compiling step\(s\), kept out of the medians; 2 graph\(s\), "
        r"0 graph break\(s\)",
        capsys.readouterr().out,
    )


USERS_MODEL = "tests.fixtures.models:pooled"  # a plain classifier with a 1x1 conv stem

# every numeric and choice option refuses a bad value with one line naming it and what is allowed
BAD_OPTIONS = [
    (["--batch-size", "0"], "--batch-size: 0 is too small; allowed: >= 1"),
    (["--image-size", "100"], "--image-size: 100 is not allowed; allowed: a multiple of 32"),
    (["--image-size", "32"], "--image-size: 32 is too small; allowed: >= 64"),
    (["--rois-per-image", "0"], "--rois-per-image: 0 is too small; allowed: >= 1"),
    (["--representation-size", "0"], "--representation-size: 0 is too small; allowed: >= 1"),
    (["--warmup", "-1"], "--warmup: -1 is too small; allowed: >= 0"),
    (["--iterations", "0"], "--iterations: 0 is too small; allowed: >= 1"),
    (["--max-iterations", "0"], "--max-iterations: 0 is too small; allowed: >= 1"),
    (
        ["--iterations", "10", "--max-iterations", "5"],
        "--max-iterations: 5 is below --iterations; allowed: >= 10",
    ),
    (["--max-seconds", "0"], "--max-seconds: 0.0 is too small; allowed: >= 0.001"),
    (["--rel-precision", "0"], "--rel-precision: 0.0 is too small; allowed: >= 0.0001"),
    (["--num-images", "0"], "--num-images: 0 is too small; allowed: >= 1"),
    (["--batch-size", "two"], "--batch-size: expected int, got 'two'"),
    (["--device", "tpu"], "--device: 'tpu' is not allowed; allowed: auto, cpu, cuda"),
    (
        ["--head", "mlp"],
        "--head: 'mlp' is not allowed; allowed: linear, conv, conv_as_linear, or package.module:factory",
    ),
    (["--amp", "fp8"], "--amp: 'fp8' is not allowed; allowed: off, fp16, bf16"),
    (["--compile", "all"], "--compile: 'all' is not allowed; allowed: off, head, model"),
    (
        ["--backbone", "vgg16"],
        "--backbone: 'vgg16' is not allowed; allowed: resnet50_fpn, resnet18_fpn, mobilenet_v3_fpn",
    ),
    (["--image-size", "8"], "--image-size: 8 is too small; allowed: >= 16"),
    (["--model", USERS_MODEL, "--image-size", "8"], "--image-size: 8 is too small; allowed: >= 16"),
    (
        ["--batch-size", "auto"],
        "--batch-size: auto times a model's batch sizes; allowed: auto with --model, or a number",
    ),
    (
        ["--model", USERS_MODEL, "--memory-limit-mb", "100"],
        "--memory-limit-mb: bounds --batch-size auto's search; allowed: with --batch-size auto",
    ),
    (
        ["--model", USERS_MODEL, "--batch-size", "auto", "--memory-limit-mb", "0"],
        "--memory-limit-mb: 0.0 is too small; allowed: >= 1",
    ),
    (
        ["--model", USERS_MODEL, "--head", "conv", "--num-images", "4"],
        "--head, --num-images: the detector's, not --model's; allowed with --model: the knob flags, "
        "--image-size, --device and the timing options",
    ),
]


@pytest.mark.parametrize("argv, message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_cli_refuses_a_bad_option_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.slow
def test_cli_bad_option_as_a_user_runs_it():
    result = launcher.run([sys.executable, "-m", "rcnn.bench", "--batch-size", "0"], cwd=ROOT, timeout=120)
    assert result.returncode == 2
    assert result.stderr == "error: --batch-size: 0 is too small; allowed: >= 1\n" and result.stdout == ""


COMPILE_S = 0.4  # slow_compiler's seconds per graph: a tiny step takes tens of ms


@pytest.fixture
def slow_compiler(monkeypatch):
    """torch.compile with a backend that takes COMPILE_S per graph and then runs it as traced (no Inductor): a
    compile whose cost is known and far above a tiny step's."""
    real = torch.compile

    def slow_backend(graph_module, example_inputs):
        time.sleep(COMPILE_S)
        return graph_module.forward

    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: real(fn, backend=slow_backend))


@pytest.mark.slow  # two whole trials, one compiling: seconds
def test_compile_steps_are_timed_apart_and_kept_out_of_the_medians(slow_compiler, monkeypatch):
    steps = []  # every step's time, in the order run
    real_step = Trainer.step
    monkeypatch.setattr(
        Trainer, "step", lambda self, *a, **k: steps.append(real_step(self, *a, **k)) or steps[-1]
    )
    result = run_trial(TINY_CONFIG, Knobs(head="conv", compile="head"), SAMPLES, device=CPU, policy=QUICK)
    compiled = result.compiled
    # The first step compiles the box head's and the predictor's forwards: a graph each, COMPILE_S each.
    assert (compiled.compile_steps, compiled.compiled_graphs, compiled.graph_breaks) == (1, 2, 0)
    assert compiled.compile_ms >= 2e3 * COMPILE_S and result.wall_s["compile"] >= 2 * COMPILE_S
    # QUICK's bounds: compiling is not warm-up
    assert result.warmup_iterations == 1 and result.iterations == 2
    # Step 0 compiled: its time is the compile time alone; step 1 warmed up; steps 2 and 3 are the samples.
    assert len(steps) == 4 and compiled.compile_ms == steps[0]["step"]
    assert result.samples["step"] == [s["step"] for s in steps[2:]] and result.median("head_backward") > 0
    row = result.row()
    assert (
        row["compile_ms"] == compiled.compile_ms
        and row["graph_breaks"] == 0
        and row["wall_compile_s"] >= 2 * COMPILE_S
    )
    eager = run_trial(TINY_CONFIG, Knobs(head="conv"), SAMPLES, device=CPU, policy=QUICK)
    assert eager.compiled is None and math.isnan(eager.row()["compile_ms"]) and eager.wall_s["compile"] == 0


@pytest.mark.slow  # a whole trial: seconds
def test_wall_time_parts_cover_the_trial():
    started = time.perf_counter()
    result = run_trial(
        TINY_CONFIG,
        Knobs(head="conv"),
        SAMPLES,
        device=CPU,
        policy=QUICK,
        profile_steps=1,
        paired_with="linear",
    )
    elapsed = time.perf_counter() - started
    assert set(result.wall_s) == {"build", "compile", "warmup", "measure", "paired", "profile"}
    assert all(result.wall_s[p] > 0 for p in ("build", "warmup", "measure", "paired", "profile"))
    assert sum(result.wall_s.values()) == pytest.approx(elapsed, rel=0.1)


@pytest.mark.slow  # a detector and a twin stepped: seconds
def test_a_paired_trial_steps_a_twin_of_its_head_and_the_other_after_measuring_its_own(monkeypatch):
    built, stepped = (
        [],
        [],
    )  # (trainer, knobs, other head) as built; the trainer of each step, in the order run

    class Recording(Trainer):
        def __init__(self, config, knobs, *args, **kwargs):
            built.append(("trainer", knobs, None))
            super().__init__(config, knobs, *args, **kwargs)

        def step(self, *args, **kwargs):
            stepped.append("trainer")
            return super().step(*args, **kwargs)

    class RecordingTwin(TwinTrainer):
        def __init__(self, config, knobs, other, *args, **kwargs):
            built.append(("twin", knobs, other))
            super().__init__(config, knobs, other, *args, **kwargs)

        def step(self, *args, **kwargs):
            stepped.append("twin")
            return super().step(*args, **kwargs)

    monkeypatch.setattr(bench, "Trainer", Recording)
    monkeypatch.setattr(bench, "TwinTrainer", RecordingTwin)
    knobs = Knobs(head="conv", batch_size=2, channels_last=True)
    result = run_trial(TINY_CONFIG, knobs, SAMPLES, device=CPU, policy=QUICK, paired_with="linear")
    assert built == [("trainer", knobs, None), ("twin", knobs, "linear")]  # the twin at the trial's knobs
    # Its own warm-up and measured steps first (QUICK: 1 + 2), then the twin's: its warm-up step, then 2
    # measured steps, each of both heads.
    assert stepped == ["trainer"] * 3 + ["twin"] * 3
    assert set(result.paired) == {"conv", "linear"} and result.paired_error == ""
    for head in ("conv", "linear"):  # QUICK's 2 steps, each with both heads' every phase
        assert {p: len(v) for p, v in result.paired[head].items()} == dict.fromkeys(PHASES, 2)
        assert_phases_add_up(result.paired[head])
    assert result.iterations == 2 and len(result.samples["step"]) == 2  # its own steps, measured before
    assert run_trial(TINY_CONFIG, Knobs(head="conv"), SAMPLES, device=CPU, policy=QUICK).paired == {}
    with pytest.raises(ValueError, match="paired_with: conv is the trial's own head"):
        run_trial(TINY_CONFIG, Knobs(head="conv"), SAMPLES, device=CPU, policy=QUICK, paired_with="conv")
    with pytest.raises(
        ValueError, match="paired_with: the pair reads each head's spans, which need the probe"
    ):
        run_trial(
            TINY_CONFIG,
            Knobs(head="conv"),
            SAMPLES,
            device=CPU,
            policy=QUICK,
            paired_with="linear",
            probe=False,
        )


@pytest.mark.slow  # a detector and a twin stepped: seconds
def test_a_sweeps_pair_steps_until_decided_against_the_aim_bounded_by_its_seconds(monkeypatch):
    seen = []  # (policy, decided) of each in-turn stepping

    def recording(steps, policy, **kwargs):
        seen.append((policy, kwargs["decided"]))
        return in_turn(steps, policy, **kwargs)

    in_turn = bench.in_turn
    monkeypatch.setattr(bench, "in_turn", recording)
    knobs = Knobs(head="conv", batch_size=1)
    result = run_trial(
        TINY_CONFIG, knobs, SAMPLES, device=CPU, policy=QUICK, paired_with="linear", pair_seconds=1.0
    )
    (policy, decided), *_ = seen
    assert policy == QUICK.until_decided(1.0) and decided is not None
    rounds = len(result.paired["conv"]["head_backward"])
    assert rounds >= QUICK.iterations  # its least rounds, then until decided or the second is up
    # What stopped it: the box-head backward's CI decided against the aim, or the second up
    against_aim = decided_against(PAIR_AIM, "conv", "linear", "head_backward")
    assert against_aim(result.paired) or result.wall_s["paired"] >= 1.0
    # The test in_turn is handed reads the twin's values by head: 2x is decided, 1.05x +- 10% is not
    steps = range(12)
    clear = {"conv/head_backward": [2.0 + i / 100 for i in steps], "linear/head_backward": [1.0] * 12}
    across = {
        "conv/head_backward": [1.05 + (-1) ** i * 0.1 for i in steps],
        "linear/head_backward": [1.0] * 12,
    }
    assert decided({"twin": clear}) and not decided({"twin": across})
    seen.clear()
    run_trial(TINY_CONFIG, knobs, SAMPLES, device=CPU, policy=QUICK, paired_with="linear")
    assert seen == [(QUICK, None)]  # without pair_seconds: the trial's own policy, as before


@pytest.mark.slow  # whole trials: seconds
def test_a_compiled_trial_steps_no_pair_and_a_failed_pair_leaves_the_trials_own_steps(
    slow_compiler, monkeypatch
):
    compiled = run_trial(
        TINY_CONFIG,
        Knobs(head="conv", compile="head"),
        SAMPLES,
        device=CPU,
        policy=QUICK,
        paired_with="linear",
    )
    assert compiled.paired == {} and compiled.wall_s["paired"] == 0 and compiled.iterations == 2

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory: tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(bench, "_together_with", out_of_memory)
    failed = run_trial(
        TINY_CONFIG, Knobs(head="conv"), SAMPLES, device=CPU, policy=QUICK, paired_with="linear"
    )
    assert failed.paired == {} and failed.iterations == 2 and failed.median("step") > 0
    assert failed.paired_error == "RuntimeError: out of memory: tried to allocate 2.00 GiB"


def test_several_heads_are_stepped_in_turn_round_by_round(monkeypatch):
    order = []
    real_step = Trainer.step

    def logged(self, number, modules=None):
        order.append((self.knobs.head, number))
        return real_step(self, number, modules)

    monkeypatch.setattr(Trainer, "step", logged)
    knobs = [Knobs(head="conv", onednn=True), Knobs(head="linear", onednn=True)]
    policy = TimingPolicy(warmup=1, max_warmup=1, iterations=4, max_iterations=4)
    times = bench.heads_in_turn(TINY_CONFIG, knobs, SAMPLES, device=CPU, policy=policy, seed=0)
    assert list(times) == ["conv", "linear"]
    assert all(
        len(times[head][phase]) == 4 for head in times for phase in ("head_backward", "backward", "step")
    )
    rounds = [order[i : i + 2] for i in range(0, len(order), 2)]
    assert len(rounds) == 5 and all({head for head, _ in r} == {"conv", "linear"} for r in rounds)
    assert len({tuple(head for head, _ in r) for r in rounds}) == 2  # the order changes between rounds
    for head in ("conv", "linear"):  # each detector steps through its own batches: 0, 1, 2, ...
        assert [n for h, n in order if h == head] == list(range(5))


@pytest.mark.slow
def test_the_bench_with_two_heads_prints_their_paired_ratio(capsys):
    argv = ["--head", "conv", "--head", "linear", "--device", "cpu", "--backbone", "mobilenet_v3_fpn",
            "--image-size", "64", "--num-images", "2", "--rois-per-image", "8", "--representation-size", "32",
            "--warmup", "1", "--iterations", "3", "--max-iterations", "3"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 heads stepped in turn on cpu, 3 rounds, oneDNN on, amp off, NCHW, bs 2\n")
    medians = {
        m[1]: [float(v) for v in m[2].split()] for m in re.finditer(r"^(conv|linear) +([\d. ]+)$", out, re.M)
    }
    ratios = re.search(r"conv / linear \(paired over rounds\): head_backward ([\d.]+)x \[95% CI "
                       r"(\S+), (\S+)\]; backward ([\d.]+)x .*; step ([\d.]+)x", out)  # fmt: skip
    assert ratios and set(medians) == {"conv", "linear"}, out
    for i, phase in enumerate(bench.COMPARED):  # the first head over the second, the printed medians' ratio
        expected = medians["conv"][i] / medians["linear"][i]
        assert float(ratios[{0: 1, 1: 4, 2: 5}[i]]) == pytest.approx(expected, rel=0.05, abs=0.01), phase


SEVERAL_HEADS_REFUSED = [
    (["--head", "conv", "--head", "conv"], "--head: conv, conv names a head twice; allowed: each head once"),
    (["--head", "conv", "--head", "linear", "--compile", "head"], "--compile: head with several heads"),
]


@pytest.mark.parametrize("argv, message", SEVERAL_HEADS_REFUSED)
def test_several_heads_refuse_what_cannot_be_stepped_in_turn(capsys, argv, message):
    assert main([*argv, "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")
