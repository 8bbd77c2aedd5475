"""The automatic fix: every convolution that is a matrix product in disguise, run as one, for training.

``linearize(model, *example_args, **example_kwargs)`` runs one forward with the example to see each
convolution's input, then swaps, in place, each Conv1d/2d/3d that is a GEMM at that shape (rcnn.disguise):
``covers-input`` (the kernel covers the input: F.linear on the flattened input), ``patches`` (stride equal to
the kernel: non-overlapping patches as the rows of one F.linear) and ``pointwise`` (1x1 at stride 1: a matrix
product over channels). In ``mode="auto"`` each eligible module's forward + backward is timed both ways at the
shape, dtype, layout and device it saw, and the GEMM kept where it is clearly faster (AUTO_MARGIN; as
cudnn.benchmark picks algorithms, but per module);
``mode="always"`` swaps every eligible one.

A swapped module changes class only: to a subclass of its own (``nn.Conv2d`` -> ``Conv2dAsLinear``), so it is
still an ``nn.Conv2d``, keeps its Parameter objects (an optimizer built before keeps working) and its
state_dict (checkpoints load both ways). On every call it checks its input and takes the convolution path
where the input is no longer of the kind it was swapped for.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rcnn.disguise import gemm_kind
from rcnn.measure.clock import Clock, median_ms
from rcnn.measure.inputs import Seen, channels_last, example_input
from rcnn.measure.stats import runs_within

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
MODES = ("auto", "always")
AUTO_MARGIN = 0.95  # mode auto swaps where the GEMM takes under 95% of the conv's time: a win, not noise


def _covers_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if channels_last(weight):  # flatten both in (spatial, channel) order: free views of channels-last memory
        x, weight = x.movedim(1, -1), weight.movedim(1, -1)
    out = F.linear(x.flatten(1), weight.flatten(1), bias)
    return out.view(*out.shape, *[1] * (weight.dim() - 2))


def _pointwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    w = weight.flatten(1)
    if channels_last(x):  # (N, *S, C) rows: one F.linear, its output channels-last as the conv's would be
        return F.linear(x.movedim(1, -1), w, bias).movedim(-1, 1)
    out = torch.matmul(w, x.flatten(2))  # (O, C) @ (N, C, S): no copy of a contiguous input
    if bias is not None:
        out = out + bias.to(out.dtype)[:, None]
    return out.view(*out.shape[:2], *x.shape[2:])


def _patches(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel, given = weight.shape[2:], x
    n, c = x.shape[:2]
    sizes = [s // k for s, k in zip(x.shape[2:], kernel)]
    x = x[(..., *[slice(0, o * k) for o, k in zip(sizes, kernel)])]  # the remainder a conv drops
    x = x.reshape(n, c, *[v for o, k in zip(sizes, kernel) for v in (o, k)])  # (N, C, o1, k1, o2, k2, ...)
    d = len(kernel)
    # (N, o1, o2, ..., C, k1, k2, ...)
    rows = x.permute(0, *range(2, 2 + 2 * d, 2), 1, *range(3, 3 + 2 * d, 2))
    out = F.linear(rows.reshape(n * math.prod(sizes), c * math.prod(kernel)), weight.flatten(1), bias)
    out = out.view(n, *sizes, -1).movedim(-1, 1)  # channels-last memory
    return out if channels_last(given) else out.contiguous()  # the conv's layout: as its input's


GEMMS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    "covers-input": _covers_input,
    "pointwise": _pointwise,
    "patches": _patches,
}


class AsLinear:
    """Mixin for a convolution class: runs as one matrix product while its input is of the kind ``gemm``
    names (rcnn.disguise), as the convolution otherwise. ``gemm = None`` is the convolution always."""

    gemm: str | None = "covers-input"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gemm:
            return super().forward(x)
        # input shape -> GEMM or not: decided once per shape
        shapes = self.__dict__.setdefault("_gemm_at", {})
        key = (tuple(x.shape), self.gemm)
        if key not in shapes:
            found = gemm_kind(self, key[0])
            shapes[key] = found is not None and found[0] == self.gemm
        return GEMMS[self.gemm](x, self.weight, self.bias) if shapes[key] else super().forward(x)


class Conv1dAsLinear(AsLinear, nn.Conv1d):
    """An nn.Conv1d computed as one matrix product where its input allows (AsLinear)."""


class Conv2dAsLinear(AsLinear, nn.Conv2d):
    """An nn.Conv2d computed as one matrix product where its input allows (AsLinear): by default where its
    kernel covers its whole input, as the question's 7x7 box-head conv on 7x7 RoI features.

    A drop-in for ``nn.Conv2d``: the same arguments, parameters, state_dict and checkpoints, and an instance
    of ``nn.Conv2d``. Where the input is larger than the kernel it runs as the convolution.

    Args:
        in_channels, out_channels, kernel_size, ...: as ``nn.Conv2d``.

    Example:
        >>> head = Conv2dAsLinear(256, 1024, kernel_size=7)  # was nn.Conv2d(256, 1024, kernel_size=7)
        >>> head(torch.randn(512, 256, 7, 7)).shape  # F.linear(x.flatten(1), weight.flatten(1), bias)
        torch.Size([512, 1024, 1, 1])
    """


class Conv3dAsLinear(AsLinear, nn.Conv3d):
    """An nn.Conv3d computed as one matrix product where its input allows (AsLinear)."""


_AS_LINEAR: dict[type, type] = {
    nn.Conv1d: Conv1dAsLinear,
    nn.Conv2d: Conv2dAsLinear,
    nn.Conv3d: Conv3dAsLinear,
}


def as_linear_class(cls: type) -> type | None:
    """The AsLinear subclass of a convolution class, made once (and importable from here, so a pickled model
    loads); None for a class with a forward (or _conv_forward) of its own, which the swap would bypass."""
    if issubclass(cls, AsLinear):
        return cls
    if cls not in _AS_LINEAR:
        base = next((c for c in cls.__mro__ if c in CONVS), None)
        own = {"forward", "_conv_forward"}  # what the GEMM path would bypass
        if base is None or any(own & set(vars(k)) for k in cls.__mro__[: cls.__mro__.index(base)]):
            return None
        made = type(
            f"{cls.__name__}AsLinear",
            (AsLinear, cls),
            {"__module__": __name__, "__doc__": f"{cls.__name__}, with AsLinear."},
        )
        globals()[made.__name__] = made
        _AS_LINEAR[cls] = made
    return _AS_LINEAR[cls]


@dataclass(frozen=True)
class Swap:
    """One eligible convolution: its name, kind and the input it saw, whether it was swapped, and in mode auto
    the forward + backward ms of either path at that input."""

    module: str
    kind: str
    input_shape: tuple[int, ...]
    swapped: bool
    conv_ms: float = float("nan")
    gemm_ms: float = float("nan")


def _time_paths(
    module: nn.Module, seen: Seen, device: torch.device, repeats: int = 5, deadline: float | None = None
) -> tuple[float, float]:
    """Median forward + backward ms of ``module`` as the convolution and as the GEMM (its ``gemm`` set), at
    the input it saw; gradients go to fresh tensors, not to ``.grad``. ``deadline`` (``time.monotonic()``):
    fewer repeats, down to one a path, where ``repeats`` would not end before it."""
    x = example_input(seen, device).requires_grad_(seen.input_requires_grad)
    params = [p for p in module.parameters() if p.requires_grad]
    wrt = [x] * seen.input_requires_grad + params
    clock = Clock(device)
    kind, times, grad_was = module.gemm, [], torch.is_grad_enabled()

    def forward_backward() -> None:
        out = seen.run(module, x)
        if wrt:
            torch.autograd.grad(out, wrt, torch.ones_like(out))

    try:
        torch.set_grad_enabled(True)  # linearize may be called under no_grad: the backward is timed too
        for i, path in enumerate((None, kind)):
            module.gemm = path
            first = clock.time(forward_backward) / 1e3  # burn-in, and what one run costs
            # what is left shared by this path and the next
            fit = runs_within(repeats, first * (2 - i), deadline)
            times.append(median_ms(lambda: clock.time(forward_backward), repeats=fit, burn_in=1))
    finally:
        module.gemm = kind
        torch.set_grad_enabled(grad_was)
    return times[0], times[1]


def _seen_by_module(model: nn.Module, forward: Callable[[], Any]) -> dict[str, Seen]:
    """What each convolution of ``model`` saw in ``forward()`` (its first call), leaving buffers as they
    were."""
    seen: dict[str, Seen] = {}
    convs = {module: name for name, module in model.named_modules() if isinstance(module, CONVS)}

    def record(module: nn.Module, args: tuple, output: Any) -> None:
        if convs[module] not in seen and (found := Seen.of(args, output)):
            seen[convs[module]] = found

    handles = [module.register_forward_hook(record) for module in convs]
    buffers = [b.detach().clone() for b in model.buffers()]  # a training forward moves BatchNorm's statistics
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):  # nor the random streams (RoI sampling, dropout)
            forward()
    except Exception as err:
        raise ValueError(
            f"linearize: the model's forward failed on the example ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); give inputs the model takes, as "
            "linearize(model, images) or linearize(model, images, targets)"
        ) from err
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), buffers):
                buffer.copy_(saved)
    return seen


def _timing_key(module: nn.Module, seen: Seen) -> tuple:
    """What decides a convolution's two timings: its kind and hyperparameters, the weights' shape, dtype and
    layout, what it saw, and the backends' switches."""
    weight = module.weight
    conv = tuple(getattr(module, k) for k in ("stride", "padding", "dilation", "groups", "padding_mode"))
    return (
        type(module).__name__,
        module.gemm,
        conv,
        module.bias is not None,
        tuple(weight.shape),
        weight.dtype,
        weight.device,
        weight.is_contiguous(memory_format=torch.channels_last) if weight.dim() == 4 else False,
        seen,
        torch.backends.mkldnn.enabled,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
    )


