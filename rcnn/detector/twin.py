"""Two box heads on the same RoI features in one training step: how a trial's head is set against the
sweep's reference head.

The detector's RoI features go through both heads, each head's whole chain (box head, then predictor) at
once, the order swapped every step (each head runs first in half the steps, within one); their class
scores and box deltas are summed, so the loss's gradient reaches each head whole and each runs its full
backward. Autograd runs nodes in reverse creation order: the later head's chain, then the earlier's, then
RoIAlign's backward, so each head's backward span, timed by its own probe
(rcnn.measure.clock.ModuleSpanProbe), holds nothing of the other's. Both heads' times come from the same
step, under the machine's load at that moment, and a round costs one step of the detector and one more
head, not two whole steps (benchmarks/twin_check.py: the same ratios as two detectors stepped in turn,
within their CIs, at 54-59% of a round's time).

A head's whole-detector phases are read off the step less the other head's spans: its forward is the step's
forward less the other head's forward span, its backward and step likewise. What lies outside both spans is
carried by both heads, which leans the whole-detector ratios slightly towards 1: the sum of their outputs,
the sum of their gradients into the RoI features, and the optimizer's update of the other head's weights
(about 1% of a step).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from rcnn.detector.data import Sample, device_batches
from rcnn.detector.heads import build_box_head
from rcnn.detector.model import ROI_RESOLUTION, DetectorConfig, build_detector
from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.workloads import detection_loss
from rcnn.measure.clock import ModuleSpanProbe
from rcnn.trial.knobs import Knobs, memory_format
from rcnn.trial.runner import ModelTrainer, Paired
from rcnn.trial.schema import COMPILE_TARGETS, PHASES

SEPARATOR = "/"  # a twin step's value names: <head>/<phase>; no phase has one, so the last splits them


class TwinBoxHeads(nn.Module):
    """The box predictor of a twin detector: every head (box head, then predictor) on the same RoI
    features, in ``order``, their class scores and box deltas summed. The detector's box head is then the
    identity."""

    def __init__(self, heads: Mapping[str, tuple[nn.Module, nn.Module]]) -> None:
        super().__init__()
        # A list, not a ModuleDict: a user's head is named package.module:factory, and a module's name
        # has no '.'.
        self.names = list(heads)
        self.heads = nn.ModuleList(nn.Sequential(*pair) for pair in heads.values())
        self.order = list(heads)

    def head(self, name: str) -> nn.Sequential:
        """Head ``name``'s box head and predictor."""
        return self.heads[self.names.index(name)]

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores, deltas = zip(*(self.head(name)(features) for name in self.order))
        return sum(scores), sum(deltas)


def twin_detector(config: DetectorConfig, heads: tuple[str, str]) -> nn.Module:
    """The detector of ``heads[0]`` with ``heads[1]`` computing beside it on the same RoI features
    (TwinBoxHeads)."""
    if heads[0] == heads[1]:
        raise ValueError(f"a twin needs two heads; both are {heads[0]}")
    model = build_detector(config, heads[0])
    other = build_box_head(
        heads[1],
        in_channels=model.backbone.out_channels,
        resolution=ROI_RESOLUTION,
        representation_size=config.representation_size,
        num_classes=config.num_classes,
    )
    roi_heads = model.roi_heads
    both = {heads[0]: (roi_heads.box_head, roi_heads.box_predictor), heads[1]: other}
    roi_heads.box_head, roi_heads.box_predictor = nn.Identity(), TwinBoxHeads(both)
    return model


class TwinTrainer(ModelTrainer):
    """The twin detector of ``knobs.head`` and ``other`` at ``knobs``, its optimizer and batches: ``step()``
    runs one training step and returns each head's phase times (``<head>/<phase>``, PHASES, as the module
    docstring reads them) and the step's own ``step``. Build and step it inside ``backend_flags(knobs)``.
    Uncompiled only: a second compiled detector beside a trial's would reset dynamo's cache of the first."""

    phases = ("step",)
    compile_targets = COMPILE_TARGETS

    def __init__(
        self,
        config: DetectorConfig,
        knobs: Knobs,
        other: str,
        samples: list[Sample],
        *,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        if knobs.compile != "off":
            raise ValueError(f"a twin is stepped uncompiled; compile is {knobs.compile}")

        def build() -> tuple[nn.Module, list, object]:
            model = twin_detector(config, (knobs.head, other))
            model = model.to(device=device, memory_format=memory_format(knobs))
            return model, device_batches(samples, batch_size=knobs.batch_size, device=device), detection_loss

        super().__init__(f"detector:{knobs.head}+{other}", knobs, build, device=device, seed=seed)
        self.twin: TwinBoxHeads = self.model.roi_heads.box_predictor
        self.probes = {
            name: ModuleSpanProbe(pair[0], pair[-1], self.clock, label=f"box_head.{name}")
            for name, pair in zip(self.twin.names, self.twin.heads)
        }

    def step(self, number: int, modules: ModuleTimer | None = None) -> dict[str, float]:
        """Step ``number`` of both heads, the other first than in the step before (``stepper`` counts from
        0): each head's phases, and the step's own."""
        names = list(self.probes)
        self.twin.order = names[::-1] if number % 2 else names
        for probe in self.probes.values():
            probe.reset()
        ms = super().step(number, modules)
        spans = {name: probe.spans_ms() for name, probe in self.probes.items()}
        out = {"step": ms["step"]}
        for name in names:
            other_forward, other_backward = _other(spans, name)
            forward, backward = spans[name]
            phases = {
                "forward": ms["forward"] - other_forward,
                "backward": ms["backward"] - other_backward,
                "optimizer": ms["optimizer"],
                "step": ms["step"] - other_forward - other_backward,
                "head_forward": forward,
                "head_backward": backward,
            }
            out |= {f"{name}{SEPARATOR}{phase}": phases[phase] for phase in PHASES}
        return out

    @property
    def rois(self) -> int:
        return next(iter(self.probes.values())).rows

    def close(self) -> None:
        for probe in self.probes.values():
            probe.remove()


def _other(spans: Mapping[str, tuple[float, float]], name: str) -> tuple[float, float]:
    (other,) = (span for head, span in spans.items() if head != name)
    return other


def by_head(values: Mapping[str, list[float]], heads: Iterable[str]) -> Paired:
    """A twin's values by name (``<head>/<phase>``) as head -> phase -> one value per step."""
    out: Paired = {head: {} for head in heads}
    for key, series in values.items():
        head, separator, phase = key.rpartition(SEPARATOR)
        if separator and head in out:
            out[head][phase] = series
    return out


def twin_watched(heads: Iterable[str], watched: Iterable[str]) -> tuple[str, ...]:
    """The twin step's names of ``watched`` phases of every head."""
    return tuple(f"{head}{SEPARATOR}{phase}" for head in heads for phase in watched)
