"""The doctor's report.html: the icicles hold every module, their widths add up, the tables hold the flags and
their why rows, and headless Chromium draws it (tests/browser.py)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections import Counter
from html.parser import HTMLParser

import pandas as pd
import pytest

pytest.importorskip("plotly")

from rcnn.doctor import pictures  # noqa: E402
from rcnn.doctor.columns import MODULE_COLUMNS, OUTSIDE, ROOT, WHY_COLUMNS  # noqa: E402
from rcnn.doctor.page import render_report  # noqa: E402
from tests import browser  # noqa: E402
from tests.conftest import ROOT as REPO  # noqa: E402

NAN = float("nan")
COVERS = "gemm-in-disguise:covers-input"
IMPL = (
    "oneDNN: convolution ip:any+brg_matmul:avx512_core backward_weights 42.52 ms x1; reorder jit 1.73 ms x1"
)
# name, type, calls, forward own/inclusive ms, backward own/inclusive ms, backward GFLOP, peak fraction,
# flag, saved MiB. (model) = 1 + encoder 12 + blocks 7; encoder's 12 is its children's 7 + 5 less a rounding
# error; blocks is a ModuleList, never called: 0 inclusive, as wide as its children.
ROWS = [
    (ROOT, "Net", 1, 0.5, 10.0, 1.0, 20.0, 0.0, NAN, "", 0.0),
    ("encoder", "Sequential", 1, 0.0, 6.0, 0.0, 12.0 - 1e-9, 0.0, NAN, "", 0.0),
    ("encoder.0", "Conv2d", 1, 4.0, 4.0, 7.0, 7.0, 2.0, 0.1, COVERS, 3.0),
    ("encoder.1", "ReLU", 1, 2.0, 2.0, 5.0, 5.0, 0.0, 0.0, "", 1.5),
    ("blocks", "ModuleList", 0, 0.0, 0.0, 0.0, 0.0, 0.0, NAN, "", 0.0),
    ("blocks.0", "Linear", 1, 1.5, 1.5, 3.0, 3.0, 0.5, 0.9, "", 0.25),
    ("blocks.1", "Linear", 1, 2.0, 2.0, 4.0, 4.0, 0.5, NAN, "", 0.25),
    (OUTSIDE, "", 0, 0.5, 0.5, 2.0, 2.0, 0.0, 0.0, "", 0.0),
]
SUMMARY = {"forward_ms": 10.5, "backward_ms": 22.0, "steps": 6, "warmup_steps": 3, "peak_tflops": 0.179}
FIX = {
    "eligible": 1,
    "swapped": 1,
    "paired_steps": 8,
    "forward": {"before_ms": 10.5, "after_ms": 9.25, "ratio": 0.881, "ci_low": 0.85, "ci_high": 0.91},
    "backward": {"before_ms": 22.0, "after_ms": 15.5, "ratio": 0.7045, "ci_low": 0.69, "ci_high": 0.72},
    "forward_backward": {
        "before_ms": 32.5,
        "after_ms": 24.75,
        "ratio": 0.7615,
        "ci_low": 0.75,
        "ci_high": 0.77,
    },
}


def synthetic() -> pd.DataFrame:
    frame = pd.DataFrame(
        ROWS,
        columns=[
            "module",
            "type",
            "calls",
            "forward_ms",
            "forward_inclusive_ms",
            "backward_ms",
            "backward_inclusive_ms",
            "backward_gflop",
            "peak_fraction",
            "flag",
            "saved_mb",
        ],
    )
    frame["evidence"] = ["kernel 7x7 covers its 7x7 input" if flag else "" for flag in frame["flag"]]
    return frame.reindex(columns=MODULE_COLUMNS)


def synthetic_why() -> pd.DataFrame:
    row = {
        "module": "encoder.0",
        "flag": COVERS,
        "input_shape": "256x256x7x7",
        "dtype": "float32",
        "layout": "contiguous",
        "input_grad_ms": 3.25,
        "input_grad_gflop": 1.0,
        "input_grad_impl": "oneDNN: convolution backward_data 3.00 ms x1",
        "weight_grad_ms": 3.75,
        "weight_grad_gflop": 1.0,
        "weight_grad_impl": IMPL,
        "gemm_ms": 0.5,
    }
    return pd.DataFrame([row], columns=WHY_COLUMNS)


def swaps() -> pd.DataFrame:
    swap = {"module": "encoder.0", "kind": "covers-input", "input_shape": (2, 8, 7, 7), "swapped": True}
    return pd.DataFrame([swap | {"original_ms": 7.5, "fixed_ms": 1.25}])


def trace(figure) -> dict[str, list]:
    data = figure.data[0]
    return {"ids": list(data.ids), "parents": list(data.parents), "values": list(data.values)}


def added_up(ids: list[str], parents: list[str], values: list[float]) -> None:
    """Each parent at least as wide as its children together (what plotly's branchvalues "total" needs to
    draw anything), and every parent id a node."""
    value = dict(zip(ids, values))
    children = Counter()
    for node, parent in zip(ids, parents):
        if parent:
            assert parent in value, f"{node}'s parent {parent} is no node"
            children[parent] += value[node]
    for parent, total in children.items():
        assert value[parent] >= total, (parent, value[parent], total)


def test_backward_icicle_holds_every_module_and_adds_up():
    modules = synthetic()
    built = trace(pictures.icicle(modules, "backward_inclusive_ms"))
    assert sorted(built["ids"]) == sorted([pictures.STEP, *modules["module"]])
    added_up(**built)
    value = dict(zip(built["ids"], built["values"]))
    parent = dict(zip(built["ids"], built["parents"]))
    assert parent[ROOT] == parent[OUTSIDE] == pictures.STEP
    assert parent["encoder.0"] == "encoder" and parent["blocks.1"] == "blocks" and parent["blocks"] == ROOT
    assert value[pictures.STEP] == pytest.approx(SUMMARY["backward_ms"])  # the step's whole backward
    assert value["encoder"] == pytest.approx(12.0, rel=1e-9)  # raised by the rounding error, no more
    assert value["blocks"] == 7.0  # the never-called ModuleList: its children's sum
    assert value["encoder.0"] == 7.0 and value[ROOT] == 20.0  # measured widths kept
    assert pictures.tree(modules).widened == []  # rounding and containers are not news


def test_forward_and_memory_icicles():
    modules = synthetic()
    forward = trace(pictures.icicle(modules, "forward_inclusive_ms"))
    added_up(**forward)
    assert dict(zip(forward["ids"], forward["values"]))[pictures.STEP] == pytest.approx(SUMMARY["forward_ms"])
    memory = trace(pictures.icicle(modules, "saved_mb"))  # own values, summed by name here
    added_up(**memory)
    saved = dict(zip(memory["ids"], memory["values"]))
    assert saved["encoder"] == 4.5 and saved["blocks"] == 0.5 and saved[ROOT] == 5.0
    assert saved[pictures.STEP] == 5.0


def test_parent_outgrown_beyond_rounding_is_widened_and_named():
    modules = synthetic()
    modules.loc[modules["module"] == "encoder", "backward_inclusive_ms"] = 9.0  # children: 12
    figure = pictures.icicle(modules, "backward_inclusive_ms")
    built = trace(figure)
    added_up(**built)
    assert len(built["ids"]) == len(modules) + 1
    assert pictures.tree(modules).widened == ["encoder"]
    assert "encoder" in figure.layout.title.subtitle.text
    hover = dict(zip(built["ids"], figure.data[0].hovertext))["encoder"]
    assert "measured: 9 ms" in hover and "drawn: 12 ms" in hover


def test_negative_and_missing_values_still_draw_every_module():
    modules = synthetic()
    modules.loc[modules["module"] == OUTSIDE, "backward_inclusive_ms"] = -0.25  # noise: phase total < parts
    modules.loc[modules["module"] == "blocks.1", "backward_inclusive_ms"] = NAN
    built = trace(pictures.icicle(modules, "backward_inclusive_ms"))
    assert sorted(built["ids"]) == sorted([pictures.STEP, *modules["module"]])
    assert all(math.isfinite(v) and v >= 0 for v in built["values"])  # plotly drops others, and their subtree
    added_up(**built)


def test_colour_flags_and_hover():
    figure = pictures.icicle(synthetic(), "backward_inclusive_ms")
    data = figure.data[0]
    color = dict(zip(data.ids, data.marker.colors))
    label = dict(zip(data.ids, data.labels))
    hover = dict(zip(data.ids, data.hovertext))
    assert color["blocks.1"] == color["encoder.1"] == color["encoder"] == pictures.UNKNOWN  # NaN; no FLOPs
    assert color["blocks.0"] not in (pictures.UNKNOWN, color["encoder.0"])  # 90% vs 10% of the peak
    assert label["encoder.0"] == f"{pictures.FLAG_MARK} 0 [{COVERS}]" and label["blocks.0"] == "0"
    for column in ("type: Conv2d", "backward_ms: 7", "peak_fraction: 0.1", f"flag: {COVERS}", "saved_mb: 3"):
        assert column in hover["encoder.0"]


def test_subtree_and_its_html():
    modules = synthetic()
    built = trace(pictures.icicle(modules, "backward_inclusive_ms", subtree="encoder"))
    assert built["ids"] == ["encoder", "encoder.0", "encoder.1"]
    assert built["parents"] == ["", "encoder", "encoder"]
    fragment = pictures.icicle_html(modules, subtree="encoder", include_plotlyjs=False, div_id="box-head")
    assert "<html" not in fragment and "plotly.js v" not in fragment  # for a page that has plotly.js
    assert figures(fragment)["box-head"]["ids"] == built["ids"]
    with pytest.raises(ValueError, match="subtree 'decoder' is no module"):
        pictures.icicle(modules, subtree="decoder")
    with pytest.raises(ValueError, match="allowed: backward_inclusive_ms, forward_inclusive_ms, saved_mb"):
        pictures.icicle(modules, "backward_gflop")


def figures(page: str) -> dict[str, dict]:
    """The traces the page hands plotly.js, by div id: Plotly.newPlot("id", [trace], ...)."""
    found = {}
    for match in re.finditer(r'Plotly\.newPlot\(\s*"([^"]+)",\s*', page):
        data, _ = json.JSONDecoder().raw_decode(page, match.end())
        found[match.group(1)] = data[0]
    return found


def report(modules: pd.DataFrame | None = None, **fixed) -> str:
    return render_report(
        synthetic() if modules is None else modules, synthetic_why(), SUMMARY, title="tiny <net>", **fixed
    )


def test_report_holds_the_tree_flags_why_and_fix():
    page = report(fix=FIX, swaps=swaps(), modules_after=synthetic())
    drawn = figures(page)
    assert set(drawn) == {"icicle-backward", "icicle-forward", "icicle-memory", "icicle-after"}
    modules = synthetic()
    for name, data in drawn.items():
        assert sorted(data["ids"]) == sorted([pictures.STEP, *modules["module"]]), name
        added_up(data["ids"], data["parents"], data["values"])
    assert "<script src" not in page and page.count("plotly.js v") == 1  # embedded once: opens offline
    assert "<h1>tiny &lt;net&gt;</h1>" in page  # escaped
    flags = table(page, "flags")
    assert list(flags["module"]) == ["encoder.0"] and list(flags["flag"]) == [COVERS]
    why = table(page, "why")
    assert list(why.columns) == list(WHY_COLUMNS) and list(why["module"]) == ["encoder.0"]
    assert why["weight_grad_impl"][0] == IMPL
    phases = table(page, "fix-phases")
    assert list(phases["phase"]) == ["forward", "backward", "forward + backward"]
    assert list(phases["ci_low"]) == [0.85, 0.69, 0.75] and list(phases["after_ms"]) == [9.25, 15.5, 24.75]
    assert table(page, "swaps")["fixed_ms"].tolist() == [1.25]
    top = table(page, "top")
    assert top["module"].tolist()[:2] == ["encoder.0", "encoder.1"] and top["module"].iloc[-1] == OUTSIDE
    assert table(page, "phases")["ms"].tolist() == [10.5, 22.0]


def table(page: str, table_id: str) -> pd.DataFrame:
    """The page's table of that id as pandas wrote it (header row, then cells), numbers parsed (not names)."""
    parser = _Table(table_id)
    parser.feed(page)
    assert parser.rows, f"no table {table_id!r} in the page"
    header, *rows = parser.rows
    frame = pd.DataFrame(rows, columns=header)
    for column in frame.columns.drop("module", errors="ignore"):
        numbers = pd.to_numeric(frame[column], errors="coerce")
        if numbers.notna().all():
            frame[column] = numbers
    return frame


