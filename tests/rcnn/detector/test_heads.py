import pytest
import torch

from rcnn.detector.heads import HEADS, Conv2dAsLinear, build_box_head
from rcnn.rules import ValueNotAllowed
from rcnn.trial.schema import HEAD_NAMES

C, R, D, K = 8, 7, 16, 3  # channels, RoI grid, representation size, object classes


def heads(name: str):
    return build_box_head(name, in_channels=C, resolution=R, representation_size=D, num_classes=K)


def run(head, predictor, x):
    scores, deltas = predictor(head(x))
    (scores.square().sum() + deltas.sin().sum()).backward()
    return scores, deltas


def grads(*modules):
    return [p.grad for m in modules for p in m.parameters()]


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_as_linear_matches_conv_outputs_and_gradients(channels_last):
    torch.manual_seed(0)
    conv = [m.double() for m in heads("conv")]
    fix = [m.double() for m in heads("conv_as_linear")]
    for src, dst in zip(conv, fix):
        dst.load_state_dict(src.state_dict())  # a conv checkpoint loads unchanged
        if channels_last:
            dst.to(memory_format=torch.channels_last)
    x = torch.randn(5, C, R, R, dtype=torch.float64)
    x_conv, x_fix = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_conv, out_fix = run(*conv, x_conv), run(*fix, x_fix)
    for a, b in zip(out_conv, out_fix):
        assert a.shape == b.shape == (5, a.shape[1])
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads(*conv) + [x_conv.grad], grads(*fix) + [x_fix.grad]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_linear_equals_conv_with_reshaped_weights():
    torch.manual_seed(0)
    conv_head, conv_pred = (m.double() for m in heads("conv"))
    lin_head, lin_pred = (m.double() for m in heads("linear"))
    convs = [
        m for m in [*conv_head, conv_pred.label_head, conv_pred.bbox_head] if isinstance(m, torch.nn.Conv2d)
    ]
    linears = [
        m for m in [*lin_head, lin_pred.label_head, lin_pred.bbox_head] if isinstance(m, torch.nn.Linear)
    ]
    with torch.no_grad():
        for conv, linear in zip(convs, linears, strict=True):
            linear.weight.copy_(conv.weight.flatten(1))
            linear.bias.copy_(conv.bias)
    x = torch.randn(4, C, R, R, dtype=torch.float64)
    for a, b in zip(conv_pred(conv_head(x)), lin_pred(lin_head(x))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(HEADS))
def test_outputs_have_background_class_and_question_init(name):
    head, predictor = heads(name)
    scores, deltas = predictor(head(torch.randn(2, C, R, R)))
    assert scores.shape == (2, K + 1) and deltas.shape == (2, 4 * (K + 1))
    weights = torch.cat([p.flatten() for n, p in head.named_parameters() if n.endswith("weight")])
    assert abs(weights.std().item() - 0.01) < 0.002
    assert all(p.abs().sum() == 0 for n, p in head.named_parameters() if n.endswith("bias"))


def test_unknown_head_names_the_allowed_ones():
    with pytest.raises(
        ValueNotAllowed,
        match="head: 'mlp' is not allowed; allowed: linear, conv, conv_as_linear, or package.module:factory",
    ):
        heads("mlp")


def test_each_name_builds_the_first_layer_it_names():
    first = {
        name: [m for m in heads(name)[0] if not isinstance(m, torch.nn.Flatten)][0] for name in HEAD_NAMES
    }
    assert type(first["linear"]) is torch.nn.Linear and first["linear"].in_features == C * R * R
    assert type(first["conv"]) is torch.nn.Conv2d and first["conv"].kernel_size == (R, R)
    assert type(first["conv_as_linear"]) is Conv2dAsLinear and isinstance(
        first["conv_as_linear"], torch.nn.Conv2d
    )
    assert {name: m.weight.numel() for name, m in first.items()} == dict.fromkeys(HEAD_NAMES, C * R * R * D)


def test_conv_as_linear_runs_as_the_conv_on_inputs_larger_than_its_kernel():
    conv = torch.nn.Conv2d(C, D, kernel_size=R)
    fix = Conv2dAsLinear(C, D, kernel_size=R)
    fix.load_state_dict(conv.state_dict())
    x = torch.randn(1, C, R + 1, R + 1)
    torch.testing.assert_close(fix(x), conv(x))  # no longer a GEMM at this shape: the conv path, (1, D, 2, 2)


@pytest.mark.parametrize(
    "spec", ["tests.fixtures.question_heads:linear", "tests.fixtures.question_heads:conv"]
)
def test_a_users_head_by_factory(spec):
    box_head, predictor = build_box_head(
        spec, in_channels=8, resolution=7, representation_size=16, num_classes=3
    )
    # One module: the predictor passes it through
    scores, deltas = predictor(box_head(torch.randn(5, 8, 7, 7)))
    assert scores.shape == (5, 4) and deltas.shape == (5, 16)


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("no_such_heads:conv", "head: cannot import 'no_such_heads'"),
        ("tests.fixtures.question_heads:nope", "head: tests.fixtures.question_heads has no 'nope'"),
        (
            "tests.fixtures.models:not_a_model",
            r"head: tests.fixtures.models:not_a_model\(\) raised TypeError",
        ),
        (
            "tests.fixtures.question_heads:_cfg",
            r"head: tests.fixtures.question_heads:_cfg\(\) raised TypeError",
        ),
        (
            "tests.fixtures.models:not_a_head",
            r"returned int; allowed: \(box_head, box_predictor\) or one nn.Module",
        ),
    ],
)
def test_a_users_head_that_cannot_be_built_is_one_line(spec, problem):
    with pytest.raises(ValueNotAllowed, match=problem):
        build_box_head(spec, in_channels=8, resolution=7, representation_size=16, num_classes=3)
