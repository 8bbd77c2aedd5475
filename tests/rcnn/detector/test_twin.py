import pytest
import torch
from torch import nn

from rcnn.detector.data import synthetic_samples
from rcnn.detector.twin import TwinBoxHeads, TwinTrainer, by_head, twin_detector, twin_watched
from rcnn.trial.knobs import Knobs
from tests.conftest import TINY_CONFIG

CPU = torch.device("cpu")
SAMPLES = synthetic_samples(num_images=4, image_size=64, num_classes=2, seed=0)


class Scaled(nn.Module):
    """A predictor giving (x * scale, x * 2 * scale): what the twin's sum is checked against."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.scale, x * 2 * self.scale


def test_the_twin_runs_every_head_whole_in_its_order_and_sums_their_outputs():
    ran = []
    heads = {name: (nn.Identity(), Scaled(scale)) for name, scale in (("a", 1.0), ("b", 10.0))}
    for name, (box_head, predictor) in heads.items():
        box_head.register_forward_hook(lambda *_, name=name: ran.append(f"{name}.head"))
        predictor.register_forward_hook(lambda *_, name=name: ran.append(f"{name}.predictor"))
    twin = TwinBoxHeads(heads)
    x = torch.ones(3, 2)
    twin.order = ["b", "a"]
    scores, deltas = twin(x)
    assert ran == ["b.head", "b.predictor", "a.head", "a.predictor"]  # each head's chain at once
    assert torch.equal(scores, x * 11) and torch.equal(deltas, x * 22)


def test_the_twin_detector_has_both_heads_on_the_roi_features():
    model = twin_detector(TINY_CONFIG, ("conv", "linear"))
    assert isinstance(model.roi_heads.box_head, nn.Identity)
    twin = model.roi_heads.box_predictor
    assert twin.names == ["conv", "linear"]
    assert isinstance(twin.head("conv")[0][0], nn.Conv2d)
    assert isinstance(twin.head("linear")[0][1], nn.Linear)


@pytest.mark.slow  # a twin detector built and stepped
def test_each_heads_backward_span_holds_nothing_of_the_others_in_either_order():
    trainer = TwinTrainer(TINY_CONFIG, Knobs(head="conv", batch_size=2), "linear", SAMPLES, device=CPU)
    orders = []
    try:
        for number in range(6):
            out = trainer.step(number)
            first, second = trainer.twin.order
            orders.append((first, second))
            marks = {name: probe.marks for name, probe in trainer.probes.items()}
            # Forward: the first head's chain, then the second's; backward: the second's, then the first's.
            assert marks[first]["forward_end"] <= marks[second]["forward_start"]
            assert marks[second]["backward_end"] <= marks[first]["backward_start"]
            for head, other in ((first, second), (second, first)):
                spans = trainer.probes[other].spans_ms()
                assert out[f"{head}/step"] == pytest.approx(out["step"] - sum(spans))
                phases = [out[f"{head}/{p}"] for p in ("forward", "backward", "optimizer", "step")]
                assert phases[0] + phases[1] + phases[2] == pytest.approx(phases[3], abs=0.01)
                assert 0 < out[f"{head}/head_backward"] < phases[1]
        assert trainer.rois == 2 * TINY_CONFIG.rois_per_image
    finally:
        trainer.close()
    # Swapped every step: each head first in half of them
    assert orders == [("conv", "linear"), ("linear", "conv")] * 3


@pytest.mark.slow  # a twin detector built and stepped
def test_both_heads_of_a_twin_learn_every_step_a_users_head_too():
    # A user's head (package.module:factory: a name with dots) beside a built-in one
    users = "tests.fixtures.question_heads:conv"
    trainer = TwinTrainer(TINY_CONFIG, Knobs(head=users), "linear", SAMPLES, device=CPU)
    try:
        before = {n: p.detach().clone() for n, p in trainer.twin.named_parameters()}
        trainer.step(0)
        changed = {
            n.split(".")[1] for n, p in trainer.twin.named_parameters() if not torch.equal(p, before[n])
        }
    finally:
        trainer.close()
    assert trainer.twin.names == [users, "linear"] and changed == {"0", "1"}  # both heads' weights moved


def test_a_twins_values_split_by_head_whatever_the_heads_name():
    heads = ("my_heads.box:conv_head", "linear")
    watched = twin_watched(heads, ("head_backward", "backward"))
    assert watched == (
        "my_heads.box:conv_head/head_backward",
        "my_heads.box:conv_head/backward",
        "linear/head_backward",
        "linear/backward",
    )
    values = {name: [float(i)] for i, name in enumerate(watched)} | {"step": [9.0]}
    assert by_head(values, heads) == {
        "my_heads.box:conv_head": {"head_backward": [0.0], "backward": [1.0]},
        "linear": {"head_backward": [2.0], "backward": [3.0]},
    }


def test_a_twin_of_one_head_or_compiled_is_refused():
    with pytest.raises(ValueError, match="a twin needs two heads; both are conv"):
        TwinTrainer(TINY_CONFIG, Knobs(head="conv"), "conv", SAMPLES, device=CPU)
    with pytest.raises(ValueError, match="a twin needs two heads; both are linear"):
        twin_detector(TINY_CONFIG, ("linear", "linear"))
    with pytest.raises(ValueError, match="a twin is stepped uncompiled; compile is head"):
        TwinTrainer(TINY_CONFIG, Knobs(head="conv", compile="head"), "linear", SAMPLES, device=CPU)