class _Table(HTMLParser):
    def __init__(self, table_id: str) -> None:
        super().__init__()
        self.table_id, self.inside, self.rows, self.cell = table_id, False, [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table" and dict(attrs).get("id") == self.table_id:
            self.inside = True
        elif self.inside and tag == "tr":
            self.rows.append([])
        elif self.inside and tag in ("td", "th"):
            self.cell = ""

    def handle_endtag(self, tag):
        if tag == "table":
            self.inside = False
        elif self.inside and tag in ("td", "th"):
            self.rows[-1].append(self.cell)
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda m: m.drop(columns="saved_mb"), "no saved_mb column"),
        (lambda m: m.assign(saved_mb=NAN), "unknown (NaN) for every module"),
        (lambda m: m.assign(saved_mb=0.0), "saved_mb is 0 throughout"),
    ],
)
def test_no_memory_icicle_is_said(change, said):
    page = report(change(synthetic()))
    assert set(figures(page)) == {"icicle-backward", "icicle-forward"}
    assert '<p class="note" id="no-memory">No memory icicle: ' in page and said in page


def test_committed_detector_tables():
    """The doctor's real output for the conv-head detector (older tables: no saved_mb column)."""
    folder = REPO / "reports" / "doctor" / "detector_conv"
    modules = pd.read_csv(folder / "modules.csv")
    why = pd.read_csv(folder / "why.csv")
    summary = json.loads((folder / "env.json").read_text())["summary"]
    page = render_report(modules, why, summary, title="detector:conv")
    drawn = figures(page)["icicle-backward"]
    assert sorted(drawn["ids"]) == sorted([pictures.STEP, *modules["module"]])
    added_up(drawn["ids"], drawn["parents"], drawn["values"])
    step = dict(zip(drawn["ids"], drawn["values"]))[pictures.STEP]
    assert step == pytest.approx(summary["backward_ms"], rel=1e-9)
    assert pictures.tree(modules).widened == []  # fpn's ModuleLists are never called: not news
    assert table(page, "why")["module"].tolist() == why["module"].tolist()
    flagged = modules[modules["flag"].notna()].sort_values("backward_ms", ascending=False)
    assert table(page, "flags")["module"].tolist() == flagged["module"].tolist()  # most backward time first
    assert table(page, "flags")["flag"].tolist() == flagged["flag"].tolist()
    box_head = figures(pictures.icicle_html(modules, subtree="roi_heads.box_head", div_id="b"))["b"]
    assert drawn["ids"].count("roi_heads.box_head.0") == 1
    assert box_head["ids"] == [n for n in modules["module"] if n.startswith("roi_heads.box_head")]


