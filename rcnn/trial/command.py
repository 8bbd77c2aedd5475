"""The command-line pieces of a trial of any model (``python -m rcnn.bench``'s): a flag per knob,
one trial of ``--model``'s model printed per step and per sample, and ``--batch-size auto``'s search and
ranking. The detector's flags and trials are rcnn.bench's own."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch

from rcnn.doctor import specs
from rcnn.measure.batch import batches_below
from rcnn.measure.device import resolve_device
from rcnn.measure.options import timing_policy
from rcnn.measure.settings import AUTO
from rcnn.measure.stats import TimingPolicy
from rcnn.trial.knobs import Knobs, knobs_for
from rcnn.trial.models import batch_sizes_in_turn, find_batch_size, per_sample_table, run_model_trial
from rcnn.trial.runner import TrialResult
from rcnn.trial.schema import (
    KNOB,
    KNOBS,
    OTHER_KNOBS,
    setting_label,
)

MODEL_IMAGE_SIZE = specs.DEFAULT_IMAGE_SIZE  # --model's image size unless given (the doctor's)


def flag_help(text: str) -> str:
    """A knob's help as argparse prints it as written: argparse formats help text with %."""
    return text.replace("%", "%%")


def knob_values(args: argparse.Namespace) -> dict:
    """The knob flags' values (every knob but the head, as add_knob_flags names them)."""
    return {name: getattr(args, name) for name in OTHER_KNOBS}


def add_knob_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every knob but the head (rcnn.trial.schema.KNOBS): a bool knob's flag turns it away from
    its baseline; the others take a value, checked by the Rule params.yaml's key uses (same limits, words)."""
    for knob in KNOBS[1:]:
        text = flag_help(knob.help)
        if knob.kind is bool:
            parser.add_argument(
                knob.flag,
                dest=knob.name,
                action="store_const",
                const=not knob.baseline,
                default=knob.bench_default,
                help=text,
            )
        elif knob.name == "batch_size":  # or auto, with --model: the largest that fits and those below it
            parser.add_argument(
                knob.flag,
                dest=knob.name,
                type=_batch_size_or_auto,
                metavar="N|auto",
                default=knob.bench_default,
                help=f"{text}; with --model, auto: the largest batch that fits (--memory-limit-mb) and "
                "two below it, stepped in turn and ranked by time per sample (--max-seconds bounds that "
                "timing, not the search)",
            )
        else:
            parser.add_argument(
                knob.flag,
                dest=knob.name,
                type=knob.rule.arg(knob.kind),
                metavar=knob.rule.metavar,
                default=knob.bench_default,
                help=text,
            )


def _batch_size_or_auto(text: str) -> int | str:
    return AUTO if text == AUTO else KNOB["batch_size"].rule.arg(int)(text)


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Appends an option's default to its help, unless the help says it already or the default is None (the
    help says what stands in for it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def print_phases(result: TrialResult) -> None:
    print(f"{'phase':<14}{'median ms':>11}{'95% CI':>18}{'IQR':>8}{'p90':>9}")
    for phase, st in result.stats.items():
        print(
            f"{phase:<14}{st.median:>11.1f}{f'{st.ci_low:.1f}-{st.ci_high:.1f}':>18}{st.iqr:>8.1f}{st.p90:>9.1f}"
        )


def print_compiled_and_swapped(knobs: Knobs, result: TrialResult) -> None:
    if result.compiled:
        c = result.compiled
        print(
            f"compile={knobs.compile}: {c.compile_ms / 1e3:.1f} s in {c.compile_steps} compiling step(s), "
            f"kept out of the medians; {c.compiled_graphs} graph(s), {c.graph_breaks} graph break(s)"
        )
    if knobs.linearize:
        nothing = (
            "nothing (no convolution is a GEMM in disguise, or each was shown over 5% faster than its GEMM)"
        )
        print(f"linearize swapped: {result.swapped or nothing}")


def run_model(args: argparse.Namespace, policy: TimingPolicy) -> None:
    """One trial of ``--model``'s model, printed: its phases per step and per sample."""
    device = resolve_device(args.device)
    if args.batch_size == AUTO:
        run_batch_sizes(args, device)
        return
    knobs = knobs_for(device, **knob_values(args))
    result = run_model_trial(args.model, knobs, image_size=args.image_size, device=device, policy=policy)
    print(
        f"{args.model} at {args.image_size} px, {setting_label(asdict(knobs))} on {device}: "
        f"{result.warmup_iterations} warm-up and {result.iterations} timed steps, precision "
        f"{result.precision:.1%} (met: {result.precision_met})"
    )
    print_phases(result)
    step, per = result.stats["step"], knobs.batch_size
    print(
        f"per sample: step {step.median / per:.2f} ms "
        f"[95% CI {step.ci_low / per:.2f}, {step.ci_high / per:.2f}] (batch of {per})"
    )
    print(f"peak memory {result.peak_mem_mb:.0f} MiB")
    print_compiled_and_swapped(knobs, result)


def run_batch_sizes(args: argparse.Namespace, device: torch.device) -> None:
    """--batch-size auto: the largest batch that fits, then it and the batch sizes below it stepped in turn,
    ranked by time per sample, printed."""
    values = knob_values(args) | {"batch_size": 1}
    knobs = knobs_for(device, **values)
    search = find_batch_size(
        args.model, knobs, image_size=args.image_size, device=device, limit_mb=args.memory_limit_mb
    )
    print(
        f"{args.model} at {args.image_size} px, {setting_label(asdict(knobs), skip=('batch_size',))} on "
        f"{device}: the largest batch that fits is {search.largest}; tried {search.describe()}"
    )
    sizes = batches_below(search.largest)
    policy = timing_policy(args)  # --max-seconds bounds the timing; the search is as long as its tries
    times = batch_sizes_in_turn(
        args.model, knobs, sizes, image_size=args.image_size, device=device, policy=policy
    )
    rounds = len(times[sizes[0]]["step"])
    print(f"{len(sizes)} batch sizes stepped in turn, {rounds} rounds, fastest per sample first:")
    table = per_sample_table(times)
    print(f"{'batch':>6}{'step ms':>11}{'per sample ms [95% CI]':>28}{'/ fastest [95% CI]':>26}")
    for row in table.itertuples():
        print(
            f"{row.batch_size:>6}{row.step_ms:>11.1f}"
            f"{f'{row.per_sample_ms:.3f} [{row.ci_low_ms:.3f}, {row.ci_high_ms:.3f}]':>28}"
            f"{f'{row.vs_fastest:.2f} [{row.vs_fastest_ci_low:.2f}, {row.vs_fastest_ci_high:.2f}]':>26}"
        )
    best, largest = int(table.batch_size.iloc[0]), table.set_index("batch_size").loc[search.largest]
    if best == search.largest:
        print(f"fastest per sample: batch {best}, the largest that fits")
    else:
        print(
            f"fastest per sample: batch {best}; the largest that fits, {search.largest}, takes "
            f"{largest.vs_fastest:.2f}x [95% CI {largest.vs_fastest_ci_low:.2f}, "
            f"{largest.vs_fastest_ci_high:.2f}] its time per sample"
        )
