"""RoIAlign computed as a sparse matrix product: torchvision's function, with a backward that is parallel and
deterministic.

RoIAlign is linear in the features. Each output bin (one RoI's bin (i, j)) is a fixed weighted sum of at most
4 x s_h x s_w feature positions: the four bilinear corners of each of its s_h x s_w sampling points, each
weight over the count of points. With the features as rows (level, image, y, x) by channel, the forward is
``S @ rows`` and the features' gradient ``S^T @ grad``, S a sparse matrix built from the boxes alone (indices
and weights, no feature values). Both products run as ``F.embedding_bag`` in mode sum: each output row the
weighted sum of its bag of rows, summed by one thread in a fixed order, rows in parallel (in float32, fbgemm's
kernel; float64 runs one loop, for the tests' exact comparisons). So no atomic add and no serial loop: the
same result on every run, on as many cores as torch computes with. torchvision's CPU
backward instead loops over every RoI, channel and bin in one thread (``csrc/ops/cpu/roi_align_kernel.cpp``:
the RoIs scatter into shared feature positions), and its CUDA backward adds with atomics (vision#1058).

S follows torchvision's kernels step by step (``roi_align_common.h``: the sampling points, the rule that a
point beyond one pixel off the map counts zero, the clamps at the last row and column, the count over which a
bin averages), computed in the features' dtype (float32 for float16 and bfloat16, as torchvision's autocast
computes them; torchvision's CPU kernel computes float16 in float16 and has none for bfloat16), so outputs and
the features' gradient equal torchvision's to rounding.

Where S would hold more than MAX_ENTRIES entries (many RoIs at a large adaptive sampling ratio) the call runs
torchvision's kernel instead, with a warning (once per place, as Python's warnings go).

On CUDA (embedding_bag's forward kernel sums each bag in a fixed order) the same holds by construction; it is
not verified on a GPU here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_map_only
from torchvision.ops import MultiScaleRoIAlign, RoIAlign, poolers
from torchvision.ops import roi_align as torchvision_roi_align

from rcnn.fix.timing import PathTiming, Ways, forward_backward, time_both
from rcnn.measure.inputs import channels_last, tensors

# S's entries before merging (4 x s_h x s_w per bin) above which a call falls back to torchvision's kernel:
# building S holds about 5 tensors of that size at once (indices, weights, the mask), 8 bytes an entry each:
# about 700 MB at this bound
MAX_ENTRIES = 2**24


@dataclass(frozen=True)
class SparseRows:
    """A sparse matrix by rows: row r's entries are ``index[offsets[r]:offsets[r + 1]]`` (the rows of the
    matrix it multiplies) with ``weight`` the same span; ``columns`` the rows of that matrix."""

    index: Tensor  # (E,) int64
    weight: Tensor  # (E,) the compute dtype
    offsets: Tensor  # (R,) int64: where each row's entries start
    columns: int

    @property
    def rows(self) -> int:
        return len(self.offsets)

    def matmul(self, dense: Tensor) -> Tensor:
        """This matrix times ``dense`` (columns x C): (rows x C)."""
        if not len(self.index):  # embedding_bag takes no empty index
            return dense.new_zeros(self.rows, dense.shape[1])
        return F.embedding_bag(self.index, dense, self.offsets, mode="sum", per_sample_weights=self.weight)

    def transposed(self) -> SparseRows:
        """The transpose, by rows: each column's entries in the order of their rows (a stable sort), so that
        each sum runs in one fixed order."""
        lengths = torch.diff(self.offsets, append=self.offsets.new_tensor([len(self.index)]))
        row = torch.repeat_interleave(torch.arange(self.rows, device=self.index.device), lengths)
        order = torch.argsort(self.index, stable=True)
        counts = torch.bincount(self.index, minlength=self.columns)
        return SparseRows(row[order], self.weight[order], counts.cumsum(0) - counts, self.rows)


def _axis(start: Tensor, bin_size: Tensor, grid: int, pooled: int, size: Tensor) -> tuple[Tensor, Tensor]:
    """One axis of the sampling points of RoIs that share their grid: per RoI and bin, the feature coordinates
    its points' two corners (low, high) fall on and their bilinear weights, as torchvision's
    ``bilinear_interpolate`` computes them (a point more than one pixel off the map weighs 0). Each coordinate
    once: the weights of a coordinate several points share are summed into one entry (in point order), the
    others weigh 0. Returns (K, pooled, 2 x grid) coordinates and weights."""
    dtype = start.dtype
    bins = torch.arange(pooled, device=start.device, dtype=dtype)[None, :, None]
    points = torch.arange(grid, device=start.device, dtype=dtype)[None, None, :] + 0.5
    start, bin_size, size = start[:, None, None], bin_size[:, None, None], size[:, None, None]
    # torchvision's order of operations: start + bin * size + ((point + .5) * size) / grid
    at = start + bins * bin_size + points * bin_size / grid
    off = (at < -1.0) | (at > size)
    at = at.clamp(min=0)
    low = at.long()
    edge = low >= size - 1
    last = (size - 1).long().expand_as(low)
    high = torch.where(edge, last, low + 1)
    low = torch.where(edge, last, low)
    at = torch.where(edge, low.to(dtype), at)
    far = at - low
    weights = torch.stack([1.0 - far, far], dim=-1).masked_fill(off[..., None], 0.0).flatten(2)
    coords = torch.stack([low, high], dim=-1).masked_fill(off[..., None], 0).flatten(2)
    # The points' corners in coordinate order (a stable sort keeps a coordinate's weights in point order),
    # then each run of one coordinate summed into its last entry, left to right: no scatter, one fixed order.
    coords, order = coords.sort(dim=-1, stable=True)
    weights = weights.gather(-1, order)
    for j in range(1, coords.shape[-1]):
        same = coords[..., j] == coords[..., j - 1]
        weights[..., j] += torch.where(same, weights[..., j - 1], 0.0)
        weights[..., j - 1].masked_fill_(same, 0.0)
    return coords, weights


def _geometry(rois: Tensor, scale: Tensor, aligned: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each RoI's start (x, y) and size (width, height) on its map, in torchvision's order of operations."""
    offset = 0.5 if aligned else 0.0
    x1, y1, x2, y2 = (rois[:, i] * scale - offset for i in range(1, 5))
    width, height = x2 - x1, y2 - y1
    if not aligned:  # torchvision's legacy rule: a RoI is at least one pixel
        width, height = width.clamp(min=1.0), height.clamp(min=1.0)
    return x1, y1, width, height