def tiny(image_size: int = 32):
    """A model for rcnn.doctor.workloads' factory protocol: nested modules, one a GEMM in disguise."""
    from torch import nn

    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()),
        nn.Conv2d(8, 16, kernel_size=image_size),  # its kernel covers its input: a matrix product
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def test_from_a_real_diagnosis(tmp_path):
    torch = pytest.importorskip("torch")
    from rcnn.doctor import build_workload, diagnose
    from rcnn.measure.stats import TimingPolicy

    cpu = torch.device("cpu")
    workload = build_workload("tests.rcnn.doctor.test_pictures:tiny", batch_size=2, image_size=32, device=cpu)
    diagnosis = diagnose(workload, device=cpu, policy=TimingPolicy.fixed(3, warmup=1), peak_tflops=0.1)
    modules, summary = diagnosis.modules, diagnosis.summary
    page = render_report(modules, diagnosis.why, summary, title="tiny on cpu")
    drawn = figures(page)
    assert {"icicle-backward", "icicle-forward", "icicle-memory"} <= set(drawn)  # saved_mb: the conv saved
    for phase in ("backward", "forward"):
        data = drawn[f"icicle-{phase}"]
        assert sorted(data["ids"]) == sorted([pictures.STEP, *modules["module"]])
        added_up(data["ids"], data["parents"], data["values"])
        step = dict(zip(data["ids"], data["values"]))[pictures.STEP]
        assert step == pytest.approx(summary[f"{phase}_ms"], rel=1e-6)
    parent = dict(zip(drawn["icicle-backward"]["ids"], drawn["icicle-backward"]["parents"]))
    assert parent["0.0"] == "0" and parent["1"] == ROOT
    flagged = modules[modules["flag"] != ""]
    assert COVERS in flagged.set_index("module").at["1", "flag"]
    assert sorted(table(page, "flags")["module"]) == sorted(flagged["module"])
    assert set(table(page, "why")["module"]) == set(diagnosis.why["module"]) and len(diagnosis.why)
    (tmp_path / "report.html").write_text(page)


