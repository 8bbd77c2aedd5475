import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from rcnn.fix import KEEP_ABOVE, Conv2dAsLinear, PathTiming, as_linear_class, linearize
from rcnn.measure.inputs import channels_last
from tests.fixtures.question_heads import conv as question_conv

# (conv, input shape, kind): each kind, in 1, 2 and 3 dimensions
CASES = [
    (lambda: nn.Conv1d(6, 10, 5), (3, 6, 5), "covers-input"),
    (lambda: nn.Conv2d(6, 10, 7), (3, 6, 7, 7), "covers-input"),
    (lambda: nn.Conv3d(6, 10, (2, 3, 3)), (3, 6, 2, 3, 3), "covers-input"),
    # A remainder of 2 dropped, as the conv does
    (
        lambda: nn.Conv1d(6, 10, 4, stride=4),
        (3, 6, 18),
        "patches",
    ),
    (lambda: nn.Conv2d(6, 10, 4, stride=4), (3, 6, 16, 18), "patches"),
    (lambda: nn.Conv3d(6, 10, (2, 4, 4), stride=(2, 4, 4)), (3, 6, 4, 8, 9), "patches"),
    (lambda: nn.Conv1d(6, 10, 1), (3, 6, 9), "pointwise"),
    (lambda: nn.Conv2d(6, 10, 1), (3, 6, 5, 4), "pointwise"),
    (lambda: nn.Conv3d(6, 10, 1), (3, 6, 2, 5, 4), "pointwise"),
]
LAYOUTS = {4: torch.channels_last, 5: torch.channels_last_3d}


def both(make, dtype=torch.float64, layout=None):
    """A conv and its linearized copy (mode always), same parameters; the example input."""
    torch.manual_seed(0)
    conv = make().to(dtype)
    fixed = copy.deepcopy(conv)
    if layout:
        conv, fixed = conv.to(memory_format=layout), fixed.to(memory_format=layout)
    return conv, fixed


