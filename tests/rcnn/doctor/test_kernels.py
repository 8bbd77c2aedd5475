"""Compiled kernels given to the modules they compute (rcnn.doctor.kernels), on a tiny model compiled with
Inductor on the CPU: a conv, BatchNorm and ReLU (which Inductor fuses across the two modules) and a head of
two linears."""

import pytest
import torch
from torch import nn

from rcnn.doctor.kernels import BACKWARD, FORWARD, KernelMap, by_module, profiled
from rcnn.measure.device import compile_unavailable

pytestmark = [
    pytest.mark.slow,  # compiling takes 20-30 s on 2 CPU cores
    pytest.mark.skipif(bool(compile_unavailable(torch.device("cpu"))), reason="no torch.compile here"),
]


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc6, self.fc7 = nn.Linear(2 * 8 * 8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc7(torch.relu(self.fc6(x)))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 2, 7, padding=3), nn.BatchNorm2d(2), nn.ReLU())
        self.head = Head()

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


@pytest.fixture(scope="module")
def profiled_steps():
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 3, 8, 8)
    kernels = KernelMap()
    compiled = torch.compile(model, backend=kernels.backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        optimizer.zero_grad()
        compiled(x).sum().backward()
        optimizer.step()

    for _ in range(2):
        step()
    with profiled() as prof:
        for _ in range(3):
            step()
    return kernels, kernels.times(prof.events())


def test_every_kernel_of_both_graphs_is_timed_and_given_its_modules(profiled_steps):
    kernels, times = profiled_steps
    assert {g.phase for g in kernels.graphs} == {FORWARD, BACKWARD}
    assert set(times["phase"]) == {FORWARD, BACKWARD}
    assert (times["calls"] == 3).all() and (times["ms"] > 0).all()
    conv_backward = times[times["kernel"].str.startswith("torch.ops.aten.convolution_backward")]
    assert len(conv_backward) == 1 and set(conv_backward["modules"].iloc[0]) == {"body.0"}
    weight_grads = times[(times["phase"] == BACKWARD) & times["kernel"].str.startswith("extern_kernels.mm")]
    assert {m for row in weight_grads["modules"] for m in row} == {"head.fc6", "head.fc7"}


def test_a_kernel_fused_across_modules_is_split_by_output_bytes(profiled_steps):
    _, times = profiled_steps
    fused = times[times["modules"].map(lambda m: {"body.1", "body.2"} <= set(m))]
    assert len(fused), times[["kernel", "modules"]].to_string()
    assert len(set(fused.iloc[0]["modules"].values())) > 1  # sizes differ: an even split would not pass
    table, said = by_module(times)
    assert said["split_ms"] >= fused["ms"].sum() > 0
    assert table.to_numpy().sum() == pytest.approx(times["ms"].sum() - said["unattributed_ms"])
    for phase in (FORWARD, BACKWARD):
        rows = times[(times["phase"] == phase) & times["modules"].map(lambda m: "body.2" in m)]
        expected = sum(r.ms * r.modules["body.2"] / sum(r.modules.values()) for r in rows.itertuples())
        assert table.loc["body.2", f"{phase}_ms"] == pytest.approx(expected)