@pytest.mark.slow  # two fresh interpreters: the point is what they import
def test_torch_free_and_plotly_named_when_missing():
    code = (
        "import sys, pandas as pd\n"
        "from rcnn.doctor import pictures\n"
        "m = pd.read_csv('reports/doctor/detector_conv/modules.csv')\n"
        "pictures.icicle(m)\n"
        "assert 'torch' not in sys.modules, 'pictures imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    blocked = "import sys; sys.modules['plotly'] = None\n" + code
    done = subprocess.run(
        [sys.executable, "-c", blocked], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert (
        "PlotlyMissing: the doctor's HTML report draws with plotly, which is not installed: pip install "
        "plotly" in done.stderr
    )


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    browser.require_chromium()
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(report(fix=FIX, swaps=swaps()))
    return path


@pytest.mark.slow  # a headless Chromium
def test_chromium_draws_the_icicles_and_tables(page_file):
    dom = browser.dump_dom(page_file)
    assert dom.count('<g class="iciclelayer">') == 3  # backward, forward, memory: each drawn by plotly.js
    slices = re.findall(r'<g class="slice[ "]', dom)
    assert len(slices) == 3 * (len(ROWS) + 1)  # a box per module and the step, in each
    drawn = set(re.findall(r'class="slicetext"[^>]*data-unformatted="([^"&]*)', dom))
    labels = {
        f"{pictures.FLAG_MARK} 0 [{COVERS}]",
        "(model)",
        "(outside modules)",
        "step",
        "encoder",
        "blocks",
    }
    assert labels <= drawn, labels - drawn
    assert table(dom, "why")["input_shape"].tolist() == ["256x256x7x7"]
    assert table(dom, "flags")["flag"].tolist() == [COVERS]


@pytest.mark.slow  # a headless Chromium
def test_chromium_screenshot(page_file, tmp_path):
    from PIL import Image

    png = browser.screenshot(page_file, tmp_path / "report.png", size=(1400, 1000))
    with Image.open(png) as image:
        pixels = Counter(image.convert("RGB").getdata())
        assert image.size == (1400, 1000)
    white = pixels[(255, 255, 255)]
    assert white < 0.9 * 1400 * 1000  # not blank
    step = tuple(int(c) for c in re.findall(r"\d+", pictures.STEP_COLOR))
    unknown = tuple(int(c) for c in re.findall(r"\d+", pictures.UNKNOWN))
    figure = pictures.icicle(synthetic())
    colors = dict(zip(figure.data[0].ids, figure.data[0].marker.colors))
    fast = tuple(int(c) for c in re.findall(r"\d+", colors["blocks.0"]))
    # the step's box spans the icicle's width: a wide band of its colour; the grey and green boxes below it
    assert pixels[step] > 20_000 and pixels[unknown] > 10_000 and pixels[fast] > 1_000
