"""The automatic fix: modules that are matrix products in disguise, computed as one, for training.

``linearize(model, *example_args, **example_kwargs)`` runs one forward with the example to see each module's
input, then swaps, in place, each one that is a matrix product in disguise there (rcnn.disguise names the
kinds) for the same function computed as one, unless the module as written is shown more than 5% faster at
that input. One module per disguise:

- ``rcnn.fix.conv``: convolutions that are GEMMs (``Conv2dAsLinear``: the question's 7x7 box-head conv as
  one F.linear);
- ``rcnn.fix.roi_align``: torchvision's RoIAlign and MultiScaleRoIAlign as a sparse matrix product
  (``SparseMultiScaleRoIAlign``, and ``rcnn.fix.roi_align.roi_align`` for torchvision's function: a
  parallel, deterministic backward);
- ``rcnn.fix.timing``: both ways timed in turn at a module's input, the decision and its words;
- ``rcnn.fix.swap``: ``linearize``, the swap.

A swap changes a module's class only, to a subclass of its own: it keeps its Parameter objects and its
state_dict, so optimizers and checkpoints carry on.
"""

from rcnn.fix.conv import (
    CONVS,
    GEMMS,
    AsLinear,
    Conv1dAsLinear,
    Conv2dAsLinear,
    Conv3dAsLinear,
    as_linear_class,
    laid_out_as,
    time_paths,
)
from rcnn.fix.roi_align import SparseMultiScaleRoIAlign, SparseRoIAlign, sparse_class, time_pool
from rcnn.fix.swap import MODES, SWAP_TIMING, Swap, fix_timing, linearize, linearize_with
from rcnn.fix.timing import DECIDING_ROUNDS, DECISION_POLICY, KEEP_ABOVE, PathTiming, settled

__all__ = [
    "CONVS",
    "DECIDING_ROUNDS",
    "DECISION_POLICY",
    "GEMMS",
    "KEEP_ABOVE",
    "MODES",
    "SWAP_TIMING",
    "AsLinear",
    "Conv1dAsLinear",
    "Conv2dAsLinear",
    "Conv3dAsLinear",
    "PathTiming",
    "SparseMultiScaleRoIAlign",
    "SparseRoIAlign",
    "Swap",
    "as_linear_class",
    "fix_timing",
    "laid_out_as",
    "linearize",
    "linearize_with",
    "settled",
    "sparse_class",
    "time_paths",
    "time_pool",
]
