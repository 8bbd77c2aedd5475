"""Backward time by module, for any model: which module is slow, and why.

``python -m rcnn.doctor torchvision:vit_b_16 --image-size 64`` times training steps of the model (forward,
loss, backward, optimizer) with every module instrumented (rcnn.attribution), counts each module's FLOPs,
and sets its backward speed against the machine's measured matmul peak. It flags:

- ``gemm-in-disguise:<kind>``: a convolution that is a matrix product at the shape it saw (rcnn.disguise);
- ``slow-for-its-flops``: a module whose own backward reaches under 25% of the peak while holding at least
  5% of the step's backward FLOPs.

For each flagged module it runs the backward alone at the recorded shape, dtype and layout, split into the
input gradient and the weight gradient, names the backend implementation that ran each (oneDNN's primitives
on CPU, the kernels on CUDA) and sets both beside the time the same FLOPs take at the matmul peak.
MODEL is ``detector:<head>``, ``torchvision:<builder>`` or ``package.module:factory`` (rcnn.workloads).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import json
import math
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from rcnn.attribution import OUTSIDE, ROOT, FlopCount, ModuleTimer, Seen, example_input
from rcnn.cli import Parser
from rcnn.disguise import FIX, gemm_kind
from rcnn.fix import Swap, linearize_with
from rcnn.kernels import capture
from rcnn.knobs import DTYPES, autocast, grad_scaler, resolve_device, set_tf32, why_not
from rcnn.machine import fingerprint, matmul_size
from rcnn.model import DetectorConfig
from rcnn.outputs import check_sqlite_url, claim_folder, project_root, write_atomic
from rcnn.roofline import measure_matmul_tflops
from rcnn.rules import Rule, UserError, ValueNotAllowed, first_line
from rcnn.schema import (AMP, AMP_DTYPES, BACKBONE, BATCH_SIZE, DEVICE, IMAGE_SIZE, MAX_SECONDS, MODULE_COLUMNS,
                         SLOW_MIN_FLOP_SHARE, SLOW_PEAK_FRACTION, WHY_COLUMNS)
from rcnn.stats import TimingPolicy, compare, median_precision
from rcnn.timing import Clock, median_ms
from rcnn.workloads import Workload, build_workload

FILES = re.compile(r"modules(_fixed)?\.csv|why\.csv|fix\.csv|env\.json")  # what --out holds: the doctor's only
TOP = Rule(minimum=1)
FRAMES = Rule(minimum=1)


@dataclass(frozen=True)
class Diagnosis:
    modules: pd.DataFrame  # rcnn.schema.MODULE_COLUMNS: one row per module, then the OUTSIDE row
    why: pd.DataFrame      # rcnn.schema.WHY_COLUMNS: one row per flagged module
    summary: dict[str, Any]


# -- measuring

def training_step(workload: Workload, model: nn.Module, *, device: torch.device, amp: str,
                  timer: ModuleTimer | None = None) -> Callable[[], tuple[pd.DataFrame | None, dict]]:
    """A function running one training step of ``model`` on the workload's batch: (the timer's table of the
    step, or None without one; its forward and backward ms), after the device's sync."""
    clock = timer.clock if timer else Clock(device)
    # The optimizer's arithmetic is the same at any rate; 0 keeps an untrained model on synthetic data from
    # diverging over the measured steps.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    scaler = grad_scaler(amp, device)
    forward, backward = (timer.forward, timer.backward) if timer else (contextlib.nullcontext,) * 2

    def step() -> tuple[pd.DataFrame | None, dict]:
        start = clock.mark()
        with forward(), autocast(amp, device):
            loss = workload.loss(model, workload.batch)
        middle = clock.mark()
        with backward():
            scaler.scale(loss).backward()
        end = clock.mark()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        clock.sync()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()}")
        if timer:  # its phases: the spans its table's rows add up to
            return timer.step_table()
        return None, {"forward_ms": clock.ms(start, middle), "backward_ms": clock.ms(middle, end)}

    return step


def _typical(tables: list[pd.DataFrame], totals: list[dict]) -> tuple[pd.DataFrame, dict]:
    """The middle half of the measured steps (by backward time), averaged row by row: as robust to an outlying
    step as a median, and unlike per-row medians the rows, the OUTSIDE row included, add up to the steps'."""
    order = sorted(range(len(totals)), key=lambda i: totals[i]["backward_ms"])
    cut = len(order) // 4
    kept = order[cut:len(order) - cut]
    table = pd.concat([tables[i] for i in kept]).groupby(level=0, sort=False).mean()
    total = {phase: sum(totals[i][phase] for i in kept) / len(kept) for phase in totals[0]}
    return table, total