def linearize_with(
    model: nn.Module,
    forward: Callable[[], Any],
    *,
    mode: str = "auto",
    timings: dict | None = None,
    deadline: float | None = None,
) -> list[Swap]:
    """``linearize`` with the example forward as a function (a detector's, with its targets and loss).

    In mode auto identical convolutions (kind, hyperparameters, weights' shape, dtype and layout) at identical
    inputs and backend switches share one timing, so one decision. ``timings``: a dict the caller keeps to
    share them across calls too (models that share a backbone time it once); None: within this call.
    ``deadline`` (``time.monotonic()`` seconds, None: none): the timings take fewer repeats, down to one a
    path, where theirs would not end before it (a command's bound, rcnn.measure.stats.TimingPolicy)."""
    if mode not in MODES:
        raise ValueError(f"linearize: mode {mode!r} is not allowed; allowed: {', '.join(MODES)}")
    timings = {} if timings is None else timings
    seen = _seen_by_module(model, forward)
    modules = dict(model.named_modules())
    swaps = []
    for name, input_seen in seen.items():
        module = modules[name]
        found = gemm_kind(module, input_seen.input_shape)
        cls = as_linear_class(type(module))
        if found is None or cls is None:
            continue
        kind = found[0]
        was = type(module), {k: vars(module)[k] for k in ("gemm", "_gemm_at") if k in vars(module)}
        module.__class__, module.gemm = cls, kind
        vars(module).pop("_gemm_at", None)
        conv_ms = gemm_ms = float("nan")
        try:
            if mode == "auto":
                key = _timing_key(module, input_seen)
                if key not in timings:
                    timings[key] = _time_paths(module, input_seen, module.weight.device, deadline=deadline)
                conv_ms, gemm_ms = timings[key]
            swapped = mode == "always" or gemm_ms < AUTO_MARGIN * conv_ms
        finally:  # declined, or the timing failed: the module exactly as it was
            if mode == "auto" and not (gemm_ms < AUTO_MARGIN * conv_ms):
                module.__class__ = was[0]
                for key in ("gemm", "_gemm_at"):
                    vars(module).pop(key, None)
                vars(module).update(was[1])
        swaps.append(Swap(name, kind, input_seen.input_shape, swapped, conv_ms, gemm_ms))
    return swaps


