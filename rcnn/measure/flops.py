"""FLOPs of the aten calls inside a region, by torch's FlopCounterMode formulas, with the convolution
backward's corrected for grouped convolutions and the scaled-dot-product attentions torch has no formula for
(the CPU's, among them) counted as its CUDA ones are.

A compute op with no formula is not silently worth 0: FlopCount names it (``uncounted``) and its ``total`` is
NaN. A compute op is a matrix product, a convolution, an attention or a recurrent layer, told by its name
(``is_compute_op``): the ops whose FLOPs grow faster than the bytes they touch. Elementwise, reduction, view
and copy ops are memory-bound, their FLOPs a rounding error beside these, and are left out as
FlopCounterMode leaves them.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter
from torch.utils.flop_counter import conv_flop_count, flop_registry

aten = torch.ops.aten


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


def _sdpa_variants() -> dict:
    """Scaled-dot-product attentions without a formula in torch's registry (torch 2.4 to 2.14 have the CUDA
    flash, efficient and cuDNN ones only), mapped to those formulas: each variant's forward takes (query, key,
    value, ...) and its backward (grad_out, query, key, value, ...) as the CUDA flash ones do, and does the
    same two (forward) or five (backward) batched matrix products."""
    forward = flop_registry[aten._scaled_dot_product_flash_attention]
    backward = flop_registry[aten._scaled_dot_product_flash_attention_backward]
    names = {
        "_scaled_dot_product_flash_attention_for_cpu": forward,
        "_scaled_dot_product_flash_attention_for_cpu_backward": backward,
        "_scaled_dot_product_fused_attention_overrideable": forward,
        "_scaled_dot_product_fused_attention_overrideable_backward": backward,
        "_scaled_dot_product_attention_math_for_mps": forward,
    }
    variants = {getattr(aten, name): formula for name, formula in names.items() if hasattr(aten, name)}
    return {op: formula for op, formula in variants.items() if op not in flop_registry}


def _in_place_variants() -> dict:
    """``addmm_`` and ``baddbmm_`` as ``addmm`` and ``baddbmm``: an in-place variant takes its op's
    arguments."""
    names = {packet.__name__: formula for packet, formula in flop_registry.items()}
    return {
        getattr(aten, name + "_"): formula
        for name, formula in names.items()
        if hasattr(aten, name + "_") and getattr(aten, name + "_") not in flop_registry
    }


# FlopCounterMode's formulas, by aten operator, with the convolution backward's corrected and the attentions
# and in-place products it lacks added.
FLOP_FORMULAS = {
    **flop_registry,
    **_in_place_variants(),
    aten.convolution_backward: _conv_backward_flops,
    **_sdpa_variants(),
}

# Name tokens (split on "_") of the compute ops: mm, bmm, addmm, _int_mm, _weight_int4pack_mm, matmul,
# linear, convolution, conv2d, slow_conv3d, ..._attention..., lstm, gru, rnn. Not dot, mv or addr: vector
# products touch each input once, memory-bound like elementwise ops.
_COMPUTE_TOKEN = re.compile(r"(add|badd)?b?mm|matmul|linear|conv(\dd|olution)?|attention|rnn|lstm|gru")


@functools.cache
def is_compute_op(name: str) -> bool:
    """Whether the aten op named ``name`` ('mm', '_scaled_dot_product_flash_attention_for_cpu') is a compute
    op (see the module's docstring): one whose FLOPs matter, so that running it without a formula leaves the
    count unknown."""
    return any(_COMPUTE_TOKEN.fullmatch(token) for token in name.split("_"))


def bytes_touched(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> int:
    """The bytes an aten call's tensors hold, its inputs and outputs (each tensor's elements, not its
    storage's): what it reads and writes at least, counted, not measured (caches may serve some of it, and a
    kernel may read a tensor twice). A view moves nothing: 0."""
    if getattr(func, "is_view", False):
        return 0
    return sum(
        t.numel() * t.element_size()
        for t in tree_iter((args, kwargs, out))
        if isinstance(t, torch.Tensor) and t.layout == torch.strided
    )


class FlopCount(TorchDispatchMode):
    """Counts the FLOPs of each aten call inside (FLOP_FORMULAS), the compute ops that ran without a
    formula, and (``moved``) the bytes each call's tensors hold.

    Args:
        count: called with the FLOPs of each call with a formula, as it runs.
        uncounted: called with the name of each compute op (``is_compute_op``) that ran without a formula, as
            it runs (e.g. 'mkldnn_rnn_layer'): its FLOPs are unknown.
        moved: called with each call's ``bytes_touched``, as it runs.

    Attributes:
        counted: the FLOPs of the calls with a formula, summed.
        uncounted_ops: the compute ops that ran without a formula, by name, with their number of calls.

    Example:
        >>> with FlopCount() as flops:
        ...     model(x).sum().backward()
        >>> flops.total  # NaN if flops.uncounted_ops names any op
    """

    def __init__(
        self,
        count: Callable[[int], None] | None = None,
        uncounted: Callable[[str], None] | None = None,
        moved: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__()
        self.counted = 0
        self.uncounted_ops: Counter[str] = Counter()
        self._count = count
        self._uncounted = uncounted
        self._moved = moved

    @property
    def total(self) -> float:
        """The FLOPs of every call inside; NaN where a compute op ran without a formula (unknown, not 0)."""
        return math.nan if self.uncounted_ops else self.counted

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
        if self._moved:
            self._moved(bytes_touched(func, args, kwargs, out))
        if packet in FLOP_FORMULAS:
            flops = FLOP_FORMULAS[packet](*args, **kwargs, out_val=out)
            self.counted += flops
            if self._count:
                self._count(flops)
        elif is_compute_op(packet.__name__):
            self.uncounted_ops[packet.__name__] += 1
            if self._uncounted:
                self._uncounted(packet.__name__)
        return out