def flags(model: nn.Module, timer: ModuleTimer, table: pd.DataFrame, peak_tflops: float | None
          ) -> dict[str, tuple[str, str]]:
    """module name -> (flags, evidence), both joined with '; ', for the modules the doctor flags."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    modules = {name or ROOT: module for name, module in model.named_modules()}
    for name, seen in timer.seen.items():
        if found := gemm_kind(modules[name], seen.input_shape):
            kind, evidence = found
            out.setdefault(name, ([], []))
            out[name][0].append(f"gemm-in-disguise:{kind}")
            out[name][1].append(f"{evidence}; fix: {FIX}")
    total_flops = table["backward_gflop"].sum()
    if peak_tflops and total_flops > 0:
        for name, row in table.drop(index=OUTSIDE).iterrows():
            share = row["backward_gflop"] / total_flops
            if share >= SLOW_MIN_FLOP_SHARE and row["peak_fraction"] < SLOW_PEAK_FRACTION:
                out.setdefault(name, ([], []))
                out[name][0].append("slow-for-its-flops")
                out[name][1].append(f"backward at {row['peak_fraction']:.0%} of the matmul peak with {share:.0%} "
                                    f"of the step's backward FLOPs")
    return {name: ("; ".join(f), "; ".join(e)) for name, (f, e) in out.items()}


def diagnose(workload: Workload, *, device: torch.device, amp: str = "off", policy: TimingPolicy = TimingPolicy(),
             peak_tflops: float | None = None, explain: bool = True) -> Diagnosis:
    """Time ``workload``'s training steps by module until ``policy`` says stop, count FLOPs in one more step,
    flag modules, and (``explain``) run each flagged module's backward alone.

    ``peak_tflops``: the matmul peak for the dtype ``amp`` computes in; None leaves peak fractions NaN.
    Raises ValueNotAllowed keyed MODEL when the first step fails (the model cannot take its batch) and
    FloatingPointError on a non-finite loss.
    """
    clock = Clock(device)
    timer = ModuleTimer(workload.model, clock)
    try:
        step = training_step(workload, workload.model, device=device, amp=amp, timer=timer)
        try:  # a model that cannot take its batch fails here, on the first step
            _, totals = step()
        except (RuntimeError, ValueError, TypeError, AssertionError, IndexError, KeyError, NotImplementedError) as err:
            raise ValueNotAllowed("MODEL", f"{workload.name} failed on its synthetic batch ({first_line(err)}); "
                                  "allowed: a model of the kind its spec names, or a factory returning (model, "
                                  "make_batch); if it ran out of memory, a smaller --batch-size or --image-size") \
                from None
        warm = [totals["forward_ms"] + totals["backward_ms"]]
        while not policy.warmed_up(warm):
            _, totals = step()
            warm.append(totals["forward_ms"] + totals["backward_ms"])
        tables, totals = [], []
        started = time.perf_counter()
        while not policy.done([[t["backward_ms"] for t in totals]], time.perf_counter() - started):
            table, total = step()
            tables.append(table)
            totals.append(total)
        with timer.counting_flops():
            step()
        table, total = _typical(tables, totals)
        table = table.join(timer.flop_table())
        table["type"] = pd.Series(timer.types)
        table.loc[OUTSIDE, "type"] = ""
        table["backward_share"] = table["backward_ms"] / total["backward_ms"]
        # GFLOP per ms is TFLOP/s.
        table["backward_tflops"] = (table["backward_gflop"] / table["backward_ms"]).where(table["backward_ms"] > 0)
        table["peak_fraction"] = table["backward_tflops"] / peak_tflops if peak_tflops else float("nan")
        found = flags(workload.model, timer, table, peak_tflops)
        table["flag"] = pd.Series({name: f for name, (f, _) in found.items()})
        table["evidence"] = pd.Series({name: e for name, (_, e) in found.items()})
        table[["flag", "evidence"]] = table[["flag", "evidence"]].fillna("")
        modules = table.rename_axis("module").reset_index()[list(MODULE_COLUMNS)]
        why_rows = []
        if explain:
            named = {name or ROOT: module for name, module in workload.model.named_modules()}
            for name in modules.set_index("module").loc[list(found)].sort_values("backward_ms",
                                                                                ascending=False).index:
                alone = (backward_alone(named[name], timer.seen[name], device, peak_tflops) if name in timer.seen
                         else {"input_grad_impl": "not run alone: its forward takes more than one tensor, or it has "
                                                  "no parameters of its own"})
                why_rows.append({"module": name, "flag": found[name][0], **alone})
        why = pd.DataFrame(why_rows, columns=list(WHY_COLUMNS))
        backward = [t["backward_ms"] for t in totals]
        summary = {"forward_ms": total["forward_ms"], "backward_ms": total["backward_ms"],
                   "warmup_steps": len(warm), "steps": len(totals), "precision": median_precision(backward),
                   "precision_met": policy.precision_met([backward]), "peak_tflops": peak_tflops,
                   "dtype": AMP_DTYPES[amp],
                   "outside_backward_share": float(table.loc[OUTSIDE, "backward_share"]),
                   "flagged": len(found)}
        return Diagnosis(modules, why, summary)
    finally:
        timer.remove()


# -- the fix, measured

@dataclass(frozen=True)
class Fixed:
    swaps: pd.DataFrame   # rcnn.fix.Swap fields: one row per eligible convolution
    after: Diagnosis | None
    summary: dict[str, Any]  # per phase: the after/before ratio of medians with its bootstrap 95% CI


def fix(workload: Workload, *, device: torch.device, amp: str, policy: TimingPolicy, peak_tflops: float | None,
        seed: int = 0, by_module: bool = True) -> Fixed:
    """Linearize ``workload``'s model in place (rcnn.fix, mode auto, at the batch, dtype and layout it trains
    with) and measure it by module again; then step a copy of the original and the fixed model in turn, a fresh
    order each round, until ``policy`` says stop (load and drift hit both alike), and set each phase's times
    after against before."""
    original = copy.deepcopy(workload.model)

    def forward() -> None:
        with autocast(amp, device):
            workload.loss(workload.model, workload.batch)

    swaps = pd.DataFrame([asdict(s) for s in linearize_with(workload.model, forward, mode="auto")],
                         columns=[f.name for f in fields(Swap)])
    after = diagnose(workload, device=device, amp=amp, policy=policy, peak_tflops=peak_tflops, explain=False) \
        if by_module else None
    steps = {"before": training_step(workload, original, device=device, amp=amp),
             "after": training_step(workload, workload.model, device=device, amp=amp)}
    times: dict[str, list[dict]] = {"before": [], "after": []}
    rng = random.Random(seed)
    for _ in range(max(policy.warmup, 1)):
        for name in steps:
            steps[name]()
    started = time.perf_counter()
    while not policy.done([[t["backward_ms"] for t in times[n]] for n in times], time.perf_counter() - started):
        for name in rng.sample(list(steps), len(steps)):
            times[name].append(steps[name]()[1])
    summary: dict[str, Any] = {"eligible": len(swaps), "swapped": int(swaps["swapped"].sum()),
                               "paired_steps": len(times["after"])}
    for phase in ("forward_ms", "backward_ms", "forward_backward_ms"):
        series = {name: [t["forward_ms"] + t["backward_ms"] if phase == "forward_backward_ms" else t[phase]
                         for t in ts] for name, ts in times.items()}
        c = compare(series["after"], series["before"], seed=seed)
        summary[phase.removesuffix("_ms")] = {"before_ms": float(np.median(series["before"])),
                                              "after_ms": float(np.median(series["after"])),
                                              "ratio": c.ratio, "ci_low": c.ci_low, "ci_high": c.ci_high}
    return Fixed(swaps, after, summary)


def _print_fix(fixed: Fixed, top: int) -> None:
    s = fixed.summary
    print(f"\nThe fix (rcnn.fix.linearize, mode auto): {s['swapped']} of {s['eligible']} eligible convolutions "
          "swapped; forward + backward ms of either path at each one's input:")
    if len(fixed.swaps):
        print(fixed.swaps.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    for phase in ("forward", "backward", "forward_backward"):
        p = s[phase]
        print(f"{phase.replace('_', ' + ')}: {p['before_ms']:.1f} -> {p['after_ms']:.1f} ms (medians of "
              f"{s['paired_steps']} steps each, the original and the fixed model in turn), after / before "
              f"{p['ratio']:.3f} [95% CI {p['ci_low']:.3f}, {p['ci_high']:.3f}]")
    if fixed.after:
        _print(fixed.after, top, "After the fix:")


# -- one module's backward alone

def _first_tensor(value: Any) -> torch.Tensor:
    while not isinstance(value, torch.Tensor):
        value = value[0] if isinstance(value, (tuple, list)) else next(iter(value.values()))
    return value


def backward_alone(module: nn.Module, seen: Seen, device: torch.device, peak_tflops: float | None,
                   repeats: int = 5) -> dict[str, Any]:
    """The module's backward run alone at the shape, dtype and layout it saw: the input gradient and the
    weight gradient each on its own (ms, GFLOP, the implementation that ran it) and the time the same FLOPs
    take at the matmul peak. The module's parameters and their .grad are left as they were."""
    x = example_input(seen, device)
    params = [p for p in module.parameters() if p.is_floating_point()]
    clock = Clock(device)
    saved = [p.requires_grad for p in params]
    row: dict[str, Any] = {"input_shape": "x".join(map(str, seen.input_shape)),
                           "dtype": str(seen.output_dtype).removeprefix("torch."),
                           "layout": "channels_last" if seen.channels_last else "contiguous"}
    try:
        for part, wrt in (("input_grad", [x]), ("weight_grad", params)):
            if not wrt:
                row |= {f"{part}_ms": float("nan"), f"{part}_gflop": float("nan"), f"{part}_impl": "none"}
                continue
            x.requires_grad_(part == "input_grad")
            for p in params:
                p.requires_grad_(part == "weight_grad")

            def forward() -> tuple[torch.Tensor, torch.Tensor]:
                out = _first_tensor(seen.run(module, x))
                return out, torch.ones_like(out)

            def timed() -> float:
                out, grad = forward()  # untimed: the backward alone is
                return clock.time(lambda: torch.autograd.grad(out, wrt, grad))

            ms = median_ms(timed, repeats=repeats)
            out, grad = forward()
            with FlopCount() as counter:
                torch.autograd.grad(out, wrt, grad)
            out, grad = forward()
            row |= {f"{part}_ms": ms, f"{part}_gflop": counter.total / 1e9,
                    f"{part}_impl": implementation(lambda: torch.autograd.grad(out, wrt, grad, retain_graph=True),
                                                   device)}
    finally:
        for p, flag in zip(params, saved):
            p.requires_grad_(flag)
    flops = sum(row[f"{part}_gflop"] for part in ("input_grad", "weight_grad") if not math.isnan(row[f"{part}_gflop"]))
    row["gemm_ms"] = flops / peak_tflops if peak_tflops else float("nan")  # GFLOP / (TFLOP/s) = ms
    return row