def _grids(width: Tensor, height: Tensor, output_size: tuple[int, int], sampling_ratio: int) -> Tensor:
    """Each RoI's sampling grid (s_h, s_w): ``sampling_ratio`` where positive, else torchvision's adaptive
    ceil(RoI size / bins)."""
    if sampling_ratio > 0:
        return torch.full((len(width), 2), sampling_ratio, dtype=torch.long, device=width.device)
    grids = torch.stack([torch.ceil(height / output_size[0]), torch.ceil(width / output_size[1])], 1).long()
    return grids.clamp(min=0)  # a reversed box (aligned) has no points: zeros, as torchvision's


def _group_entries(
    x1: Tensor,
    y1: Tensor,
    width: Tensor,
    height: Tensor,
    base: Tensor,
    map_size: tuple[Tensor, Tensor],
    output_size: tuple[int, int],
    grid: tuple[int, int],
) -> tuple[Tensor, Tensor, Tensor]:
    """S's entries for RoIs that share their sampling grid (s_h, s_w), those of weight 0 left out: how many
    each row (RoI, bin) has, (K, bins), then their feature rows and weights in row order, (E,) each."""
    (pooled_h, pooled_w), (grid_h, grid_w), (heights, widths) = output_size, grid, map_size
    ys, y_weights = _axis(y1, height / pooled_h, grid_h, pooled_h, heights.to(y1.dtype))
    xs, x_weights = _axis(x1, width / pooled_w, grid_w, pooled_w, widths.to(x1.dtype))
    y_weights = y_weights / max(grid_h * grid_w, 1)  # a bin averages its points
    rows = base[:, None, None] + ys * widths[:, None, None]  # (K, PH, Ly)
    # (K, PH, PW, Ly, Lx): a bin's entries are the products of its row's and its column's
    index = rows[:, :, None, :, None] + xs[:, None, :, None, :]
    weight = y_weights[:, :, None, :, None] * x_weights[:, None, :, None, :]
    keep = weight != 0  # a product of 0 adds nothing, as in torchvision's sum
    counts = keep.sum(dim=(-1, -2)).view(len(base), pooled_h * pooled_w)
    kept = keep.flatten().nonzero().squeeze(1)
    return counts, index.flatten()[kept], weight.flatten()[kept]


