"""What a module saw in a forward call, and inputs made like it: to run the module again alone, alike (the
doctor's backward alone, the fix's timing of both paths)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Seen:
    """What a module saw in a forward call: enough to run it again alone, alike."""

    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    output_dtype: torch.dtype  # the dtype it computed in (autocast's, or the input's)
    channels_last: bool  # the input's memory is channels-last (NHWC, NDHWC)
    input_requires_grad: bool = True

    def autocasts(self, module: nn.Module) -> bool:
        """Whether running ``module`` alike needs autocast: it computed in fp16 or bf16 with other weights
        (its input may be fp16 or bf16 already, from the module before it)."""
        half = (torch.float16, torch.bfloat16)
        return self.output_dtype in half and any(p.dtype != self.output_dtype for p in module.parameters())

    def run(self, module: nn.Module, x: torch.Tensor) -> Any:
        """``module(x)`` computed as it was seen: under autocast to its dtype where it needs it."""
        with torch.autocast(x.device.type, dtype=self.output_dtype, enabled=self.autocasts(module)):
            return module(x)

    @classmethod
    def of(cls, args: tuple, output: Any) -> Seen | None:
        """What a call with ``args`` that returned ``output`` saw; None unless it took one tensor."""
        inputs, outputs = list(tensors(args)), list(tensors(output))
        if len(inputs) != 1 or not outputs:
            return None
        x = inputs[0]
        return cls(tuple(x.shape), x.dtype, outputs[0].dtype, channels_last(x), x.requires_grad)


def example_input(seen: Seen, device: torch.device) -> torch.Tensor:
    """A random input like the one ``seen``: its shape, dtype and memory layout (no grad)."""
    x = torch.randn(seen.input_shape, device=device, dtype=seen.input_dtype)
    return x.movedim(1, -1).contiguous().movedim(-1, 1) if seen.channels_last else x


def described(t: torch.Tensor) -> str:
    """A tensor as the doctor's tables and headers name it: 'float32 (2, 3, 64, 64)'."""
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"


def describe_batch(batch: Any) -> str:
    """A batch's tensors by dtype and shape, in its structure: 'float32 (2, 3, 320, 320)' for images,
    '[2 x float32 (3, 320, 320)]' for a list of equal ones, '{input_ids: int64 (2, 128), labels: ...}' for a
    dict; anything else by its type's name.

    Example:
        >>> describe_batch({"pixel_values": torch.zeros(2, 3, 64, 64)})
        '{pixel_values: float32 (2, 3, 64, 64)}'
    """
    if isinstance(batch, torch.Tensor):
        return described(batch)
    if isinstance(batch, dict):
        return "{" + ", ".join(f"{key}: {describe_batch(value)}" for key, value in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        items = [describe_batch(item) for item in batch]
        if len(items) > 1 and len(set(items)) == 1:  # images of one size: the count, once
            inner = f"{len(items)} x {items[0]}"
        elif len(items) > 4:  # targets of different sizes: the first, and how many
            inner = f"{len(items)} items: {items[0]}, ..."
        else:
            inner = ", ".join(items)
        return f"[{inner}]" if isinstance(batch, list) else f"({inner})"
    if isinstance(batch, (int, float, bool, str)) or batch is None:
        return repr(batch)
    return type(batch).__name__


def describe_call(module: nn.Module, args: tuple, kwargs: dict) -> str:
    """A call's arguments as the caller gave them, each by its parameter's name in the module's forward:
    'images: [2 x float32 (3, 320, 320)]; targets: [2 x {boxes: float32 (3, 4), labels: int64 (3,)}]'.
    Positions stand for the names where the forward's signature does not take the call."""
    try:
        arguments = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):  # a forward without a signature to read, or a call it does not bind
        arguments = {f"argument {i}": value for i, value in enumerate(args)} | kwargs
    return "; ".join(f"{name}: {describe_batch(value)}" for name, value in arguments.items())


def channels_last(x: torch.Tensor) -> bool:
    """Whether ``x``'s memory is channels-last: its channel dimension (1) moved last is contiguous."""
    return x.dim() > 2 and not x.is_contiguous() and x.movedim(1, -1).is_contiguous()


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an output: tensors, tuples (named tuples, torch.return_types), lists and dicts of
    them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)