def outputs_and_grads(module, x):
    x = x.clone().requires_grad_()
    out = module(x)
    (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return [out, x.grad, module.weight.grad, module.bias.grad]


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("make, shape, kind", CASES)
def test_each_kind_equals_the_conv(make, shape, kind, channels_last):
    layout = LAYOUTS.get(len(shape)) if channels_last else None
    if channels_last and layout is None:
        pytest.skip("no channels-last layout in 1-d")
    conv, fixed = both(make, layout=layout)
    x = torch.randn(shape, dtype=torch.float64)
    if layout:
        x = x.contiguous(memory_format=layout)
    swaps = linearize(fixed, x, mode="always")
    assert [(s.kind, s.swapped) for s in swaps] == [(kind, True)]
    assert isinstance(fixed, type(conv)) and type(fixed).__name__ == f"{type(conv).__name__}AsLinear"
    for a, b in zip(outputs_and_grads(conv, x), outputs_and_grads(fixed, x)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("make, shape, kind", CASES[1:2] + CASES[4:5] + CASES[7:8])
def test_fp32_and_bf16_autocast(make, shape, kind):
    conv, fixed = both(make, dtype=torch.float32)
    x = torch.randn(shape)
    linearize(fixed, x, mode="always")
    for a, b in zip(outputs_and_grads(conv, x), outputs_and_grads(fixed, x)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = conv(x), fixed(x)
    assert a.dtype == b.dtype == torch.bfloat16
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_conv_fed_by_a_conv_under_bf16_autocast(mode):
    # the second conv's input is bf16 already, its weight fp32: timing it alone must autocast it too
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(8, 16, 1), nn.Conv2d(16, 32, 8))
    x = torch.randn(2, 4, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model(x)
        swaps = linearize(model, x, mode=mode)
        out = model(x)
    assert [s.kind for s in swaps] == ["pointwise", "covers-input"]
    torch.testing.assert_close(out.float(), reference.float(), rtol=2e-2, atol=2e-2)


def test_a_new_shape_that_no_longer_qualifies_takes_the_conv_path():
    conv, fixed = both(lambda: nn.Conv2d(6, 10, 7))
    linearize(fixed, torch.randn(2, 6, 7, 7, dtype=torch.float64), mode="always")
    x = torch.randn(2, 6, 9, 9, dtype=torch.float64)  # larger than the kernel: a real convolution
    torch.testing.assert_close(fixed(x), conv(x))
    assert fixed(x).shape == (2, 10, 3, 3)


def test_same_parameters_state_dict_and_optimizer():
    conv = nn.Conv2d(6, 10, 7)
    params = list(conv.parameters())
    optimizer = torch.optim.SGD(conv.parameters(), lr=0.1)
    keys = {k: (v.shape, v.dtype) for k, v in conv.state_dict().items()}
    linearize(conv, torch.randn(2, 6, 7, 7), mode="always")
    assert isinstance(conv, nn.Conv2d) and list(conv.parameters()) == params  # the same Parameter objects
    assert {k: (v.shape, v.dtype) for k, v in conv.state_dict().items()} == keys
    before = conv.weight.detach().clone()
    conv(torch.randn(2, 6, 7, 7)).sum().backward()
    optimizer.step()  # built before the swap, it still moves the module's weight
    assert not torch.equal(conv.weight, before)
    plain = nn.Conv2d(6, 10, 7)
    plain.load_state_dict(conv.state_dict())  # checkpoints load both ways
    conv.load_state_dict(plain.state_dict())


@pytest.mark.parametrize("weight_layout, input_layout", [("channels_last", None), (None, "channels_last")])
def test_a_covers_input_weight_is_laid_out_as_its_input_once(weight_layout, input_layout):
    # .to(channels_last) makes the box head's 7x7 weight channels-last while RoIAlign's features stay
    # contiguous: the GEMM would copy the input (and its gradient) every step; the weight is copied once
    conv, fixed = both(lambda: nn.Conv2d(6, 10, 7))
    if weight_layout:
        conv, fixed = conv.to(memory_format=torch.channels_last), fixed.to(memory_format=torch.channels_last)
    x = torch.randn(3, 6, 7, 7, dtype=torch.float64)
    if input_layout:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = fixed.weight
    optimizer = torch.optim.SGD(fixed.parameters(), lr=0.1)
    timed = copy.deepcopy(fixed)
    linearize(timed, x, mode="auto")
    assert channels_last(timed.weight) == bool(weight_layout)  # timing it copied nothing of the module's
    linearize(fixed, x, mode="always")
    for a, b in zip(outputs_and_grads(conv, x), outputs_and_grads(fixed, x)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert fixed.weight is weight and channels_last(fixed.weight) == bool(input_layout)
    storage = fixed.weight.data_ptr()
    fixed(x)
    assert fixed.weight.data_ptr() == storage  # laid out once, not on every call
    before = fixed.weight.detach().clone()
    optimizer.step()  # built before, it still moves the module's weight
    assert not torch.equal(fixed.weight, before)


def test_convolutions_that_are_not_gemms_are_left_alone():
    model = nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1),
        nn.Conv2d(8, 8, 1, stride=2),
        nn.Conv2d(8, 8, 1, groups=4),
        nn.Conv2d(8, 8, 3, dilation=2, padding=2),
    )
    classes = [type(m) for m in model]
    assert linearize(model, torch.randn(2, 4, 16, 16), mode="always") == []
    assert [type(m) for m in model] == classes


def test_mode_auto_times_both_paths_in_turn_and_keeps_the_conv_only_where_it_is_shown_faster():
    model = nn.Sequential(nn.Conv2d(16, 32, 7), nn.Flatten())
    swaps = linearize(model, torch.randn(8, 16, 7, 7))
    (swap,) = swaps
    assert swap.kind == "covers-input" and swap.original_ms > 0 and swap.fixed_ms > 0 and swap.rounds >= 6
    assert swap.ci_low <= swap.ratio <= swap.ci_high  # GEMM / conv, paired over the rounds
    assert swap.swapped == (swap.ci_low <= KEEP_ABOVE)
    assert isinstance(model[0], Conv2dAsLinear) == swap.swapped


def timing(ratio, low, high):
    return PathTiming(1.0, ratio, ratio, low, high, 1 - ratio, 0.0, 0.0, rounds=6)


@pytest.mark.parametrize(
    "low, high, swapped",
    [(0.5, 0.7, True), (0.9, 1.05, True), (1.1, 1.3, False)],
    ids=["gemm-shown-faster", "no-difference-shown", "conv-shown-faster"],
)
def test_the_conv_stays_only_where_it_is_shown_faster(monkeypatch, low, high, swapped):
    from rcnn import fix

    monkeypatch.setattr(fix.conv, "time_paths", lambda *a, **k: timing((low + high) / 2, low, high))
    model = nn.Sequential(nn.Conv2d(4, 8, 7))
    (swap,) = linearize(model, torch.randn(2, 4, 7, 7))
    assert swap.swapped == swapped == isinstance(model[0], Conv2dAsLinear)
    assert (swap.ci_low, swap.ci_high) == (low, high)


def test_bad_use_is_one_clear_value_error_and_swaps_nothing():
    model = nn.Sequential(nn.Conv2d(4, 8, 7), nn.Flatten(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"needs an example input .* linearize\(model, images\)"):
        linearize(model)
    with pytest.raises(ValueError, match="the model's forward failed on the example"):
        linearize(model, torch.randn(2, 3, 7, 7))  # 3 channels where the conv takes 4
    with pytest.raises(ValueError, match="mode 'fast' is not allowed; allowed: auto, always"):
        linearize(model, torch.randn(2, 4, 7, 7), mode="fast")
    assert type(model[0]) is nn.Conv2d


def test_a_subclass_with_its_own_forward_is_not_swapped():
    class Scaled(nn.Conv2d):
        def forward(self, x):
            return 2 * super().forward(x)

    assert as_linear_class(Scaled) is None
    assert as_linear_class(type("Plain", (nn.Conv3d,), {})).__name__ == "PlainAsLinear"


def _mobilenet_v3_count() -> int:
    from torchvision.models.mobilenetv3 import _mobilenet_v3_conf

    blocks, _ = _mobilenet_v3_conf("mobilenet_v3_large")
    # per block: the 1x1 expansion (where it widens), the 1x1 projection, squeeze-excite's two 1x1 convs on
    # a 1x1 map; then the last 1x1 conv
    return sum((b.expanded_channels != b.input_channels) + 1 + 2 * b.use_se for b in blocks) + 1


def _efficientnet_b0_count() -> int:
    from torchvision.models.efficientnet import _efficientnet_conf

    stages, _ = _efficientnet_conf("efficientnet_b0", width_mult=1.0, depth_mult=1.0)
    return sum(s.num_layers * ((s.expand_ratio != 1) + 2 + 1) for s in stages) + 1


MODELS = [  # builder, input, swaps by an independent count (from the architecture, not from shapes)
    ("resnet18", (2, 3, 64, 64), lambda: 0),  # 3x3 padded, 7x7/2 stem, 1x1/2 shortcuts
    ("vit_b_16", (2, 3, 64, 64), lambda: 1),  # the 16x16/16 patch embedding
    ("convnext_tiny", (2, 3, 64, 64), lambda: 4),  # the 4x4/4 stem, three 2x2/2 downsamplers
    ("swin_t", (2, 3, 64, 64), lambda: 1),  # the 4x4/4 patch embedding (merging is Linear)
    ("swin3d_t", (1, 3, 4, 64, 64), lambda: 1),  # the 2x4x4 patch embedding
    ("mobilenet_v3_large", (2, 3, 64, 64), _mobilenet_v3_count),
    ("efficientnet_b0", (2, 3, 64, 64), _efficientnet_b0_count),
]


@pytest.mark.slow
@pytest.mark.parametrize("builder, shape, count", MODELS, ids=[m[0] for m in MODELS])
def test_torchvision_models_equal_after_the_swap(builder, shape, count):
    from torchvision import models

    torch.manual_seed(0)
    extra = {"image_size": shape[-1]} if builder.startswith("vit") else {}
    # eval: no dropout, no stochastic depth; float64: untrained deep models give tiny outputs that fp32's
    # rounding would blur (EfficientNet-B0's are 1e-13 here), and the swap must change nothing but rounding.
    model = models.get_model(builder, weights=None, **extra).eval().double()
    fixed = copy.deepcopy(model)
    x = torch.randn(shape, dtype=torch.float64)
    swaps = linearize(fixed, x, mode="always")
    assert sum(s.swapped for s in swaps) == len(swaps) == count()
    out, out_fixed = model(x), fixed(x)
    torch.testing.assert_close(out_fixed, out, rtol=1e-7, atol=1e-7 * out.abs().max().item())
    out.square().sum().backward()
    out_fixed.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), fixed.parameters()):
        scale = p.grad.abs().max().item() or 1.0
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-7, atol=1e-7 * scale, msg=name)