def sampling_matrix(
    rois: Tensor,
    levels: Tensor,
    shapes: list[tuple[int, int, int]],
    scales: list[float],
    output_size: tuple[int, int],
    sampling_ratio: int,
    aligned: bool,
    dtype: torch.dtype,
) -> SparseRows | None:
    """S for ``rois`` ((K, 5): image index, x1, y1, x2, y2) pooled from the feature maps of ``shapes`` ((N, H,
    W) each, stacked as rows level by level, image, y, x), RoI k from level ``levels[k]`` at ``scales`` of
    it; weights in ``dtype``. None where S would exceed MAX_ENTRIES."""
    device = rois.device
    rois = rois.to(dtype)
    sizes = torch.tensor([[h, w] for _, h, w in shapes], device=device)
    starts = torch.tensor([0] + [n * h * w for n, h, w in shapes], device=device).cumsum(0)
    scale = torch.tensor(scales, dtype=dtype, device=device)[levels]
    heights, widths = sizes[levels, 0], sizes[levels, 1]
    base = starts[levels] + rois[:, 0].long() * heights * widths
    x1, y1, width, height = _geometry(rois, scale, aligned)
    grids = _grids(width, height, output_size, sampling_ratio)
    bins = output_size[0] * output_size[1]
    if bins * 4 * int(grids.prod(dim=1).sum()) > MAX_ENTRIES:  # its entries before merging
        return None
    # one group of RoIs per sampling grid (one in all at a fixed sampling_ratio)
    grid_list = (grids[:1] if sampling_ratio > 0 else torch.unique(grids, dim=0)).tolist()
    counts = torch.zeros(len(rois), bins, dtype=torch.long, device=device)
    groups, index, weight = [], [], []
    for grid_h, grid_w in grid_list:
        members = (grids == grids.new_tensor([grid_h, grid_w])).all(dim=1).nonzero().flatten()
        if grid_h * grid_w == 0:  # an empty or reversed RoI's bins: no entries, zeros
            continue
        counts[members], group_index, group_weight = _group_entries(
            x1[members],
            y1[members],
            width[members],
            height[members],
            base[members],
            (heights[members], widths[members]),
            output_size,
            (grid_h, grid_w),
        )
        groups.append(members)
        index.append(group_index)
        weight.append(group_weight)
    counts = counts.flatten()
    offsets = counts.cumsum(0) - counts
    if len(groups) == 1:  # one group: its entries are in S's row order already
        return SparseRows(index[0], weight[0], offsets, int(starts[-1]))
    if not groups:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return SparseRows(empty, empty.to(dtype), offsets, int(starts[-1]))
    # the groups' entries interleaved by row, each row's in its order
    arange = torch.arange(bins, device=device)
    rows = [
        torch.repeat_interleave(
            (members[:, None] * bins + arange).flatten(), counts.view(-1, bins)[members].flatten()
        )
        for members in groups
    ]
    order = torch.argsort(torch.cat(rows), stable=True)
    index, weight = torch.cat(index)[order], torch.cat(weight)[order]
    return SparseRows(index, weight, offsets, int(starts[-1]))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays; every other floating dtype computes in float32, as torchvision's autocast casts."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Pool(torch.autograd.Function):
    """The pooled RoIs, ``S @ rows`` (rows: the feature maps' positions by channel, level by level), and the
    maps' gradients, ``S^T @ grad``, each map's in its own layout and dtype."""

    @staticmethod
    def forward(ctx, sampling: SparseRows, output_size: tuple[int, int], *maps: Tensor) -> Tensor:
        channels = maps[0].shape[1]
        compute = sampling.weight.dtype
        rows = torch.empty(sampling.columns, channels, dtype=compute, device=maps[0].device)
        start = 0
        for x in maps:
            n, c, h, w = x.shape
            rows[start : start + n * h * w].view(n, h, w, c).copy_(x.permute(0, 2, 3, 1))
            start += n * h * w
        pooled = sampling.matmul(rows)  # (K * bins, C)
        k = pooled.shape[0] // (output_size[0] * output_size[1])
        out = torch.empty(k, channels, *output_size, dtype=maps[0].dtype, device=maps[0].device)
        out.copy_(pooled.view(k, *output_size, channels).permute(0, 3, 1, 2))
        ctx.sampling = sampling
        ctx.maps = [(x.shape, x.dtype, _layout(x)) for x in maps]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple:
        sampling: SparseRows = ctx.sampling
        channels = grad.shape[1]
        rows = grad.permute(0, 2, 3, 1).reshape(-1, channels).to(sampling.weight.dtype)
        grad_rows = sampling.transposed().matmul(rows)
        grads, start = [], 0
        for (n, c, h, w), dtype, layout in ctx.maps:
            part = grad_rows[start : start + n * h * w].view(n, h, w, c).permute(0, 3, 1, 2)
            grads.append(part.to(dtype=dtype, memory_format=layout, copy=True))  # each map its own storage
            start += n * h * w
        return (None, None, *grads)


