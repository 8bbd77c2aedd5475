import math

import pytest
import torch
import torch.nn.functional as F

from rcnn.measure.flops import FLOP_FORMULAS, FlopCount, is_compute_op


def test_cpu_attention_counts_its_matrix_products():
    """The CPU's fused attention: forward Q @ K^T and P @ V, backward five products (scores recomputed, dP,
    dV, dQ, dK), as torch counts its CUDA ones. (The math path, taken where the fused one does not apply, does
    four products in backward: five tells the fused kernel ran and was counted.)"""
    b, h, n, s, e = 2, 3, 5, 7, 4  # n queries, s keys
    ev = e  # the CPU's fused kernel needs value's head size to be the query's
    q = torch.randn(b, h, n, e, requires_grad=True)
    k = torch.randn(b, h, s, e, requires_grad=True)
    v = torch.randn(b, h, s, ev, requires_grad=True)
    with FlopCount() as forward:
        out = F.scaled_dot_product_attention(q, k, v)
    with FlopCount() as backward:
        out.sum().backward()
    mac = 2 * b * h  # 2 FLOPs a multiply-add, for each batch and head
    assert forward.total == mac * (n * s * e + n * s * ev)
    assert backward.total == mac * (n * s * e + n * ev * s + s * n * ev + n * s * e + e * n * s)
    assert not forward.uncounted_ops and not backward.uncounted_ops
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in FLOP_FORMULAS


def test_attention_with_a_mask_is_counted_alike():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    mask = torch.zeros(4, 4)
    with FlopCount() as counted:
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum().backward()
    assert counted.total == 2 * 1 * 2 * (2 + 5) * 4 * 4 * 8


def test_a_compute_op_without_a_formula_makes_the_count_unknown():
    """oneDNN's LSTM layer has no formula: its FLOPs are NaN, not 0, and the op is named, as it runs."""
    lstm = torch.nn.LSTM(8, 16, batch_first=True)
    head = torch.nn.Linear(16, 2)
    seen = []
    with FlopCount(uncounted=seen.append) as counted:
        head(lstm(torch.randn(2, 5, 8))[0]).sum().backward()
    if not counted.uncounted_ops:
        pytest.skip("this build's LSTM decomposes into products with formulas")
    assert math.isnan(counted.total)
    assert seen and set(seen) == set(counted.uncounted_ops)
    assert counted.counted == 2 * 10 * 16 * 2 * 3  # the head's forward, input and weight gradients


def test_elementwise_ops_leave_the_count_known():
    x = torch.randn(4, 8, requires_grad=True)
    with FlopCount() as counted:
        (torch.relu(x) * 2 + x.sin()).softmax(-1).sum().backward()
    assert counted.total == 0 and not counted.uncounted_ops


def test_in_place_products_count_as_their_ops():
    a, b, c = torch.randn(3, 4), torch.randn(3, 5), torch.randn(5, 4)
    with FlopCount() as counted:
        a.addmm_(b, c)
    assert counted.total == 2 * 3 * 5 * 4


def test_the_callbacks_see_each_count():
    flops = []
    with FlopCount(flops.append) as counted:
        torch.randn(2, 3) @ torch.randn(3, 4)
    assert flops == [2 * 2 * 3 * 4] and counted.total == 48


@pytest.mark.parametrize(
    "name, compute",
    [
        ("mm", True),
        ("addmm_", True),
        ("baddbmm", True),
        ("_int_mm", True),
        ("convolution_backward", True),
        ("_slow_conv2d_forward", True),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", True),
        ("mkldnn_rnn_layer", True),
        ("linear", True),
        ("relu", False),
        ("digamma", False),  # "mm" inside a word is not a product
        ("_convert_weight_to_int4pack", False),  # nor is "conv" in "convert"
        ("upsample_bilinear2d", False),
        ("dot", False),  # vector products are memory-bound
        ("native_layer_norm", False),
    ],
)
def test_compute_ops_are_told_by_name(name, compute):
    assert is_compute_op(name) is compute


def test_bytes_touched_counts_what_each_call_reads_and_writes_and_views_nothing():
    from rcnn.measure.flops import FlopCount, bytes_touched

    x = torch.randn(8, 16)
    assert bytes_touched(torch.ops.aten.add.Tensor, (x, x), {}, x + x) == 3 * 8 * 16 * 4
    assert bytes_touched(torch.ops.aten.t.default, (x,), {}, x.t()) == 0  # a view moves nothing
    moved = []
    with FlopCount(moved=moved.append):
        torch.relu(x)
    assert sum(moved) == 2 * 8 * 16 * 4  # read x, wrote its result
