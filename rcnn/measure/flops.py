"""FLOPs of the aten calls inside a region, by torch's FlopCounterMode formulas, with the convolution
backward's corrected for grouped convolutions."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import conv_flop_count, flop_registry


def _conv_backward_flops(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    _bias,
    _stride,
    _padding,
    _dilation,
    transposed: bool,
    _output_padding,
    _groups,
    output_mask,
    out_val=None,
) -> int:
    """Each gradient of a convolution costs its forward's FLOPs. FlopCounterMode's own formula (torch 2.14)
    counts a grouped convolution's weight gradient as if ungrouped: a depthwise conv's backward groups-
    fold."""
    forward = conv_flop_count(list(x.shape), list(weight.shape), list(grad_out.shape), transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


# FlopCounterMode's formulas, by aten operator, with the convolution backward's corrected.
FLOP_FORMULAS = {**flop_registry, torch.ops.aten.convolution_backward: _conv_backward_flops}


class FlopCount(TorchDispatchMode):
    """Counts the FLOPs of each aten call inside (FLOP_FORMULAS), passing each count to ``count`` (by default
    summed in ``total``)."""

    def __init__(self, count: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.total = 0
        self.count = count or self._add

    def _add(self, flops: int) -> None:
        self.total += flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet not in FLOP_FORMULAS and hasattr(func, "decompose"):
            # As FlopCounterMode: an op without a formula may decompose into ops with one.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if packet in FLOP_FORMULAS:
            self.count(FLOP_FORMULAS[packet](*args, **kwargs, out_val=out))
        return out