@contextlib.contextmanager
def _stdout_captured() -> Iterator[list[str]]:
    """What C code prints on file descriptor 1 inside (oneDNN's verbose lines), appended to the list on exit."""
    lines: list[str] = []
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield lines
        finally:
            ctypes.CDLL(None).fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            lines += sink.read().decode(errors="replace").splitlines()


def onednn_primitives(lines: list[str]) -> str:
    """oneDNN verbose 'exec' lines summed by primitive: 'convolution jit:avx2 backward_weights 0.71 ms x1'."""
    spent: dict[str, list[float]] = {}
    for line in lines:
        fields = line.split(",")
        if not fields[0].endswith("_verbose") or "exec" not in fields:
            continue
        i = fields.index("exec")
        if len(fields) < i + 5:
            continue
        key = " ".join(fields[i + 2:i + 5])  # primitive kind, implementation, propagation kind
        try:
            ms = float(fields[-1])
        except ValueError:
            ms = float("nan")
        spent.setdefault(key, [0.0, 0])
        spent[key][0] += ms
        spent[key][1] += 1
    ranked = sorted(spent.items(), key=lambda item: -item[1][0])
    return "; ".join(f"{key} {ms:.2f} ms x{n}" for key, (ms, n) in ranked[:3])


class _OpTimes(TorchDispatchMode):
    """Host time of each aten operator called inside: on CPU, where the time goes. (torch.profiler would tell
    too, but its CPU-only capture prints its own start, stop and GPU-probe lines on stderr.)"""

    def __init__(self) -> None:
        super().__init__()
        self.spent: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = f"aten::{func._overloadpacket.__name__}"
        self.spent[name] = self.spent.get(name, 0.0) + (time.perf_counter() - start) * 1e3
        return out


