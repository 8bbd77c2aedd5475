import subprocess
import sys

import pytest
import torch

from rcnn.bench import PHASES, isolated_head_ms, main, run_trial
from rcnn.data import synthetic_samples
from rcnn.knobs import Knobs
from rcnn.model import BACKBONES, build_detector
from rcnn.timing import TimingPolicy
from tests.conftest import ROOT, TINY_CONFIG

CPU = torch.device("cpu")
SAMPLES = synthetic_samples(num_images=4, image_size=64, num_classes=2, seed=0)
QUICK = TimingPolicy(warmup=1, max_warmup=1, iterations=2, max_iterations=2)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["linear", "conv", "conv_as_linear"])
def test_trial_times_every_phase(head):
    result = run_trial(TINY_CONFIG, Knobs(head=head, batch_size=2), SAMPLES, device=CPU, policy=QUICK,
                       profile_steps=1)
    assert result.iterations == 2 and result.warmup_iterations == 1
    assert result.rois == 2 * TINY_CONFIG.rois_per_image  # fixed box-head input shape
    assert all(len(result.samples[p]) == 2 and result.median(p) > 0 for p in PHASES)
    assert result.median("head_backward") < result.median("backward")
    assert result.median("head_forward") < result.median("forward")
    assert result.median("forward") + result.median("backward") <= result.median("step") * 1.001
    row = result.row()
    assert {"head_backward_ci_low_ms", "step_p90_ms", "precision_met", "warmup_iterations"} <= set(row)
    # The profile of the head's backward names the operators the head runs: conv kernels or a GEMM.
    ops = {k["name"] for k in result.kernels if k["kind"] == "op"}
    assert ("aten::convolution_backward" in ops) == (head == "conv") and ("aten::mm" in ops) == (head != "conv")
    assert all(0 < k["share"] <= 1 for k in result.kernels)


@pytest.mark.slow
def test_channels_last_trial_runs():
    result = run_trial(TINY_CONFIG, Knobs(head="conv", channels_last=True, batch_size=1, onednn=False), SAMPLES,
                       device=CPU, policy=QUICK)
    assert result.median("step") > 0 and torch.backends.mkldnn.enabled  # oneDNN restored after the trial


@pytest.mark.slow
@pytest.mark.parametrize("head", ["linear", "conv"])
def test_isolated_head_times_are_positive(head):
    forward, backward = isolated_head_ms(TINY_CONFIG, Knobs(head=head), rois=16, device=CPU, min_run_time=0.05)
    assert forward > 0 and backward > 0


def test_settings_that_do_not_apply_are_refused_before_any_work():
    with pytest.raises(ValueError, match="amp=fp16 does not apply on cpu"):
        run_trial(TINY_CONFIG, Knobs(amp="fp16"), SAMPLES, device=CPU, policy=QUICK)
    with pytest.raises(ValueError, match="amp with onednn as set do not apply on cpu"):
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
    with pytest.raises(ValueError, match="unknown backbone 'vgg'; allowed: resnet50_fpn"):
        build_detector(config, "linear")


@pytest.mark.slow
def test_cli_prints_a_table(capsys):
    assert main(["--head", "linear", "--backbone", "mobilenet_v3_fpn", "--image-size", "64",
                 "--rois-per-image", "8", "--representation-size", "32", "--num-images", "2",
                 "--warmup", "0", "--iterations", "1", "--max-iterations", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "head_backward" in out and "peak memory" in out


def test_cli_error_is_one_line(capsys):
    assert main(["--amp", "fp16", "--device", "cpu", "--num-images", "2", "--image-size", "64"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


BAD_OPTIONS = [  # every numeric and choice option refuses a bad value with one line naming it and what is allowed
    (["--batch-size", "0"], "--batch-size: 0 is too small; allowed: >= 1"),
    (["--image-size", "100"], "--image-size: 100 is not allowed; allowed: a multiple of 32"),
    (["--image-size", "32"], "--image-size: 32 is too small; allowed: >= 64"),
    (["--rois-per-image", "0"], "--rois-per-image: 0 is too small; allowed: >= 1"),
    (["--representation-size", "0"], "--representation-size: 0 is too small; allowed: >= 1"),
    (["--warmup", "-1"], "--warmup: -1 is too small; allowed: >= 0"),
    (["--iterations", "0"], "--iterations: 0 is too small; allowed: >= 1"),
    (["--max-iterations", "0"], "--max-iterations: 0 is too small; allowed: >= 1"),
    (["--iterations", "10", "--max-iterations", "5"], "--max-iterations: 5 is below --iterations; allowed: >= 10"),
    (["--rel-precision", "0"], "--rel-precision: 0.0 is too small; allowed: >= 0.0001"),
    (["--num-images", "0"], "--num-images: 0 is too small; allowed: >= 1"),
    (["--batch-size", "two"], "--batch-size: expected int, got 'two'"),
    (["--device", "tpu"], "--device: 'tpu' is not allowed; allowed: auto, cpu, cuda"),
    (["--head", "mlp"], "--head: 'mlp' is not allowed; allowed: linear, conv, conv_as_linear"),
    (["--amp", "fp8"], "--amp: 'fp8' is not allowed; allowed: off, fp16, bf16"),
    (["--backbone", "vgg16"],
     "--backbone: 'vgg16' is not allowed; allowed: resnet50_fpn, resnet18_fpn, mobilenet_v3_fpn"),
]


@pytest.mark.parametrize("argv, message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_cli_refuses_a_bad_option_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_cli_bad_option_as_a_user_runs_it():
    result = subprocess.run([sys.executable, "-m", "rcnn.bench", "--batch-size", "0"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == "error: --batch-size: 0 is too small; allowed: >= 1\n" and result.stdout == ""