def _layout(x: Tensor) -> torch.memory_format:
    return (
        torch.channels_last
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        else torch.contiguous_format
    )


def _rois(boxes: Tensor | list[Tensor]) -> Tensor:
    """(K, 5) RoIs from torchvision's two box formats: one (K, 5) tensor or a (L, 4) tensor per image."""
    if isinstance(boxes, Tensor):
        return boxes
    return poolers._convert_to_roi_format(list(boxes))


FELL_BACK = (
    "the sparse RoIAlign fell back to torchvision's kernel: its sparse matrix would exceed "
    "rcnn.fix.roi_align.MAX_ENTRIES entries (many RoIs at a large adaptive sampling_ratio)"
)


def pool(
    maps: list[Tensor],
    rois: Tensor,
    levels: Tensor | None,
    scales: list[float],
    output_size: tuple[int, int],
    sampling_ratio: int,
    aligned: bool,
) -> Tensor | None:
    """RoI k of ``rois`` ((K, 5)) pooled from ``maps[levels[k]]`` at ``scales[levels[k]]`` (``levels`` None:
    all from the first), as a sparse matrix product; None where S would exceed MAX_ENTRIES (the caller then
    runs torchvision's kernel)."""
    compute = _compute_dtype(maps[0].dtype)
    if levels is None:
        levels = torch.zeros(len(rois), dtype=torch.long, device=rois.device)
    with torch.no_grad():
        sampling = sampling_matrix(
            rois.detach(),
            levels,
            [(x.shape[0], x.shape[2], x.shape[3]) for x in maps],
            scales,
            output_size,
            sampling_ratio,
            aligned,
            compute,
        )
    if sampling is None:
        warnings.warn(FELL_BACK, stacklevel=2)
        return None
    return _Pool.apply(sampling, output_size, *maps)


# eager under torch.compile: an autograd.Function carrying a Python object is no graph's to trace
@torch.compiler.disable
def roi_align(
    input: Tensor,
    boxes: Tensor | list[Tensor],
    output_size: int | tuple[int, int],
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = False,
) -> Tensor:
    """torchvision.ops.roi_align computed as a sparse matrix product: the same arguments and result, a
    backward that runs in parallel and gives the same gradient on every run.

    Args:
        input: (N, C, H, W) features, contiguous or channels-last.
        boxes: (K, 5) RoIs (image index, x1, y1, x2, y2), or one (L, 4) tensor per image.
        output_size, spatial_scale, sampling_ratio, aligned: as torchvision's.

    Returns:
        (K, C, *output_size), contiguous, in the input's dtype.

    Example:
        >>> roi_align(torch.rand(1, 8, 20, 20), [torch.tensor([[2.0, 2.0, 12.0, 9.0]])], 7, 1.0, 2).shape
        torch.Size([1, 8, 7, 7])
    """
    size = _pair(output_size)
    rois = _rois(boxes)
    pooled = pool([input], rois, None, [spatial_scale], size, sampling_ratio, aligned)
    if pooled is None:
        return torchvision_roi_align(input, rois, size, spatial_scale, sampling_ratio, aligned)
    return pooled