def implementation(run: Callable[[], Any], device: torch.device) -> str:
    """What ran ``run`` (called once or twice): the CUDA kernels (by time) on GPU; on CPU oneDNN's primitives,
    or where oneDNN was not used, the aten operators that took the time (MKL's GEMMs run as aten::mm)."""
    if device.type == "cuda":
        spent: dict[str, float] = {}
        for event in capture(run, device, steps=1):
            for kernel in getattr(event, "kernels", []):
                spent[kernel.name] = spent.get(kernel.name, 0.0) + kernel.duration / 1e3
    else:
        if torch.backends.mkldnn.enabled:
            with _stdout_captured() as lines, torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                run()
            if found := onednn_primitives(lines):
                return f"oneDNN: {found}"
        with _OpTimes() as ops:
            run()
        spent = ops.spent
    ranked = sorted(spent.items(), key=lambda item: -item[1])[:3]
    return "; ".join(f"{name[:80]} {ms:.2f} ms" for name, ms in ranked)


# -- the command

def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m rcnn.doctor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL",
                   help="detector:<head>, torchvision:<builder> or package.module:factory")
    p.add_argument("--batch-size", type=BATCH_SIZE.arg(int), default=2, help="images (or clips) per step")
    p.add_argument("--image-size", type=IMAGE_SIZE.arg(int), default=224, help="square input size in pixels")
    p.add_argument("--frames", type=FRAMES.arg(int), default=8, help="frames per clip, for video models")
    p.add_argument("--amp", type=AMP.arg(), metavar=AMP.metavar, default="off", help="autocast dtype")
    p.add_argument("--channels-last", action="store_true", help="model and images in NHWC")
    p.add_argument("--device", type=DEVICE.arg(), metavar=DEVICE.metavar, default="auto",
                   help="auto picks CUDA when there is a GPU")
    p.add_argument("--backbone", type=BACKBONE.arg(), metavar=BACKBONE.metavar, default=DetectorConfig.backbone,
                   help="the detector's backbone (detector:<head> only)")
    p.add_argument("--allow-tf32", action="store_true",
                   help="CUDA: let fp32 matmuls and convolutions use TF32 (both alike; the peak is measured so too)")
    p.add_argument("--top", type=TOP.arg(int), default=15, help="modules to print, by their own backward time")
    p.add_argument("--max-seconds", type=MAX_SECONDS.arg(float), default=TimingPolicy.max_seconds,
                   help="stop measuring after this long, precision met or not")
    p.add_argument("--fix", action="store_true",
                   help="then linearize the model (rcnn.fix, mode auto) and measure it again: the by-module table "
                        "after (modules_fixed.csv), each swap (fix.csv), forward and backward before and after")
    p.add_argument("--out", help="a folder for modules.csv, why.csv and env.json (absent, empty, or written by "
                                 "the doctor before)")
    p.add_argument("--mlflow", action="store_true",
                   help="log the tables to MLflow (MLFLOW_TRACKING_URI, default sqlite:///mlflow.db)")
    return p