def test_the_questions_conv_head():
    head = question_conv(in_channels=16, resolution=7, representation_size=32, num_classes=3).double()
    fixed = copy.deepcopy(head)
    x = torch.randn(6, 16, 7, 7, dtype=torch.float64)
    swaps = linearize(fixed, x, mode="always")
    # the 7x7 conv covers its input; the 1x1 conv and both predictors run on its 1x1 output
    assert [(s.module, s.kind) for s in swaps] == [
        ("feature_head.0", "covers-input"),
        ("feature_head.2", "covers-input"),
        ("label_head", "covers-input"),
        ("bbox_head", "covers-input"),
    ]
    for a, b in zip(head(x), fixed(x)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("make, shape, kind", CASES[1:2] + CASES[4:5] + CASES[7:8])
def test_on_cuda_under_fp16_autocast(make, shape, kind):
    conv, fixed = (m.cuda() for m in both(make, dtype=torch.float32))
    x = torch.randn(shape, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        swaps = linearize(fixed, x, mode="always")
        a, b = conv(x), fixed(x)
    assert [s.kind for s in swaps] == [kind] and a.dtype == b.dtype == torch.float16
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_a_declined_or_failed_swap_leaves_the_module_exactly_as_it_was(monkeypatch):
    from rcnn import fix

    model = nn.Sequential(nn.Conv2d(4, 8, 7), Conv2dAsLinear(8, 8, 1))
    model[1].gemm = None  # a user's choice: always the conv
    monkeypatch.setattr(fix.conv, "time_paths", lambda *a, **k: timing(2.0, 1.8, 2.2))  # the GEMM slower
    swaps = linearize(model, torch.randn(2, 4, 7, 7))
    assert [s.swapped for s in swaps] == [False, False]
    assert type(model[0]) is nn.Conv2d and "gemm" not in vars(model[0])
    assert model[1].gemm is None
    monkeypatch.setattr(fix.conv, "time_paths", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        linearize(model, torch.randn(2, 4, 7, 7))
    assert type(model[0]) is nn.Conv2d and model[1].gemm is None


def test_no_grad_unbatched_inputs_and_buffers():
    model = nn.Sequential(nn.Conv2d(4, 8, 7), nn.BatchNorm2d(8))
    running = model[1].running_mean.clone()
    with torch.no_grad():  # the backward is timed all the same
        (swap,) = linearize(model, torch.randn(2, 4, 7, 7))
    assert swap.original_ms > 0 and swap.fixed_ms > 0
    assert torch.equal(model[1].running_mean, running)  # the example's forward left no trace
    conv = nn.Conv2d(4, 8, 7)
    assert linearize(conv, torch.randn(4, 7, 7), mode="always") == []  # unbatched: not a GEMM as such
    fixed = copy.deepcopy(conv)
    (swap,) = linearize(fixed, torch.randn(2, 4, 7, 7), mode="always")
    assert swap.swapped and type(fixed) is Conv2dAsLinear
    x = torch.randn(4, 7, 7)  # unbatched after the swap: the conv's path, the conv's values
    torch.testing.assert_close(fixed(x), conv(x))


def test_patches_output_has_the_convs_layout():
    conv, fixed = both(lambda: nn.Conv2d(6, 10, 4, stride=4), dtype=torch.float32)
    x = torch.randn(3, 6, 16, 16)
    linearize(fixed, x, mode="always")
    assert fixed(x).is_contiguous() and fixed(x).view(3, -1).shape == (3, 160)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    assert fixed(x_cl).is_contiguous(memory_format=torch.channels_last)


def test_timings_kept_by_the_caller_time_each_convolution_once(monkeypatch):
    import rcnn.fix as fix

    calls = []
    real = fix.conv.time_paths
    monkeypatch.setattr(
        fix.conv, "time_paths", lambda *args, **kwargs: calls.append(args[1]) or real(*args, **kwargs)
    )
    timings: dict = {}
    x = torch.randn(4, 16, 7, 7)
    for _ in range(2):
        fix.linearize(nn.Sequential(nn.Conv2d(16, 32, 7)), x)
    assert len(calls) == 2  # no dict kept: each call times
    calls.clear()
    models = [nn.Sequential(nn.Conv2d(16, 32, 7), nn.Flatten(), nn.Linear(32, 2)) for _ in range(3)]
    swaps = [fix.linearize_with(m, lambda m=m: m(x), timings=timings) for m in models[:2]]
    assert len(calls) == 1 and len(timings) == 1  # the second model's identical conv: the first's timings
    assert swaps[0][0].original_ms == swaps[1][0].original_ms and swaps[0][0].swapped == swaps[1][0].swapped
    with torch.autocast("cpu", dtype=torch.bfloat16):  # another dtype seen: timed anew
        fix.linearize_with(models[2], lambda: models[2](x), timings=timings)
    assert len(calls) == 2 and len(timings) == 2


def test_identical_convolutions_in_one_call_share_one_timing_and_one_decision(monkeypatch):
    import rcnn.fix as fix

    calls = []
    # would the second be timed, it would be declined
    times = iter([timing(0.9, 0.8, 0.95), timing(1.2, 1.1, 1.3), timing(0.9, 0.8, 0.95)])
    monkeypatch.setattr(fix.conv, "time_paths", lambda *args, **kwargs: calls.append(args[1]) or next(times))
    model = nn.Sequential(*[nn.Conv2d(16, 16, 1) for _ in range(3)])  # one shape, dtype and layout
    swaps = linearize(model, torch.randn(2, 16, 5, 5, requires_grad=True))  # each sees what the others see
    assert len(calls) == 1 and [s.swapped for s in swaps] == [True] * 3
    assert len({(s.original_ms, s.fixed_ms) for s in swaps}) == 1


def test_a_deadline_cuts_the_timings_rounds_down_to_three():
    import time

    import rcnn.fix as fix

    (swap,) = linearize(nn.Sequential(nn.Conv2d(8, 8, 3)), torch.randn(2, 8, 3, 3))
    assert swap.rounds >= fix.DECISION_POLICY.iterations
    x = torch.randn(2, 8, 7, 7)
    model = nn.Sequential(nn.Conv2d(8, 8, 7))
    (swap,) = fix.linearize_with(model, lambda: model(x), deadline=time.monotonic() - 1)  # already past
    assert swap.rounds == 3  # a median and its CI need three
    assert swap.swapped == (
        swap.ci_low <= KEEP_ABOVE
    )  # too few rounds to flag; the conv stays only if shown over 5% faster
    # The timing that must decide (the doctor's longest convolution) gets its rounds past the deadline
    (seen,) = fix.swap._seen_by_module(model, lambda: model(x)).values()
    deciding = fix.time_paths(model[0], seen, "covers-input", deadline=time.monotonic() - 1, decide=True)
    assert deciding.rounds >= fix.DECIDING_ROUNDS


@pytest.mark.parametrize(
    "low, high, rounds, flagged, swapped, verdict",
    [
        (0.5, 0.7, 6, True, True, "the GEMM is faster"),
        (0.5, 0.7, 3, False, True, "not decided: 3 rounds before the deadline, 6 needed"),
        (0.9, 1.05, 6, False, True, "no difference shown"),
        # the conv faster, its lead not shown beyond the 5% the fix aims at: swapped, not flagged
        (1.02, 1.2, 6, False, True, "the convolution is faster, not shown faster by over 5%"),
        (
            1.1,
            1.3,
            3,
            False,
            False,
            "not decided: 3 rounds before the deadline, 6 needed; "
            "the convolution stays (its CI lies over 1.05)",
        ),
        (1.1, 1.3, 6, False, False, "the convolution is faster, by over 5%"),
    ],
)
def test_a_flag_needs_the_gemm_shown_faster_a_kept_conv_the_conv(
    low, high, rounds, flagged, swapped, verdict
):
    timed = replace(timing((low + high) / 2, low, high), rounds=rounds)
    assert (timed.fix_faster, timed.swaps, timed.verdict) == (flagged, swapped, verdict)


@pytest.mark.parametrize(
    "low, high, settled",
    [
        (0.5, 0.9, True),  # the GEMM shown faster: flagged and swapped
        (1.1, 1.3, True),  # the conv shown over 5% faster: kept
        (1.01, 1.04, True),  # the conv faster by under 5%: swapped, no flag
        (0.9, 1.1, False),  # no difference shown yet
        (1.02, 1.2, False),  # the conv faster, its lead not settled either side of 5%
    ],
)
def test_the_timing_stops_early_only_once_more_rounds_cannot_change_a_decision(low, high, settled):
    assert timing((low + high) / 2, low, high).settled == settled
