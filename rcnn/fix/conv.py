"""Convolutions that are matrix products in disguise (rcnn.disguise), computed as one: ``covers-input`` (the
kernel covers the input: F.linear on the flattened input), ``patches`` (stride equal to the kernel:
non-overlapping patches as the rows of one F.linear) and ``pointwise`` (1x1 at stride 1: a matrix product over
channels).

A swapped module changes class only: to a subclass of its own (``nn.Conv2d`` -> ``Conv2dAsLinear``), so it is
still an ``nn.Conv2d``, keeps its Parameter objects (an optimizer built before keeps working) and its
state_dict (checkpoints load both ways). On every call it checks its input and takes the convolution path
where the input is no longer of the kind it was swapped for.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rcnn.disguise import gemm_kind
from rcnn.fix.timing import CONV_WAYS, PathTiming, forward_backward, time_both
from rcnn.measure.inputs import Seen, channels_last, example_input

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _covers_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if channels_last(x):  # flatten both in (spatial, channel) order: free views of channels-last memory
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


def laid_out_as(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight`` in ``x``'s memory order, contiguous or channels-last (itself where it already is): the order
    in which ``covers-input`` flattens both without a copy."""
    if weight.dim() < 3 or channels_last(weight) == channels_last(x):
        return weight
    return weight.movedim(1, -1).contiguous().movedim(-1, 1) if channels_last(x) else weight.contiguous()


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
        if not shapes[key]:
            return super().forward(x)
        if self.gemm == "covers-input":
            self._lay_out_weight_as(x)
        return GEMMS[self.gemm](x, self.weight, self.bias)

    def _lay_out_weight_as(self, x: torch.Tensor) -> None:
        """Store the weight in its input's memory order, in place (the same Parameter, the same values), where
        they differ: a weight is read every step and copied here once, where flattening a mismatched pair
        copies the input forward and its gradient backward on every step. The question's box head under
        ``.to(memory_format=torch.channels_last)`` has a channels-last weight but contiguous RoIAlign
        features: that copy made its backward 1.02-1.05x the linear head's (benchmarks/layout_check.py). Not
        while torch.compile traces (a parameter's storage swapped inside a graph): there the copy stays."""
        weight = self.weight
        if isinstance(weight, nn.Parameter) and not torch.compiler.is_compiling():
            data = weight.data
            if (laid := laid_out_as(data, x)) is not data:
                weight.data = laid


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


def _conv_path(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module computed as the convolution its class computes (a swapped one's convolution path), without
    its hooks."""
    if isinstance(module, AsLinear):
        return functools.partial(super(AsLinear, module).forward)
    return functools.partial(type(module).forward, module)


def time_paths(
    module: nn.Module,
    seen: Seen,
    kind: str,
    *,
    deadline: float | None = None,
    decide: bool = False,
    seed: int = 0,
) -> PathTiming:
    """``module``'s forward + backward at the input it saw (``seen``), as the convolution and as the GEMM
    ``kind`` names (rcnn.disguise), stepped in turn (rcnn.fix.timing.time_both: ``deadline``, ``decide`` and
    ``seed`` passed on). Gradients go to fresh tensors, not to ``.grad``; the module is left as it was."""
    device = module.weight.device
    x = example_input(seen, device).requires_grad_(seen.input_requires_grad)
    gemm_weight = module.weight
    if kind == "covers-input":  # as the swapped module runs it: its weight laid out as its input (AsLinear)
        gemm_weight = laid_out_as(module.weight.detach(), x).requires_grad_(module.weight.requires_grad)

    def wrt(weight: torch.Tensor) -> list[torch.Tensor]:
        return [x] * seen.input_requires_grad + [
            p for p in (weight, module.bias) if p is not None and p.requires_grad
        ]

    autocast = seen.output_dtype if seen.autocasts(module) else None
    conv = _conv_path(module)
    runs = {
        "original": forward_backward(lambda: conv(x), wrt(module.weight), autocast, device.type),
        "fixed": forward_backward(
            lambda: GEMMS[kind](x, gemm_weight, module.bias), wrt(gemm_weight), autocast, device.type
        ),
    }
    return time_both(runs, device, CONV_WAYS, deadline=deadline, decide=decide, seed=seed)


def timing_key(module: nn.Module, seen: Seen, kind: str) -> tuple:
    """What decides a convolution's two timings: the convolution class that computes it, its kind and
    hyperparameters, the weights' shape, dtype and layout, what it saw, and the backends' switches."""
    weight = module.weight
    conv = tuple(getattr(module, k) for k in ("stride", "padding", "dilation", "groups", "padding_mode"))
    computes = next(c for c in type(module).__mro__ if not issubclass(c, AsLinear))
    return (
        computes.__qualname__,
        kind,
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