def _print(diagnosis: Diagnosis, top: int, title: str) -> None:
    s = diagnosis.summary
    print(title)
    print(f"{s['warmup_steps']} warm-up and {s['steps']} timed steps (the step backward's median known to "
          f"{s['precision']:.1%}); times are means of the middle half of the steps: forward {s['forward_ms']:.1f} ms, "
          f"backward {s['backward_ms']:.1f} ms; "
          f"matmul peak {s['peak_tflops']} TFLOP/s ({s['dtype']}, measured)")
    modules = diagnosis.modules
    shown = modules[modules["module"] != OUTSIDE].nlargest(top, "backward_ms")
    shown = pd.concat([shown, modules[modules["module"] == OUTSIDE]])
    columns = ["module", "type", "calls", "forward_ms", "backward_ms", "backward_inclusive_ms", "backward_share",
               "backward_gflop", "backward_tflops", "peak_fraction", "flag"]
    print(f"\nTop {top} modules by their own backward time (ms per step; inclusive: with their children):")
    print(shown[columns].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if len(diagnosis.why):
        print("\nWhy, for each flagged module (its backward run alone; GEMM: the same FLOPs at the matmul peak):")
        for row in diagnosis.why.itertuples():
            print(f"- {row.module} [{row.flag}] {row.input_shape} {row.dtype} {row.layout}: "
                  f"input grad {row.input_grad_ms:.2f} ms ({row.input_grad_impl}); "
                  f"weight grad {row.weight_grad_ms:.2f} ms ({row.weight_grad_impl}); GEMM {row.gemm_ms:.2f} ms")


def _log_mlflow(args: argparse.Namespace, diagnosis: Diagnosis, env: dict) -> str:
    try:
        import mlflow  # only for --mlflow: the library itself needs no tracking server
    except ImportError:
        raise ValueNotAllowed("--mlflow", "mlflow is not installed here; allowed: install it, or leave --mlflow out") \
            from None
    uri = tracking_uri()
    try:
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("rcnn-doctor")
        with mlflow.start_run(run_name=args.model) as run:
            mlflow.log_params({k: v for k, v in vars(args).items() if k not in ("out", "mlflow")})
            mlflow.log_metrics({k: float(v) for k, v in diagnosis.summary.items()
                                if isinstance(v, (int, float)) and not math.isnan(v)})
            mlflow.log_text(diagnosis.modules.to_csv(index=False), "modules.csv")
            mlflow.log_text(diagnosis.why.to_csv(index=False), "why.csv")
            mlflow.log_dict(env, "env.json")
    except Exception as err:  # a server that is down or refuses: the tables printed and --out stay
        raise ValueNotAllowed("--mlflow", f"cannot log to {uri} ({first_line(err)}); allowed: a reachable "
                                          "MLFLOW_TRACKING_URI") from None
    return run.info.run_id


def tracking_uri() -> str:
    """Where --mlflow logs: MLFLOW_TRACKING_URI, else this folder's sqlite:///mlflow.db (what `make ui` shows)."""
    return os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.out:  # before anything is measured: a folder it may fill
            claim_folder(args.out, FILES, root=project_root(Path.cwd()), what="--out")
        device = resolve_device(args.device)
        if args.mlflow:
            check_sqlite_url(tracking_uri(), root=project_root(Path.cwd()), what="MLFLOW_TRACKING_URI")
        if device.type == "cuda":
            set_tf32(args.allow_tf32)  # cuDNN defaults to TF32 and matmul not: the same for both, and the peak
        if reason := why_not("amp", args.amp, device):
            raise ValueNotAllowed("--amp", f"{args.amp} does not apply on {device.type}: {reason}")
        workload = build_workload(args.model, batch_size=args.batch_size, image_size=args.image_size,
                                  frames=args.frames, device=device, backbone=args.backbone,
                                  channels_last=args.channels_last)
        dtype = AMP_DTYPES[args.amp]
        peak = round(measure_matmul_tflops(device, DTYPES[dtype], n=matmul_size(device)), 3)
        policy = TimingPolicy(max_seconds=args.max_seconds)
        diagnosis = diagnose(workload, device=device, amp=args.amp, policy=policy, peak_tflops=peak)
        fixed = fix(workload, device=device, amp=args.amp, policy=policy, peak_tflops=peak) if args.fix else None
    except (UserError, FloatingPointError) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    env = {"fingerprint": fingerprint(device), "ceilings": {"matmul_tflops": {dtype: peak}},
           "model": args.model, "batch_size": args.batch_size, "image_size": args.image_size,
           "frames": args.frames, "amp": args.amp, "channels_last": args.channels_last,
           "summary": diagnosis.summary, **({"fix": fixed.summary} if fixed else {})}
    where = env["fingerprint"].get("gpu", env["fingerprint"]["cpu_model"])
    _print(diagnosis, args.top, f"{args.model} on {device.type} ({where}), batch {args.batch_size}, "
                                f"{args.image_size} px, {dtype}{', channels_last' if args.channels_last else ''}")
    if fixed:
        _print_fix(fixed, args.top)
    if args.out:
        out = Path(args.out)
        tables = {"modules.csv": diagnosis.modules, "why.csv": diagnosis.why}
        if fixed:
            tables |= {"modules_fixed.csv": fixed.after.modules, "fix.csv": fixed.swaps}
        for name, table in tables.items():
            write_atomic(out / name, table.to_csv(index=False))
        write_atomic(out / "env.json", json.dumps(env, indent=2, sort_keys=True, default=str) + "\n")
        print(f"\nwrote {', '.join(str(out / name) for name in [*tables, 'env.json'])}")
    if args.mlflow:
        try:
            print(f"MLflow run {_log_mlflow(args, diagnosis, env)}")
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
