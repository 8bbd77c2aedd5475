"""Does the automatic fix (rcnn.fix.linearize, mode auto) help where it can and never hurt? On this machine:

1. Per model (torchvision's, untrained, small inputs; and the question's conv head in the project's detector):
   eligible and swapped convolutions, each one's forward + backward as the conv and as the GEMM at its
   input, and the whole forward and backward before and after, the original and the fixed model stepped in
   turn, with bootstrap 95% CIs (target: forward + backward after / before <= 1.02).
2. The box head's 7x7 conv after the fix against nn.Linear of the same shape, forward + backward, stepped in
   turn (target: within 1.05x).

Writes the tables to --out (default reports/fix.md). Run by hand (minutes), from the project folder:
.venv/bin/python -m benchmarks.fix_check [--models vit_b_16,resnet18]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from rcnn.cli import Parser, run_command
from rcnn.doctor.diagnosis import fix
from rcnn.doctor.workloads import build_workload
from rcnn.fix import Conv2dAsLinear
from rcnn.measure.clock import Clock
from rcnn.measure.device import resolve_device
from rcnn.measure.loop import in_turn
from rcnn.measure.machine import cpu_model
from rcnn.measure.options import add_timing_options
from rcnn.measure.settings import DEVICE
from rcnn.measure.stats import TimingPolicy, median_ratio
from rcnn.outputs import check_output, project_root, text_start, write_atomic
from rcnn.rules import UserError

TITLE = "# The automatic fix, measured"
MODELS = {  # name -> (MODEL spec, input): small inputs, so that a CPU runs them in minutes
    "vit_b_16": ("torchvision:vit_b_16", {"image_size": 128}),
    "convnext_tiny": ("torchvision:convnext_tiny", {"image_size": 128}),
    "swin_t": ("torchvision:swin_t", {"image_size": 128}),
    "swin3d_t": ("torchvision:swin3d_t", {"image_size": 64, "frames": 8}),
    "mobilenet_v3_large": ("torchvision:mobilenet_v3_large", {"image_size": 128}),
    "efficientnet_b0": ("torchvision:efficientnet_b0", {"image_size": 128}),
    "resnet18": ("torchvision:resnet18", {"image_size": 128}),
    "FastRCNNHeadConv": ("detector:tests.fixtures.question_heads:conv", {"image_size": 256}),
}

# The paired steps of each model: 3 rounds of burn-in, then until precise, bounded by --max-seconds
POLICY = TimingPolicy(warmup=3, iterations=10, max_iterations=40, max_seconds=20.0)


def input_label(sizes: dict) -> str:
    frames = f"{sizes['frames']} frames of " if "frames" in sizes else ""
    return f"{frames}{sizes['image_size']} px"


def conv_against_linear(
    device: torch.device, rounds: int, rois: int = 256, channels: int = 256, width: int = 1024
) -> tuple[float, float, float, float, float]:
    """Forward + backward ms of the box head's 7x7 conv after the fix and of nn.Linear of its shape, stepped
    in turn: (conv ms, linear ms, ratio, CI low, CI high)."""
    torch.manual_seed(0)
    conv = Conv2dAsLinear(channels, width, kernel_size=7).to(device)
    linear = torch.nn.Linear(channels * 49, width).to(device)
    x = torch.randn(rois, channels, 7, 7, device=device, requires_grad=True)
    flat = x.detach().flatten(1).requires_grad_()
    clock = Clock(device)

    def step(module: torch.nn.Module, inp: torch.Tensor) -> Callable[[], dict[str, float]]:
        return lambda: {"step": clock.time(lambda: module(inp).sum().backward())}

    steps = {"conv": step(conv, x), "linear": step(linear, flat)}
    times = in_turn(steps, TimingPolicy.fixed(rounds, warmup=3))  # 3 rounds of burn-in
    conv_ms, linear_ms = times["conv"]["step"], times["linear"]["step"]
    ratio, low, high = median_ratio(conv_ms, linear_ms)
    return float(np.median(conv_ms)), float(np.median(linear_ms)), ratio, low, high


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m benchmarks.fix_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", type=DEVICE.arg(), metavar=DEVICE.metavar, default="auto")
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated, of: " + ", ".join(MODELS)
    )
    add_timing_options(
        parser, defaults=POLICY, only=("max_seconds",), max_seconds_help="per model, for the paired steps"
    )
    parser.add_argument("--out", default="reports/fix.md", help="the markdown report to write")
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    """Every model's fix measured, the conv against nn.Linear, the report written; every check of the flags
    comes first."""
    names = args.models.split(",")
    if unknown := [n for n in names if n not in MODELS]:
        raise UserError(f"--models: {', '.join(unknown)} not allowed; allowed: {', '.join(MODELS)}")
    device = resolve_device(args.device)
    check_output(args.out, text_start("the fix report", TITLE), root=project_root(Path.cwd()), what="--out")
    policy = dataclasses.replace(POLICY, max_seconds=args.max_seconds)
    where = cpu_model() if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"{device.type} ({where}), torch {torch.__version__}, fp32, batch 2")

    summary, swaps = [], []
    for name in names:
        spec, sizes = MODELS[name]
        started = time.perf_counter()
        workload = build_workload(spec, batch_size=2, device=device, **sizes)
        fixed = fix(workload, device=device, amp="off", policy=policy, peak_tflops=None, by_module=False)
        s = fixed.summary
        summary.append(
            {
                "model": name,
                "input": input_label(sizes),
                "eligible": s["eligible"],
                "swapped": s["swapped"],
                "steps": s["paired_steps"],
                **{
                    f"{phase} before / after ms": f"{s[phase]['before_ms']:.1f} / {s[phase]['after_ms']:.1f}"
                    for phase in ("forward_backward", "backward")
                },
                **{
                    f"{phase} after/before": f"{s[phase]['ratio']:.3f} [{s[phase]['ci_low']:.3f}, "
                    f"{s[phase]['ci_high']:.3f}]"
                    for phase in ("forward_backward", "backward")
                },
            }
        )
        swaps += [{"model": name, **row} for row in fixed.swaps.to_dict("records")]
        print(
            f"{name}: {s['swapped']} of {s['eligible']} swapped; forward + backward after/before "
            f"{s['forward_backward']['ratio']:.3f} [{s['forward_backward']['ci_low']:.3f}, "
            f"{s['forward_backward']['ci_high']:.3f}] ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    conv_ms, linear_ms, ratio, low, high = conv_against_linear(device, rounds=30)
    print(
        f"box head 7x7 conv after the fix / nn.Linear: {ratio:.3f} [{low:.3f}, {high:.3f}] "
        f"({conv_ms:.1f} vs {linear_ms:.1f} ms)"
    )

    per_module = pd.DataFrame(swaps)
    if len(per_module):
        per_module["gemm / conv [95% CI]"] = [
            f"{r:.2f} [{lo:.2f}, {hi:.2f}]"
            for r, lo, hi in zip(per_module["ratio"], per_module["ci_low"], per_module["ci_high"])
        ]
        per_module = per_module.drop(columns=["ratio", "ci_low", "ci_high"])
        per_module["input_shape"] = per_module["input_shape"].map(lambda s: "x".join(map(str, s)))
    text = "\n".join(
        [
            TITLE,
            "",
            f"`python -m benchmarks.fix_check` on {device.type} ({where}, {platform.machine()}), torch "
            f"{torch.__version__}, fp32, batch 2, untrained models, inputs as listed. `rcnn.fix.linearize` "
            "in mode auto: each eligible convolution is timed forward + backward both ways at its input, "
            "stepped in turn, and kept as the conv only where the conv is shown more than 5% faster "
            "(GEMM / conv with its paired 95% CI over 1.05). Then the original and the fixed model are "
            "stepped in turn (forward, backward, optimizer) "
            "until the backward medians are known to 5% or the time runs out; ratios are after / before "
            "medians with "
            "bootstrap 95% CIs (target: forward + backward <= 1.02).",
            "",
            pd.DataFrame(summary).to_markdown(index=False),
            "",
            "The box head's 7x7 conv after the fix (`Conv2dAsLinear`, 256 RoIs x 256 x 7 x 7 -> 1024) "
            "against "
            f"`nn.Linear(12544, 1024)`, forward + backward, stepped in turn 30 times: {conv_ms:.1f} vs "
            f"{linear_ms:.1f} "
            f"ms, ratio {ratio:.3f} [95% CI {low:.3f}, {high:.3f}] (target: within 1.05).",
            "",
            "Each eligible convolution: forward + backward ms as the convolution and as the GEMM at the "
            "input it saw.",
            "",
            per_module.round(3).to_markdown(index=False) if len(per_module) else "None.",
            "",
        ]
    )
    write_atomic(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