def linearize(model: nn.Module, *example_args: Any, mode: str = "auto", **example_kwargs: Any) -> list[Swap]:
    """Swap, in place, each convolution of ``model`` that is a GEMM in disguise at the shape it sees in one
    forward for the same convolution computed as one matrix product (rcnn.disguise names the kinds).

    Call it where the model trains: after ``.to(device)`` and ``channels_last``, inside autocast if you train
    with it, before or after building the optimizer (the Parameter objects stay the same).

    Args:
        model: any module; changed in place, each swapped convolution to its AsLinear subclass.
        *example_args, **example_kwargs: a batch the model takes, ``model(*example_args, **example_kwargs)``;
            one forward runs on it (buffers such as BatchNorm's running stats are left as they were).
        mode: ``"auto"`` swaps where the GEMM's forward + backward is faster than the convolution's at that
            shape, dtype, layout and device (by AUTO_MARGIN); ``"always"`` swaps every eligible one.

    Returns:
        One Swap per eligible convolution: its name, kind, input shape, whether it was swapped, and in mode
        auto the forward + backward ms of either path.

    Raises:
        ValueError: no example, an unknown mode, or the forward failed on the example (nothing swapped).

    Example:
        >>> swaps = linearize(model, images)  # before the training loop
        >>> [s.module for s in swaps if s.swapped]
        ['roi_heads.box_head.0']
    """
    if not example_args and not example_kwargs:
        raise ValueError(
            "linearize needs an example input to see each convolution's input shape: linearize(model, images)"
        )
    return linearize_with(model, lambda: model(*example_args, **example_kwargs), mode=mode)
