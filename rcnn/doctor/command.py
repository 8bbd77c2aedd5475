"""Backward time by module, for any model: which module is slow, and why.

``python -m rcnn.doctor torchvision:vit_b_16 --image-size 64`` times training steps of the model (forward,
loss, backward, optimizer) with every module instrumented (rcnn.doctor.attribution), counts each module's
FLOPs and the bytes its ops touch, and sets its backward against the machine's measured ceilings (the
fastest of torch's matmul paths, the copy bandwidth). A flag is a measured saving:

- ``gemm-in-disguise:<kind>``: a convolution that is a matrix product at the shape it saw (rcnn.disguise)
  and whose GEMM, timed in turn with it there, is faster (95% CI): what the fix saves a step, with its CI.

Each module that matters (the 3 longest backwards, any over 5% of it) and each flag gets a why row: what its
backward ran in a profiled step (ops on CPU, kernels on CUDA), its FLOPs and bytes and what bounds it; a
module with weights run alone, split into the input and the weight gradient with the backend implementation
that ran each (oneDNN's primitives on CPU, the kernels on CUDA); and what would make it faster, measured,
where the doctor knows (rcnn.doctor.remedies: torchvision's RoIAlign), else "no known fix".
MODEL is ``detector:<head>``, ``torchvision:<builder>``, ``timm:<name>``, ``hf:<model_type>`` or
``package.module:factory`` (rcnn.doctor.workloads). ``--out`` writes the tables, report.html (icicles of the
module tree) and trace.json (one step for ui.perfetto.dev, its backward ops in their modules' ranges).

``--max-seconds`` bounds the measuring: warm-up, the steps, the flags' and why rows' timings and the fix's
share it (building the model and measuring the machine's ceilings come first).
``--out`` is written before anything is printed, so ``| head`` loses none of it (the command then ends
quietly with 141, as a shell reports SIGPIPE).

Under ``torchrun --nproc-per-node N -m rcnn.doctor MODEL ...`` each process joins torchrun's group (gloo on
CPU, NCCL on CUDA), wraps the model in DistributedDataParallel and watches it; rank 0 prints and writes every
rank's times, the ranks' step split and the straggler (rcnn.doctor.ranks); the other ranks print nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rcnn.cli import Parser, run_command
from rcnn.doctor.diagnosis import Diagnosis, Fixed, diagnose, diagnose_beside_eager, fix, watched
from rcnn.doctor.files import DOCTOR_FILES, NO_REPORT, doctor_files, write_run
from rcnn.doctor.ranks import GATHER_TIMEOUT_S, RanksLost, lost_rank
from rcnn.doctor.specs import DEFAULT_IMAGE_SIZE, IMAGE_SIZE
from rcnn.doctor.workloads import build_workload
from rcnn.measure.device import (
    DTYPES,
    amp_unavailable,
    compile_forward,
    compile_unavailable,
    resolve_device,
    set_tf32,
)
from rcnn.measure.machine import copy_peak, fingerprint, matmul_paths
from rcnn.measure.options import add_timing_options, check_timing_options, timing_policy
from rcnn.measure.settings import AMP, AMP_DTYPES, DEVICE, machine_name
from rcnn.measure.stats import TimingPolicy
from rcnn.outputs import check_sqlite_url, claim_folder, project_root
from rcnn.rules import Rule, ValueNotAllowed, first_line

TOP = Rule(minimum=1)
FRAMES = Rule(minimum=1)
BATCH_SIZE = Rule(minimum=1)
RANK_TIMEOUT = Rule(minimum=1.0)
COMPILE = Rule(choices=("off", "head", "model"))
# --compile head: a detector's box head, as torchvision's detectors (and this project's) name its modules
BOX_HEAD = ("roi_heads.box_head", "roi_heads.box_predictor")
COMPILED_SAID = {
    "off": "",
    "head": ", its box head torch.compile'd (Inductor)",
    "model": ", torch.compile (Inductor)",
}
# --max-seconds' default: a detector's steps, its why rows and the fix's timings fit on 2 CPU cores
RUN_SECONDS = 120.0
POLICY = TimingPolicy(max_seconds=RUN_SECONDS)  # the timing flags' defaults
DIAGNOSE_SHARE = 0.4  # with --fix: the diagnosis's share of --max-seconds; the fix's timings get the rest


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m rcnn.doctor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="detector:<head>, torchvision:<builder>, timm:<name>, hf:<model_type> (options after ?, e.g. "
        "'hf:bert?num_hidden_layers=2') or package.module:factory",
    )
    p.add_argument("--batch-size", type=BATCH_SIZE.arg(int), default=2, help="images (or clips) per step")
    p.add_argument(
        "--image-size",
        type=IMAGE_SIZE.arg(int),
        default=DEFAULT_IMAGE_SIZE,
        help="square input size in pixels",
    )
    p.add_argument("--frames", type=FRAMES.arg(int), default=8, help="frames per clip, for video models")
    p.add_argument("--amp", type=AMP.arg(), metavar=AMP.metavar, default="off", help="autocast dtype")
    p.add_argument("--channels-last", action="store_true", help="model and images in NHWC")
    p.add_argument(
        "--device",
        type=DEVICE.arg(),
        metavar=DEVICE.metavar,
        default="auto",
        help="auto picks CUDA when there is a GPU",
    )
    p.add_argument(
        "--compile",
        type=COMPILE.arg(),
        metavar=COMPILE.metavar,
        default="off",
        help="model: torch.compile(model) with Inductor, each module timed by the compiled kernels that "
        "compute it (FLOPs and flags from one eager step, compile time apart); head: a detector's box head "
        f"alone ({' and '.join(BOX_HEAD)}, their forwards), the rest eager; off: eager",
    )
    p.add_argument(
        "--eager-too",
        action="store_true",
        help="with --compile: also watch the model eager, the two stepped in turn, and show each "
        "module's forward and backward either way (compare.csv)",
    )
    p.add_argument("--backbone", help="the detector's backbone (detector:<head> only; default resnet18_fpn)")
    p.add_argument(
        "--allow-tf32",
        action="store_true",
        help="CUDA: let fp32 matmuls and convolutions use TF32 (both alike; the peak is measured so too)",
    )
    p.add_argument(
        "--top", type=TOP.arg(int), default=15, help="modules to print, by their own backward time"
    )
    add_timing_options(
        p,
        defaults=POLICY,
        max_seconds_help="the measuring's bound in seconds: warm-up, the steps, the flags' and the why rows' "
        "timings and --fix's share it, precision met or not (building the model and measuring the "
        "machine's ceilings come before it)",
    )
    p.add_argument(
        "--fix",
        action="store_true",
        help="then linearize the model (rcnn.fix, mode auto) and measure it again: the by-module table "
        "after (modules_fixed.csv), each swap (fix.csv), forward and backward before and after",
    )
    p.add_argument(
        "--out",
        help="a folder for modules.csv, why.csv, env.json, report.html and trace.json, anywhere: absent, "
        "empty, or written by the doctor before (it never replaces what it did not write)",
    )
    p.add_argument(
        "--mlflow",
        action="store_true",
        help="log the tables to MLflow (MLFLOW_TRACKING_URI, default sqlite:///mlflow.db)",
    )
    p.add_argument(
        "--rank-timeout",
        type=RANK_TIMEOUT.arg(float),
        default=GATHER_TIMEOUT_S,
        help="under torchrun: seconds a rank waits for the others (rank 0 measuring the machine's ceilings, "
        "the reductions, the gather) before it ends in one line",
    )
    return p


def ranks_started() -> tuple[int, int] | None:
    """(rank, world size) where torchrun started this process as one of several; None for one process."""
    try:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    except ValueError:
        raise ValueNotAllowed("WORLD_SIZE", "not a whole number; allowed: torchrun's environment") from None
    return (rank, world) if world > 1 else None


def _join_ranks(args: argparse.Namespace, device: torch.device) -> torch.device:
    """Refuse what does not apply across ranks, then join torchrun's group: gloo on CPU, NCCL on CUDA (each
    rank on its LOCAL_RANK's GPU). The device the rank runs on."""
    for flag, value in (("--fix", args.fix), ("--eager-too", args.eager_too)):
        if value:
            raise ValueNotAllowed(
                flag, "under torchrun: each rank would time its own fix; allowed: one process"
            )
    if args.compile != "off":
        raise ValueNotAllowed("--compile", f"{args.compile} under torchrun; allowed: off (an eager model)")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.rank_timeout))
    return device


