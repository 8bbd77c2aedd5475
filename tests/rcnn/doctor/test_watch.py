import contextlib
import copy
import json
import sys
import threading
import time
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rcnn.doctor.attribution import MB
from rcnn.doctor.columns import MODULE_COLUMNS, OUTSIDE, WHY_COLUMNS
from rcnn.doctor.steps import _Following, top_function_mode
from rcnn.doctor.watching import NothingWatched, NothingWatchedWarning, watch
from rcnn.measure.loop import in_turn
from rcnn.measure.stats import TimingPolicy, median_ratio
from rcnn.outputs import OutputError
from tests.fixtures.models import SleepyBackward

QUICK = TimingPolicy(warmup=1, max_warmup=1)  # one warm-up step after the FLOP-counting one
SLEEP_S = 0.02


class Sleeper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.sleepy = SleepyBackward(SLEEP_S)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.sleepy(self.first(x))))


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_a_users_loop_with_two_forwards_accumulation_gradscaler_and_a_loss_outside(one_thread):
    torch.manual_seed(0)
    model = Sleeper()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with watch(model, steps=3, policy=QUICK, peak_tflops=None, explain=False) as w:
        for _ in range(8):
            for _ in range(2):  # gradient accumulation: two micro-batches, each two forwards, one backward
                a, b = model(torch.randn(8, 16)), model(torch.randn(8, 16))
                loss = F.mse_loss(a, b) + a.pow(2).mean()  # the loss: outside the model
                scaler.scale(loss).backward()
            # Gradients zeroed in place, not to None: only the optimizer step (the scaler's) ends a step.
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=False)
    table = w.table().set_index("module")
    s = w.diagnosis.summary
    assert (s["steps"], s["warmup_steps"], s["forwards_per_step"], s["backwards_per_step"]) == (3, 1, 4, 2)
    assert table.loc["sleepy", "calls"] == 4
    assert table.loc["sleepy", "backward_ms"] == pytest.approx(4 * SLEEP_S * 1e3, rel=0.05)
    assert table.loc["first", "backward_ms"] < 0.05 * 4 * SLEEP_S * 1e3  # the sleep is not charged on
    assert table["backward_ms"].sum() == pytest.approx(s["backward_ms"])  # the OUTSIDE row closes the sum
    assert 0 < table.loc[OUTSIDE, "backward_ms"] < 0.1 * s["backward_ms"]
    assert list(w.table().columns) == list(MODULE_COLUMNS)


@contextlib.contextmanager
def _busy_python_thread() -> Iterator[None]:
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            sum(range(100))

    interval = sys.getswitchinterval()
    # A fifth of the default: each GIL hand-over waits less, so the test runs sooner.
    sys.setswitchinterval(0.001)
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)


@pytest.mark.slow  # steps timed in turn beside a busy thread: seconds
def test_the_hooks_come_off_after_the_steps_and_the_loop_then_runs_as_unwatched():
    torch.manual_seed(0)
    layers = [m for _ in range(30) for m in (nn.Linear(8, 8), nn.ReLU())]
    watched, plain, busy = (nn.Sequential(*copy.deepcopy(layers)) for _ in range(3))
    x = torch.randn(4, 8)

    def stepper(model: nn.Module):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)

        last: dict[str, torch.Tensor] = {}

        def step() -> dict[str, float]:
            start = time.perf_counter()
            loss = model(x).sum()
            backward = time.perf_counter()
            loss.backward()
            backward = time.perf_counter() - backward
            opt.step()
            opt.zero_grad()
            # Held through the next forward, as a loop's variable holds it, and with it the graph.
            last["loss"] = loss
            return {"step": time.perf_counter() - start, "backward": backward}

        return step

    steps = {name: stepper(model) for name, model in (("watched", watched), ("plain", plain), ("busy", busy))}
    before = _hooks(watched)
    rounds = TimingPolicy.fixed(31, warmup=2)  # a median of 31 ratios: steady against the machine's swings
    with watch(busy, steps=10**6, peak_tflops=None) as still:  # a watch that never detaches: the cost seen
        on = in_turn({k: steps[k] for k in ("busy", "plain")}, rounds)
        assert still.hooks > 0 and not still.detached
    with watch(watched, steps=2, policy=TimingPolicy.fixed(2), peak_tflops=None, explain=False) as w:
        for _ in range(5):  # the FLOP step, 2 timed steps: detached from the fourth step on
            assert w.hooks > 0 or w.detached
            steps["watched"]()
        assert w.detached and w.hooks == 0 and _hooks(watched) == before
        assert not isinstance(top_function_mode(), _Following)
        # With another Python thread running (a data loader's, a logger's), a Python hook left on a node that
        # outlives the step, emptied or not, would wait for the GIL in every backward: the backward shows it.
        with _busy_python_thread():
            # Twice the rounds: the GIL's hand-overs make each backward's time swing more.
            contended = TimingPolicy.fixed(61, warmup=2)
            off = in_turn({k: steps[k] for k in ("watched", "plain")}, contended, watched=("backward",))
    assert w.diagnosis.summary["steps"] == 2
    watching, _, _ = median_ratio(on["busy"]["step"], on["plain"]["step"])
    detached, _, _ = median_ratio(off["watched"]["backward"], off["plain"]["backward"])
    assert watching > 1.3  # the hooks cost this much on tiny layers: the check below can see them
    assert 0.8 < detached < 1.12  # what a hook left behind would add (1.4-2.2x seen); below 1 is noise alone