def _pair(size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    return (int(size[0]), int(size[-1]))


class SparseRoIAlign(RoIAlign):
    """torchvision's RoIAlign computed as a sparse matrix product (``roi_align``): the same arguments and
    result, a parallel, deterministic backward. No parameters or buffers: a swap changes nothing a checkpoint
    holds."""

    def forward(self, input: Tensor, rois: Tensor | list[Tensor]) -> Tensor:
        return roi_align(input, rois, self.output_size, self.spatial_scale, self.sampling_ratio, self.aligned)


class SparseMultiScaleRoIAlign(MultiScaleRoIAlign):
    """torchvision's MultiScaleRoIAlign (a Faster R-CNN's ``box_roi_pool``) computed as one sparse matrix
    product over all its levels: the same level mapping, scales and result, a parallel, deterministic
    backward.

    Example:
        >>> model.roi_heads.box_roi_pool.__class__ = SparseMultiScaleRoIAlign  # what rcnn.fix.linearize does
    """

    @torch.compiler.disable
    def forward(
        self, x: dict[str, Tensor], boxes: list[Tensor], image_shapes: list[tuple[int, int]]
    ) -> Tensor:
        maps = [v for k, v in x.items() if k in self.featmap_names]
        if self.scales is None or self.map_levels is None:
            self.scales, self.map_levels = poolers._setup_scales(
                maps, image_shapes, self.canonical_scale, self.canonical_level
            )
        rois = _rois(boxes)
        levels = self.map_levels(boxes) if len(maps) > 1 else None
        pooled = pool(maps, rois, levels, self.scales, self.output_size, self.sampling_ratio, aligned=False)
        if pooled is None:
            return super().forward(x, boxes, image_shapes)
        return pooled


POOL_WAYS = Ways(original="torchvision kernel", fixed="sparse product", ratio="sparse / torchvision")
_SPARSE: dict[type, type] = {RoIAlign: SparseRoIAlign, MultiScaleRoIAlign: SparseMultiScaleRoIAlign}
SPARSE_CLASSES = tuple(_SPARSE.values())


def sparse_class(cls: type) -> type | None:
    """The sparse class that computes torchvision's RoIAlign or MultiScaleRoIAlign (``cls`` itself where it
    is one); None for a subclass with a forward of its own, which a swap would bypass."""
    if issubclass(cls, SPARSE_CLASSES):
        return cls
    return _SPARSE.get(cls)


def _torchvision_class(module: nn.Module) -> type:
    return next(c for c in type(module).__mro__ if c in _SPARSE)


def time_pool(
    module: nn.Module,
    call: tuple[tuple, dict],
    *,
    deadline: float | None = None,
    decide: bool = False,
    seed: int = 0,
) -> PathTiming:
    """``module``'s forward + backward at ``call`` (its (args, kwargs)) as torchvision's kernel and as the
    sparse product, stepped in turn (rcnn.fix.timing.time_both). The features' gradient goes to fresh leaves;
    in float16 or bfloat16 both run under autocast, as torchvision's CPU kernel computes them."""
    leaves = tree_map_only(
        Tensor, lambda t: t.detach().clone().requires_grad_(t.is_floating_point() and t.dim() == 4), call
    )
    args, kwargs = leaves
    maps = [t for t in tensors(leaves) if t.requires_grad]
    half = next((t.dtype for t in maps if t.dtype in (torch.float16, torch.bfloat16)), None)
    original = _torchvision_class(module)
    device = maps[0].device if maps else torch.device("cpu")
    runs = {
        "original": forward_backward(
            lambda: original.forward(module, *args, **kwargs), maps, half, device.type
        ),
        "fixed": forward_backward(
            lambda: _SPARSE[original].forward(module, *args, **kwargs), maps, half, device.type
        ),
    }
    return time_both(runs, device, POOL_WAYS, deadline=deadline, decide=decide, seed=seed)


def timing_key(module: nn.Module, call: tuple[tuple, dict]) -> tuple:
    """What decides a pooling's two timings: its class and parameters, and each tensor of its call by shape,
    dtype, layout and device (the RoIs' count among them), with the threads torch computes with."""
    parameters = tuple(
        (name, repr(getattr(module, name, None)))
        for name in ("output_size", "spatial_scale", "sampling_ratio", "aligned", "featmap_names", "scales")
    )
    inputs = tuple(
        (tuple(t.shape), t.dtype, t.device, channels_last(t) if t.dim() == 4 else False)
        for t in tensors(call)
    )
    return _torchvision_class(module).__qualname__, parameters, inputs, torch.get_num_threads()