def _print(diagnosis: Diagnosis, top: int, title: str, out: str | None = None) -> None:
    print(diagnosis.report(top, title, out))


def _print_compared(compared: pd.DataFrame, top: int) -> None:
    print(
        f"\nEager against compiled, the {top} longest eager backwards (the eager model and the compiled one "
        "stepped in turn; ms per step, compiled / eager):"
    )
    print(compared.head(top).to_string(index=False, float_format=lambda v: f"{v:.3g}"))


def _print_fix(fixed: Fixed, top: int) -> None:
    s = fixed.summary
    print(
        f"\nThe fix (rcnn.fix.linearize, mode auto): {s['swapped']} of {s['eligible']} eligible modules "
        "swapped unless the module as written was shown over 5% faster; forward + backward ms as written and "
        "as the fix at each one's input, stepped in turn, and fixed / original with its 95% CI:"
    )
    if len(fixed.swaps):
        print(fixed.swaps.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    for phase in ("forward", "backward", "forward_backward"):
        p = s[phase]
        print(
            f"{phase.replace('_', ' + ')}: {p['before_ms']:.1f} -> {p['after_ms']:.1f} ms (medians of "
            f"{s['paired_steps']} steps each, the original and the fixed model in turn), after / before "
            f"{p['ratio']:.3f} [95% CI {p['ci_low']:.3f}, {p['ci_high']:.3f}]"
        )
    if fixed.after:
        _print(fixed.after, top, "After the fix:")


def _log_mlflow(
    args: argparse.Namespace, diagnosis: Diagnosis, texts: dict[str, str]
) -> str | ValueNotAllowed:
    """The MLflow run's id; from a server that is down or refuses, the error (raised after the printout)."""
    try:
        return _to_mlflow(args, diagnosis, texts)
    except ValueNotAllowed as err:
        return err


def _to_mlflow(args: argparse.Namespace, diagnosis: Diagnosis, texts: dict[str, str]) -> str:
    """A run in experiment rcnn-doctor: the options as params, the summary's numbers as metrics, every file
    --out writes (report.html included) as an artifact."""
    try:
        import mlflow  # only for --mlflow: the library itself needs no tracking server
    except ImportError:
        raise ValueNotAllowed(
            "--mlflow", "mlflow is not installed here; allowed: install it, or leave --mlflow out"
        ) from None
    uri = tracking_uri()
    try:
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("rcnn-doctor")
        with mlflow.start_run(run_name=args.model) as run:
            mlflow.log_params({k: v for k, v in vars(args).items() if k not in ("out", "mlflow")})
            mlflow.log_metrics(
                {
                    k: float(v)
                    for k, v in diagnosis.summary.items()
                    if isinstance(v, (int, float)) and not math.isnan(v)
                }
            )
            for name, text in texts.items():
                mlflow.log_text(text, name)
    except Exception as err:  # a server that is down or refuses: the tables printed and --out stay
        raise ValueNotAllowed(
            "--mlflow", f"cannot log to {uri} ({first_line(err)}); allowed: a reachable MLFLOW_TRACKING_URI"
        ) from err
    return run.info.run_id


def tracking_uri() -> str:
    """Where --mlflow logs: MLFLOW_TRACKING_URI, else this folder's sqlite:///mlflow.db (what `make ui`
    shows)."""
    return os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    check_timing_options(parser, args, defaults=POLICY)
    try:
        return run_command(
            lambda: _run(args), user_errors=(FloatingPointError,)
        )  # a diverging model: one line
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _run(args: argparse.Namespace) -> None:
    """Measure, write --out and log to MLflow, then print; every check of the user's input comes first.
    --max-seconds bounds the measuring (the policy's deadline), from the first step on: building the model
    and the machine's ceilings (measured once per process) come before it."""
    started = ranks_started()  # under torchrun: (rank, world size); rank 0 alone writes and prints
    leads = started is None or started[0] == 0
    if args.out and leads:  # before anything is measured: a folder it may fill, anywhere the user names
        earlier = claim_folder(args.out, DOCTOR_FILES, what="--out")
    device = resolve_device(args.device)
    if started:
        device = _join_ranks(args, device)
    if args.mlflow:
        check_sqlite_url(tracking_uri(), root=project_root(Path.cwd()), what="MLFLOW_TRACKING_URI")
    if device.type == "cuda":  # cuDNN defaults to TF32 and matmul not: the same for both, and the peak
        set_tf32(args.allow_tf32)
    if reason := amp_unavailable(args.amp, device):
        raise ValueNotAllowed("--amp", f"{args.amp} does not apply on {device.type}: {reason}")
    if args.compile != "off" and (reason := compile_unavailable(device)):
        raise ValueNotAllowed("--compile", f"{args.compile} does not apply on {device.type}: {reason}")
    if args.eager_too and args.compile == "off":
        raise ValueNotAllowed(
            "--eager-too", "sets the compiled model beside the eager; allowed: with --compile head or model"
        )
    if args.compile != "off" and args.fix:
        raise ValueNotAllowed(
            "--compile", f"{args.compile} with --fix: the fix times the eager model; allowed: one of the two"
        )
    zoo_options = {"backbone": args.backbone} if args.backbone else {}
    workload = build_workload(
        args.model,
        batch_size=args.batch_size,
        image_size=args.image_size,
        frames=args.frames,
        device=device,
        channels_last=args.channels_last,
        **zoo_options,
    )
    workload.model = compiled(workload.model, args.compile, args.model)
    if started:
        workload.model = DistributedDataParallel(
            workload.model, device_ids=[device.index] if device.type == "cuda" else None
        )
    dtype = AMP_DTYPES[args.amp]
    paths = {}
    if leads:  # under torchrun rank 0 alone measures the ceilings, the others waiting: no rank lowers them
        paths = matmul_paths(device, DTYPES[dtype])
        copy_peak(device)  # measured once per process: the diagnosis's why rows read it, outside the bound
    if started:
        dist.barrier()
    policy = timing_policy(args, defaults=POLICY)  # its deadline, --max-seconds from now, bounds the rest
    timings: dict = {}  # the flags' timings, which the fix's swaps then read: one decision each
    compared = None
    if started:
        try:
            rank = watched(
                workload,
                device=device,
                amp=args.amp,
                policy=policy,
                peak_tflops=max(paths.values(), default=None),
                gather_timeout=args.rank_timeout,
            )
        except RuntimeError as err:
            if not lost_rank(err):
                raise
            raise RanksLost(f"doctor: rank {started[0]} of {started[1]}: {first_line(err)}") from None
        if not rank.leads:  # it sent its tables to rank 0
            return
        diagnosis = rank.diagnosis
    elif args.eager_too:  # --fix is refused with --compile: the whole bound is the diagnosis's
        diagnosis, compared = diagnose_beside_eager(
            workload,
            device=device,
            amp=args.amp,
            policy=policy,
            peak_tflops=max(paths.values()),
            timings=timings,
        )
    else:
        diagnosis = diagnose(
            workload,
            device=device,
            amp=args.amp,
            policy=policy.within(DIAGNOSE_SHARE) if args.fix else policy,
            peak_tflops=max(paths.values()),
            timings=timings,
        )
    peak = diagnosis.summary["peak_tflops"]  # raised where a module ran faster than the paths measured
    fixed = (
        fix(workload, device=device, amp=args.amp, policy=policy, peak_tflops=peak, timings=timings)
        if args.fix
        else None
    )
    env = {
        "fingerprint": fingerprint(device),
        "ceilings": {
            "matmul_tflops": {dtype: peak},
            "matmul_paths": {dtype: paths},
            "copy_gbps": diagnosis.summary["copy_gbps"],
        },
        "model": args.model,
        "batch": workload.batch_description,  # what the batch was: a factory or zoo may not take the options
        "options": {"batch_size": args.batch_size, "image_size": args.image_size, "frames": args.frames},
        "amp": args.amp,
        "channels_last": args.channels_last,
        "compile": args.compile,
        "summary": diagnosis.summary,
        **({"fix": fixed.summary} if fixed else {}),
        **({"ranks": diagnosis.ranks.summary} if diagnosis.ranks is not None else {}),
    }
    where = machine_name(env["fingerprint"])
    title = (
        f"{args.model} on {device.type} ({where}), batch {workload.batch_description}, "
        f"{dtype}{', channels_last' if args.channels_last else ''}"
        f"{COMPILED_SAID[args.compile]}"
        + (f", DistributedDataParallel over {started[1]} ranks" if started else "")
    )
    texts = doctor_files(diagnosis, env, title=title, fixed=fixed, compared=compared)
    written = write_run(Path(args.out), texts, earlier) if args.out else []
    # Logged before printing too (a reader closing the pipe stops nothing); a server that refuses is told
    # after the tables are printed, and loses none of them.
    run = _log_mlflow(args, diagnosis, texts) if args.mlflow else None
    _print(diagnosis, args.top, title, out=args.out)
    if fixed:
        _print_fix(fixed, args.top)
    if compared is not None:
        _print_compared(compared, args.top)
    if written:
        print(f"\nwrote {', '.join(map(str, written))}")
    if (written or run) and "report.html" not in texts:
        print(f"report.html not written: {NO_REPORT}")
    if isinstance(run, ValueNotAllowed):
        raise run
    if run:
        print(f"MLflow run {run}")


def compiled(model: nn.Module, choice: str, spec: str, *, otherwise: str = "off, model") -> nn.Module:
    """``model`` as --compile ``choice`` compiles it, as a user would (rcnn.doctor.compiled times it):
    ``torch.compile(model)``, or the forward of each module of a detector's box head (BOX_HEAD) compiled, as
    the sweep's knob compile ``head`` does; ValueNotAllowed for ``head`` where the model (``spec``) has no
    such modules, naming ``otherwise`` as allowed."""
    if choice == "model":
        return torch.compile(model)
    if choice == "head":
        modules = dict(model.named_modules())
        if missing := [name for name in BOX_HEAD if name not in modules]:
            raise ValueNotAllowed(
                "--compile",
                f"head compiles a detector's box head ({', '.join(BOX_HEAD)}), and {spec} has no "
                f"{missing[0]}; allowed: {otherwise}",
            )
        compile_forward(*(modules[name] for name in BOX_HEAD))
    return model


if __name__ == "__main__":
    sys.exit(main())