def test_two_watches_at_once_detach_each_in_its_optimizer_hook():
    models = [nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in models]
    first = watch(models[0], steps=1, policy=TimingPolicy.fixed(1), peak_tflops=None, explain=False)
    second = watch(models[1], steps=3, policy=TimingPolicy.fixed(3), peak_tflops=None, explain=False)
    with first, second:  # the first detaches in its optimizer hook while torch still has the second's to run
        for _ in range(6):
            for model, opt in zip(models, optimizers):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
        assert first.detached and second.detached and first.hooks == second.hooks == 0
    assert first.diagnosis.summary["steps"] == 1 and second.diagnosis.summary["steps"] == 3
    assert _hooks(models[0]) == _hooks(models[1]) == 0
    assert top_function_mode() is None


def test_the_bytes_saved_for_backward_by_module_each_storage_once():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with watch(model, steps=1, policy=TimingPolicy.fixed(1), peak_tflops=None, explain=False) as w:
        for _ in range(3):
            model(torch.randn(16, 64)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    saved = w.table().set_index("module")["saved_mb"] * MB
    # The first Linear saves its input (its weight is a parameter, no activation); ReLU its output, which the
    # second Linear saves too: charged once, to ReLU, which saved it first.
    assert saved["0"] == 16 * 64 * 4 and saved["1"] == 16 * 32 * 4 and saved["2"] == 0
    assert w.diagnosis.summary["saved_mb"] * MB == 16 * 64 * 4 + 16 * 32 * 4
    assert w.table()["backward_peak_mb"].isna().all()  # CUDA only


def test_w_step_marks_steps_the_detection_cannot_follow(one_thread):
    model = Sleeper()

    def manual_step() -> None:  # no optimizer, gradients zeroed in place: nothing ends a step by itself
        model(torch.randn(8, 16)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                p.grad.zero_()

    quiet = watch(model, steps=2, policy=QUICK, peak_tflops=None, explain=False)
    with pytest.warns(NothingWatchedWarning, match="all of them the FLOP-counting one"), quiet as merged:
        for _ in range(5):
            manual_step()
    with watch(model, steps=2, policy=QUICK, peak_tflops=None, explain=False) as w:
        for _ in range(5):
            with w.step():
                manual_step()
    assert w.diagnosis.summary["steps"] == 2
    assert w.table().set_index("module").loc["sleepy", "backward_ms"] == pytest.approx(
        SLEEP_S * 1e3, rel=0.05
    )
    assert merged._steps.ended == 1  # five steps found as one
    with watch(model, steps=2, policy=QUICK, peak_tflops=None, explain=False) as by_grad:
        for _ in range(5):
            with by_grad.step():  # a backward through torch.autograd.grad: seen inside a marked step
                grads = torch.autograd.grad(model(torch.randn(8, 16)).sum(), list(model.parameters()))
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads):
                    p -= 0.01 * g
    assert by_grad.table().set_index("module").loc["sleepy", "backward_ms"] == pytest.approx(
        SLEEP_S * 1e3, rel=0.05
    )


def test_no_grad_and_no_backward_say_so_and_save_writes_nothing(tmp_path):
    model = nn.Linear(4, 4)
    with (
        pytest.warns(NothingWatchedWarning, match="only under torch.no_grad"),
        torch.no_grad(),
        watch(model) as w,
    ):
        for _ in range(3):
            model(torch.randn(2, 4))
    assert "only under torch.no_grad" in str(w)
    with pytest.raises(NothingWatched, match="no_grad"):
        w.save(tmp_path / "out")
    with pytest.warns(NothingWatchedWarning, match="no backward"), watch(model) as w:
        for _ in range(3):
            model(torch.randn(2, 4)).sum()
    with pytest.raises(NothingWatched, match="no backward"):
        w.table()
    assert not (tmp_path / "out").exists()


def test_save_writes_the_tables_and_the_page_and_refuses_a_foreign_folder(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingWatchedWarning)
        with watch(model, steps=2, policy=QUICK, peak_tflops=1.0) as w:
            for _ in range(6):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
                    model(torch.randn(8, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
    out = tmp_path / "doctor-run"
    written = sorted(p.name for p in w.save(out))
    assert written == ["env.json", "modules.csv", "report.html", "trace.json", "why.csv"]
    assert '"2"' in (out / "report.html").read_text()  # the icicle's tree holds the second Linear
    env = json.loads((out / "env.json").read_text())
    assert env["inputs"] == ["input: float32 (8, 16)"] and env["amp"] == "off"  # nn.Sequential's argument
    assert env["ceilings"]["matmul_tflops"] == {"fp32": 1.0} and env["fingerprint"]["torch"]
    assert (
        env["summary"]["steps"] == 2 and env["summary"]["core_share"] > 0
    )  # the timed steps' share of cores
    assert (out / "why.csv").read_text().startswith(",".join(WHY_COLUMNS))
    w.save(out)  # its own: rewritten
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    with pytest.raises(OutputError, match="holds files this command did not write"):
        w.save(foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["mine.txt"]
    printed = str(w)
    assert "Top 15 modules" in printed and "in its own loop: input: float32 (8, 16)" in printed


@pytest.mark.gpu
def test_saved_and_backward_peak_match_the_cuda_allocator():
    cuda = torch.device("cuda")
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 8, 1),
    ).to(cuda)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def step() -> tuple[int, int]:
        """One step; (bytes allocated by the forward and still held at the backward, the backward's peak)."""
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(
            torch.randn(8, 3, 64, 64, device=cuda)
        ).mean()  # the output is freed: mean saves no input
        held = torch.cuda.memory_allocated() - before
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        peak = torch.cuda.max_memory_allocated()
        opt.step()
        opt.zero_grad()
        return held, peak

    with watch(model, steps=3, policy=QUICK, peak_tflops=None, explain=False) as w:
        while not w.detached:
            step()
        held, peak = step()  # unwatched now: the allocator's own peak is not reset by the watch
    s = w.diagnosis.summary
    assert s["saved_mb"] * MB == pytest.approx(held, rel=0.1)
    assert s["backward_peak_mb"] * MB == pytest.approx(peak, rel=0.1)
    assert w.table().set_index("module").loc["0", "saved_mb"] * MB == 8 * 3 * 64 * 64 * 4  # its input


def test_autocast_and_channels_last_are_read_as_the_steps_ran():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1)).to(
        memory_format=torch.channels_last
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    with watch(model, steps=2, policy=QUICK, peak_tflops=None, explain=False) as w:
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    env = w.env
    assert (env["amp"], env["dtype"], env["channels_last"]) == ("bf16", "bf16", True)
    assert env["inputs"] == ["input: float32 (2, 3, 16, 16)"] and w.diagnosis.summary["dtype"] == "bf16"


def test_without_plotly_save_writes_the_tables_and_says_why_there_is_no_page(tmp_path, monkeypatch):
    from rcnn.doctor import pictures

    def missing():
        raise ImportError("no plotly")

    monkeypatch.setattr(pictures, "require_plotly", missing)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with watch(model, steps=2, policy=QUICK, peak_tflops=1.0) as w:
        for _ in range(6):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    with pytest.warns(UserWarning, match=r"report.html not written: .*pip install plotly"):
        written = w.save(tmp_path / "run")
    assert sorted(p.name for p in written) == ["env.json", "modules.csv", "trace.json", "why.csv"]


class SlowForward(nn.Module):
    """A Linear whose forward also waits 20 ms: steps long enough for a deadline to matter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return self.fc(x)


def test_a_deadline_that_ends_warm_up_is_said_and_one_that_does_not_is_not():
    model = SlowForward()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    long_warmup = TimingPolicy(warmup=40, max_warmup=40, settle_window=40)

    def run(policy: TimingPolicy):
        with watch(model, steps=3, policy=policy, peak_tflops=1.0, explain=False) as w:
            for _ in range(60):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
                if w.detached:
                    break
        return w

    cut = run(long_warmup.until(time.monotonic() + 0.4))
    summary = cut.diagnosis.summary
    assert summary["warmup_cut"] and summary["warmup_steps"] < 40 and summary["steps"] == 3
    assert "Warm-up ended at the --max-seconds bound" in str(cut)
    settled = run(QUICK.until(time.monotonic() + 60))
    assert not settled.diagnosis.summary["warmup_cut"] and "Warm-up ended" not in str(settled)


def test_every_export_of_the_doctor_is_what_it_names_after_its_modules_loaded():
    """A submodule named as an export would shadow it once imported: ``from rcnn.doctor import watch`` must
    give the function, whatever was imported before."""
    import importlib
    import pkgutil
    import types

    import rcnn.doctor

    for info in pkgutil.iter_modules(rcnn.doctor.__path__):
        if info.name != "__main__":  # the command itself: it would run
            importlib.import_module(f"rcnn.doctor.{info.name}")
    for name in rcnn.doctor.__all__:
        assert not isinstance(getattr(rcnn.doctor, name), types.ModuleType), name
    from rcnn.doctor import watch as exported

    assert exported is watch
