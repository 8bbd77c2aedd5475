"""The swept knobs: which settings apply on a device (with the reason when one does not) and applying them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, make_dataclass
from typing import Any

import torch
from torch import nn

from rcnn.measure.device import amp_unavailable, compile_forward, compile_unavailable, tf32
from rcnn.rules import ValueNotAllowed
from rcnn.trial.schema import DEVICE_KNOBS, KNOBS, MODEL_COMPILE_TARGETS, Knob


def _knob_field(knob: Knob) -> tuple[str, Any, Any]:
    # A device knob defaults to None, not applicable, until a device is known (knobs_for).
    default = None if knob.device else knob.trial_default
    return knob.name, knob.kind | None if knob.device else knob.kind, field(default=default)


# One knob setting: a field per rcnn.trial.schema.KNOBS entry, in its order (None: n/a).
Knobs = make_dataclass("Knobs", [_knob_field(k) for k in KNOBS], frozen=True)
Knobs.__module__ = __name__  # where pickle finds it (make_dataclass's module= needs Python 3.12)


def knobs_for(device: torch.device, **values: Any) -> Knobs:
    """A Knobs on ``device``: each knob not given takes its default, a device knob its baseline on its own
    device and None (n/a) elsewhere. A device knob given away from its baseline elsewhere is kept, so that
    Trainer refuses it with its reason."""
    out = {}
    for knob in KNOBS:
        value = values.pop(knob.name, None)
        if knob.device and knob.device != device.type and value in (None, knob.baseline):
            value = None
        elif value is None:
            value = knob.trial_default
        out[knob.name] = value
    if values:
        raise TypeError(f"knobs_for: unknown knobs {sorted(values)}")
    return Knobs(**out)


@dataclass(frozen=True)
class Skipped:
    knob: str
    value: Any
    reason: str


def why_not(knob: str, value: Any, device: torch.device) -> str | None:
    """The reason a knob setting does not apply on ``device``, or None when it does."""
    if knob in DEVICE_KNOBS and DEVICE_KNOBS[knob][0] != device.type:
        return f"{DEVICE_KNOBS[knob][1]} is not used on {device.type.upper()} (pinned, reported as n/a)"
    if knob == "compile" and value != "off":
        return compile_unavailable(device)
    if knob == "amp":
        return amp_unavailable(value, device)
    return None


def why_not_together(point: dict[str, Any], device: torch.device) -> tuple[tuple[str, ...], str] | None:
    """Knob combinations that do not apply although each value does: (the knobs involved, reason), or None."""
    if device.type == "cpu" and point.get("amp") == "bf16" and point.get("onednn") is False:
        reason = "bf16 convolutions without oneDNN run a reference path (a step takes minutes)"
        return ("amp", "onednn"), reason
    return None


def applicable_space(space: dict[str, list], device: torch.device) -> tuple[dict[str, list], list[Skipped]]:
    """Drop settings that do not apply on ``device``; a knob that never applies is pinned to [None].

    Raises ValueNotAllowed, keyed by the knob's name, when a knob is left with no applicable value.
    """
    grid: dict[str, list] = {}
    skipped: list[Skipped] = []
    for knob, values in space.items():
        reasons = {value: why_not(knob, value, device) for value in values}
        grid[knob] = [v for v, r in reasons.items() if r is None]
        if knob in DEVICE_KNOBS and not grid[knob]:
            grid[knob] = [None]
            skipped.append(Skipped(knob, "any", reasons[values[0]]))
            continue
        if not grid[knob]:
            why = "; ".join(f"{v}: {r}" for v, r in reasons.items())
            raise ValueNotAllowed(knob, f"no value applies on {device.type} ({why})")
        skipped += [Skipped(knob, v, r) for v, r in reasons.items() if r]
    return grid, skipped


def model_space(
    space: dict[str, list], device: torch.device, spec: str
) -> tuple[dict[str, list], list[Skipped]]:
    """A spec's model's space (applicable_space, less what needs the detector): no head knob (pinned to
    [None]), and no compile of the box head, which the model has not."""
    space = {k: v for k, v in space.items() if k != "head"}
    kept = [v for v in space["compile"] if v in MODEL_COMPILE_TARGETS]
    if not kept:
        raise ValueNotAllowed(
            "compile",
            f"{space['compile']} compile the detector's box head only; allowed for {spec}: "
            f"{', '.join(MODEL_COMPILE_TARGETS)}",
        )
    left_out = [
        Skipped("compile", v, f"compiles the detector's box head; {spec} has none")
        for v in space["compile"]
        if v not in kept
    ]
    grid, skipped = applicable_space(space | {"compile": kept}, device)
    return {"head": [None], **grid}, left_out + skipped


@contextlib.contextmanager
def backend_flags(knobs: Knobs) -> Iterator[None]:
    """Set cudnn.benchmark, oneDNN and TF32 for the duration of a trial and restore them afterwards."""
    previous = torch.backends.cudnn.benchmark, torch.backends.mkldnn.enabled
    torch.backends.cudnn.benchmark = bool(knobs.cudnn_benchmark)
    torch.backends.mkldnn.enabled = knobs.onednn is not False  # n/a keeps PyTorch's default (on)
    try:
        with tf32(bool(knobs.tf32)):  # n/a (CPU): off, which no CPU kernel reads
            yield
    finally:
        torch.backends.cudnn.benchmark, torch.backends.mkldnn.enabled = previous


def compile_modules(model: nn.Module, target: str) -> list[nn.Module]:
    """Knob compile: torch.compile the forward of the detector's box head and predictor (``head``) or of the
    whole detector (``model``); returns the modules compiled. Their hooks stay outside the compiled code, so
    the head's probe times it as it times the eager head.

    Resets dynamo first: its cache, keyed by code, would otherwise count an earlier trial's modules towards
    its recompile limit and fall back to eager. Compiling happens on the first calls."""
    if target == "off":
        return []
    modules = [model.roi_heads.box_head, model.roi_heads.box_predictor] if target == "head" else [model]
    compile_forward(*modules)
    return modules


def memory_format(knobs: Knobs) -> torch.memory_format:
    return torch.channels_last if knobs.channels_last else torch.contiguous_format
