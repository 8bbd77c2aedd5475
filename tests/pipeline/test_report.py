"""The report and the compare command, generated from a small fixed results folder (no sweep)."""

import json
import re
import shutil
import sys

import numpy as np
import pandas as pd
import pytest

from pipeline import compare, report
from pipeline.report_results import Results
from pipeline.report_verdict import verdict
from pipeline.results import comparisons_table, fastest, summarize_trials, write_table, write_trials
from rcnn.trial.schema import KERNEL_COLUMNS
from tests import launcher
from tests.conftest import ROOT, fake_trials, write_tiny_params

SECTIONS = [
    "## Verdict",
    "## Knob effects",
    "## Where the time goes",
    "## Batch-size scaling",
    "## Speed vs memory",
    "## Against the limit",
    "## Why",
    "## Backward by module",
    "## torch.compile",
    "## Environment and reproduction",
    "## Where the sweep's time went",
    "## Trials",
]
FIGURES = ["head_backward", "time_split", "batch_scaling", "pareto", "roofline"]


def write_results(folder, scale=1.0, batch_2_cost=2.0):
    trials, samples = fake_trials(scale, batch_2_cost)
    comparisons = comparisons_table(trials, samples)
    kernels = pd.DataFrame(
        [
            {
                "trial": 1,
                "head": "conv",
                "cudnn_benchmark": "n/a",
                "onednn": True,
                "amp": "off",
                "channels_last": False,
                "batch_size": 1,
                "kind": "op",
                "name": "aten::convolution_backward",
                "ms": 30.0,
                "calls": 4,
                "share": 0.9,
            }
        ],
        columns=KERNEL_COLUMNS,
    )
    folder.mkdir(parents=True, exist_ok=True)
    write_trials(trials, folder / "trials.csv")
    write_table(comparisons, folder / "comparisons.csv")
    write_table(kernels, folder / "kernels.csv")
    summary = summarize_trials(trials, comparisons) | {"skipped": [], "study": "s", "git_commit": "abc123"}
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "env.json").write_text(
        json.dumps(
            {
                "fingerprint": {"device": "cpu", "cpu_model": "Test CPU", "torch": "2.x"},
                "ceilings": {"matmul_tflops": {"fp32": 0.5}, "copy_gbps": 20},
            }
        )
    )
    return folder


def report_args(folder, out):
    return ["--out", str(out)] + [
        a
        for name in ("trials", "comparisons", "kernels", "summary", "env")
        for a in (
            f"--{name}",
            str(folder / (f"{name}.json" if name in ("summary", "env") else f"{name}.csv")),
        )
    ]


XEON_MODULES = ROOT / "reports" / "compile-cpu-xeon" / "modules.csv"  # a sweep's by-module table, profiled


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """The report stage run once on write_results' folder and a real by-module table: (results, params,
    reports folder). Tests read it; one that changes files works on a copy."""
    root = tmp_path_factory.mktemp("rendered")
    folder, out, params = write_results(root / "results"), root / "reports", write_tiny_params(root)
    args = ["--params", str(params), *report_args(folder, out), "--modules", str(XEON_MODULES)]
    assert report.main(args) == 0
    return folder, params, out


def test_report_has_every_section_figure_and_the_verdict_numbers(rendered):
    _, _, out = rendered
    text = (out / "report.md").read_text()
    positions = [text.index(section) for section in SECTIONS]
    assert positions == sorted(positions)  # in the documented order
    # Hand-computed from the medians (samples jitter by 1%): head backward conv 40 / linear 10 -> 4x, whole
    # backward 130 / 100 -> 1.3x, conv_as_linear 11 / 10 -> 1.1x.
    conv = re.search(r"conv / linear, box-head backward: \*\*([\d.]+)x \(95% CI ([\d.]+)-([\d.]+)\)", text)
    assert float(conv[1]) == pytest.approx(4.0, rel=0.01) and float(conv[2]) < float(conv[1]) < float(conv[3])
    assert float(re.search(r"; whole backward ([\d.]+)x", text)[1]) == pytest.approx(1.3, rel=0.01)
    fix = re.search(r"conv_as_linear / linear, box-head backward: \*\*([\d.]+)x", text)
    assert float(fix[1]) == pytest.approx(1.1, rel=0.01) and "it closes the gap" in text
    assert "batch_size 1 -> 2" in text and "aten::convolution_backward" in text and "`abc123`" in text
    for name in FIGURES:
        assert (out / "figures" / f"{name}.png").stat().st_size > 5000
        assert len(pd.read_csv(out / "plots" / f"{name}.csv")) > 0
        assert f"figures/{name}.png" in text
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(FIGURES) and 'src="figures/' not in html
    assert "<table>" in html


def test_time_split_numbers(rendered):
    _, _, out = rendered
    split = pd.read_csv(out / "plots" / "time_split.csv").pivot(index="head", columns="part", values="ms")
    assert split.loc["conv", "box-head backward"] == pytest.approx(40, rel=0.02)
    assert split.loc["conv", "rest of backward"] == pytest.approx(90, rel=0.03)
    assert split.loc["linear"].sum() == pytest.approx(100 + 50 + 5, rel=0.02)  # backward, forward, optimizer


def test_settings_are_ranked_by_time_per_image_not_per_step(tmp_path, tiny_params):
    # Batch 2's step takes 1.7x batch 1's: longer per step (linear: 340 ms against 200) but shorter per image
    # (170 ms against 200). Ranked per step, batch 1 would win; per image, batch 2 does.
    trials = fake_trials(batch_2_cost=1.7)[0]
    done = trials[trials["status"] == "complete"]
    assert done.loc[done["step_ms"].idxmin(), "batch_size"] == 1  # the rankings disagree on this table
    best = fastest(trials)
    assert (best["head"], best["batch_size"]) == ("linear", 2)
    assert best["ms_per_image"] == pytest.approx(170, rel=0.02) and best["step_ms"] == pytest.approx(
        340, rel=0.02
    )

    folder = write_results(tmp_path / "results", batch_2_cost=1.7)
    out = tmp_path / "reports"
    assert report.main(["--params", str(tiny_params())] + report_args(folder, out)) == 0
    text = (out / "report.md").read_text()
    line = re.search(
        r"- fastest setting, by time per image \(step time / batch size\): head=(\w+), .*"
        r"batch_size=(\d+), linearize=False, tf32=n/a, compile=off at (\d+) ms per image \((\d+) ms per "
        r"step of 2 images\)",
        text,
    )
    assert line and (line[1], line[2]) == ("linear", "2"), text
    assert int(line[3]) == pytest.approx(170, rel=0.02) and int(line[4]) == pytest.approx(340, rel=0.02)
    # The Pareto front is per image too: linear at batch 2 (fastest per image) and at batch 1 (leanest); per
    # step, batch 1 alone would be on it.
    pareto = pd.read_csv(out / "plots" / "pareto.csv")
    batch = pareto["setting"].str.extract(r"bs (\d+)$")[0].astype(int)
    assert pareto["ms_per_image"].to_numpy() == pytest.approx(
        (pareto["step_ms"] / batch).to_numpy(), abs=0.01
    )
    front = pareto[pareto["pareto"]]
    assert sorted(zip(front["head"], batch[front.index])) == [("linear", 1), ("linear", 2)]
    assert pareto["ms_per_image"].is_monotonic_increasing  # ranked by it


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "trials.csv").unlink(), "trials.csv: missing; run the sweep stage first"),
        (lambda f: (f / "summary.json").write_text("{oops"), "summary.json: not valid JSON"),
        (lambda f: (f / "comparisons.csv").write_text("a,b\n1,2\n"), "comparisons.csv: missing columns"),
        (lambda f: (f / "env.json").write_text("{}"), "env.json: needs 'fingerprint' and 'ceilings'"),
    ],
)
def test_missing_or_malformed_results_give_one_line(tmp_path, tiny_params, damage, message):
    folder = write_results(tmp_path / "results")
    damage(folder)
    result = launcher.run(
        [sys.executable, "-m", "pipeline.report", "--params", str(tiny_params())]
        + report_args(folder, tmp_path / "out"),
        cwd=ROOT,
    )
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "report.md").exists()


def test_compare_two_machines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the project: compare writes inside it
    fast, slow = write_results(tmp_path / "fast", scale=0.5), write_results(tmp_path / "slow", scale=1.0)
    out = tmp_path / "compare"
    assert compare.main([str(slow), str(fast), "--out", str(out)]) == 0
    assert compare.main([str(slow), str(fast), "--out", str(out)]) == 0  # its own files it replaces
    text = (out / "compare.md").read_text()
    assert (
        text.count("conv / linear head backward") == 1
        and (out / "figures" / "head_backward_by_machine.png").exists()
    )
    table = pd.read_csv(out / "head_backward_by_machine.csv").set_index("head")
    assert (table.iloc[:, 1] / table.iloc[:, 0]).round(2).eq(0.5).all()
    assert compare.main([str(slow), "--out", str(out)]) == 2
    assert compare.main([str(slow), str(tmp_path / "none"), "--out", str(out)]) == 2


def test_the_verdict_says_what_linearize_swapped_and_how_close_it_came():
    from pipeline.report_verdict import linearize_lines

    trials, _ = fake_trials()
    done = trials[trials["status"] == "complete"]
    fixed = done[done["head"] == "conv"].copy()
    fixed["linearize"] = True
    fixed["head_backward_ms"] = done[done["head"] == "conv_as_linear"]["head_backward_ms"].to_numpy() * 1.02
    fixed["swapped"] = ["roi_heads.box_head.0 roi_heads.box_head.2", "roi_heads.box_head.0"]
    assert linearize_lines(trials) == []  # no trial with the knob on: nothing to say
    (line,) = linearize_lines(pd.concat([trials, fixed]))
    assert (
        "swapped `roi_heads.box_head.0` (in 2 of 2 settings), `roi_heads.box_head.2` (in 1 of 2 settings)"
        in line
    )
    assert (
        "box-head backward is 1.02x conv_as_linear's (geometric mean over 2 settings of the two "
        "trials' medians; within the 5%" in line
    )


def compiled_fixture(conv_speedup: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """fake_trials with every setting also compiled (compile: head), the compiled conv head ``conv_speedup``
    times faster in the box-head backward than eager; and the comparisons table of the whole."""
    trials, samples = fake_trials()
    done = trials[trials["status"] == "complete"]
    compiled = done.assign(
        compile="head",
        trial=done["trial"] + 100,
        compile_ms=5000.0,
        compile_steps=1,
        compiled_graphs=2,
        graph_breaks=0,
    )
    for old, new in zip(done["trial"], compiled["trial"]):
        factor = conv_speedup if done.set_index("trial").loc[old, "head"] == "conv" else 1.0
        samples[new] = {**samples[old], "head_backward": [x / factor for x in samples[old]["head_backward"]]}
    compiled.loc[compiled["head"] == "conv", "head_backward_ms"] /= conv_speedup
    both = pd.concat([trials, compiled], ignore_index=True)
    return both, comparisons_table(both, samples)


@pytest.mark.parametrize(
    "speedup, answer", [(1.0, "no: the gap stays"), (4.0, "yes, compile head brings it under 1.25x")]
)
def test_the_verdict_answers_whether_compile_closes_the_gap(speedup, answer):
    from pipeline.report_sections import compile_section
    from pipeline.report_verdict import by_value_lines

    trials, comparisons = compiled_fixture(speedup)
    (line,) = by_value_lines(comparisons, trials)  # tf32 is n/a on this CPU: no line for it
    assert line.startswith(f"- does torch.compile close the conv/linear gap? {answer}.")
    gaps = re.search(
        r"compile off: \*\*([\d.]+)x\*\* \(95% CI [\d.]+-[\d.]+, 2 settings\); compile head: \*\*([\d.]+)x",
        line,
    )
    assert float(gaps[1]) == pytest.approx(4.0, rel=0.02) and float(gaps[2]) == pytest.approx(
        4.0 / speedup, rel=0.02
    )
    section = "\n".join(compile_section(trials, pd.DataFrame()))
    assert "| compile " in section and "5" in section and "no eager trial" not in section
    assert "No module table of a compiled detector" in section
    # Compile not swept: no line
    assert by_value_lines(comparisons_table(*fake_trials()), fake_trials()[0]) == []
    assert "Not swept here" in compile_section(fake_trials()[0], pd.DataFrame())[0]


def test_the_compile_section_says_which_modules_compiling_did_not_speed_up():
    from pipeline.report_sections import compile_module_lines

    rows = [  # module, eager backward ms, compiled backward ms
        ("roi_heads.box_head.0", 100.0, 98.0),
        ("backbone.body.layer1", 50.0, 20.0),
        ("(model)", 6.0, 30.0),
        ("rpn.head", 1.0, 0.5),  # under 5% of the eager backward: not shown
        ("roi_heads.box_roi_pool", 20.0, 0.0),  # no kernel given to it: its work in the compiled (model)
    ]
    modules = pd.DataFrame(
        [
            {
                "head": "conv",
                "batch_size": 2,
                "compile": compile,
                "module": m,
                "forward_ms": 1.0,
                "backward_ms": ms,
            }
            for m, eager, compiled in rows
            for compile, ms in (("off", eager), ("model", compiled))
        ]
    )
    text = "\n".join(compile_module_lines(modules))
    assert "**conv** (bs 2), compiled whole: the modules with 5% of the eager backward or more" in text
    assert "backbone.body.layer1" in text and "rpn.head" not in text
    assert (
        "Compiling did not speed up the backward of roi_heads.box_head.0 (100.0 -> 98.0 ms, 0.98x) "
        "(compiled / eager 0.9 or more)." in text
    )
    # A module given no compiled kernel is no speed-up: said, its work in (model)
    assert (
        "Given no compiled kernel: roi_heads.box_roi_pool (their work ran in kernels of no module or" in text
    )
    assert "`(model)`: 6.0 ms eager, 30.0 ms compiled." in text
    # Only compiled trials profiled, or none, or no setting profiled both ways: said, no table
    alone = compile_module_lines(modules[modules["compile"] == "model"])
    assert alone[0].startswith("No module table of a compiled detector") and len(alone) == 2
    apart = modules.assign(batch_size=[1, 2] * len(rows))  # eager at bs 1, compiled at bs 2
    assert compile_module_lines(apart)[0].startswith("No module table of a compiled detector")
    assert compile_module_lines(pd.DataFrame())[0].startswith("No module table")
    # The box head compiled alone (knob compile head): its own block, the rest of its call in its own row
    head = modules[modules["compile"] == "model"].assign(compile="head")
    text = "\n".join(compile_module_lines(pd.concat([modules, head])))
    assert "**conv** (bs 2), the box head compiled: the modules" in text
    assert "no module could be named for: in the compiled box head modules' own rows, not a speed-up" in text
    assert text.index("the box head compiled:") < text.index("compiled whole:")
    assert text.count("`(model)`: 6.0 ms eager") == 1  # the compiled call's row only compiled whole
    # Code dynamo ran eagerly after its recompile limit: said where its time went
    limited = (
        "run eagerly after dynamo's recompile limit: roi_align (torchvision/ops/roi_align.py:203) in "
        "roi_heads.box_roi_pool, forward (/home/me/work in backbone.body.layer1/m.py:12) in "
        "roi_heads.box_head.0"
    )
    noted = modules.assign(compiled="")
    noted.loc[(noted["module"] == "(model)") & (noted["compile"] == "model"), "compiled"] = limited
    text = "\n".join(compile_module_lines(noted))
    assert f"`(model)` holds code dynamo ran eagerly, not its modules' ({limited})." in text
    # ... and the modules whose calls ran it are marked, neither sped up, slowed nor given no kernel; a
    # module named in a file's path is not
    assert re.search(r"\| roi_heads\.box_roi_pool \(part eager\) +\|", text)
    assert re.search(r"\| roi_heads\.box_head\.0 \(part eager\) +\|", text)
    assert "backbone.body.layer1 (part eager)" not in text and text.count("(part eager)") == 2
    assert "Not comparable: roi_heads.box_head.0, roi_heads.box_roi_pool (part eager:" in text
    assert "Given no compiled kernel" not in text and "did not speed up the backward of" not in text


def test_the_sweep_time_section_reads_the_summary():
    from pipeline.report_sections import wall_section

    wall = {
        "total_s": 100.0,
        "measure_share": 0.72,
        "parts_s": {"measure": 72.0, "warmup": 18.0, "other": 10.0},
    }
    text = "\n".join(wall_section({"wall": wall}))
    assert "100 s of worker time; timed steps **72%**" in text and "| measure |" in text.replace("  ", " ")
    assert "Not recorded" in wall_section({})[0]


def test_the_verdict_answers_whether_tf32_closes_the_gap_where_it_was_swept():
    from pipeline.report_verdict import by_value_lines

    trials, samples = fake_trials()
    trials = trials.assign(device="cuda", cudnn_benchmark=False, onednn="n/a")
    trials["tf32"] = trials["batch_size"] == 2  # batch 2 with TF32 on: the same gap, 4x
    (line,) = by_value_lines(comparisons_table(trials, samples), trials)
    assert line.startswith(
        "- does TF32 close the conv/linear gap? no: the gap stays. conv / linear box-head "
        "backward over every setting, tf32 False: **"
    )
    gaps = [float(g) for g in re.findall(r"tf32 (?:False|True): \*\*([\d.]+)x\*\*", line)]
    assert gaps == pytest.approx([4.0, 4.0], rel=0.02) and line.count("1 setting)") == 2


def verdict_of(trials: pd.DataFrame, samples: dict, summary: dict | None = None) -> list[str]:
    """The report's verdict on ``trials`` and their samples, ``summary`` added to the one they give."""
    from pipeline.analysis import knob_effects

    comparisons = comparisons_table(trials, samples)
    results = Results(
        trials=trials,
        comparisons=comparisons,
        kernels=pd.DataFrame(),
        env={},
        summary=summarize_trials(trials, comparisons) | (summary or {}),
        modules=pd.DataFrame(),
    )
    return verdict(results, knob_effects(trials))


def fixed_and_onednn_fixture() -> tuple[pd.DataFrame, dict]:
    """fake_trials (onednn on: conv/linear box-head backward 4x) plus the same settings with oneDNN off,
    where the conv head is 3x slower (12x), and all of these again with linearize on, where the gap is
    closed (1x)."""
    trials, samples = fake_trials()
    done = trials[trials["status"] == "complete"]
    parts, next_trial = [trials], len(trials)
    for onednn, linearize, conv_factor in ((False, False, 3.0), (True, True, 0.25), (False, True, 0.25)):
        variant = done.assign(
            onednn=onednn, linearize=linearize, trial=range(next_trial, next_trial + len(done))
        )
        for old, new, head in zip(done["trial"], variant["trial"], done["head"]):
            factor = conv_factor if head == "conv" else 1.0
            samples[new] = {
                **samples[old],
                "head_backward": [x * factor for x in samples[old]["head_backward"]],
            }
        variant.loc[variant["head"] == "conv", "head_backward_ms"] *= conv_factor
        parts.append(variant)
        next_trial += len(done)
    return pd.concat(parts, ignore_index=True), samples


def test_every_pooled_gap_pools_the_headlines_settings():
    trials, samples = fixed_and_onednn_fixture()
    comparisons = comparisons_table(trials, samples)
    rows = comparisons[
        (comparisons["phase"] == "head_backward")
        & (comparisons["numerator"] == "conv")
        & (comparisons["denominator"] == "linear")
        & (comparisons["batch_size"] != "all")
    ]
    as_written = rows[rows["linearize"].astype(str) == "False"]
    per_onednn = as_written.groupby(as_written["onednn"].astype(str))["ratio"].apply(
        lambda r: float(np.exp(np.log(r).mean()))
    )
    # The per-setting rows
    assert per_onednn.to_dict() == pytest.approx({"True": 4.0, "False": 12.0}, rel=0.02)
    lines = verdict_of(trials, samples)
    assert lines[0].startswith("- conv / linear, box-head backward: **6.9")  # sqrt(4 x 12): the fix left out
    assert "(over the settings with linearize false)." in lines[0]
    assert "paired settings, the settings with linearize false as the headline;" in lines[1]
    (onednn,) = [line for line in lines if line.startswith("    - onednn")]
    gaps = re.match(
        r"    - onednn True -> False: gap ([\d.]+)x -> ([\d.]+)x \(widens [\d.]+x; 2 paired settings\)",
        onednn,
    )
    assert [float(gaps[1]), float(gaps[2])] == pytest.approx(
        [per_onednn["True"], per_onednn["False"]], rel=0.01
    )
    (fix,) = [line for line in lines if line.startswith("    - linearize")]  # its own line lets it vary
    assert re.match(r"    - linearize False -> True: gap 6.9\dx -> 1.00x", fix), fix


def test_the_verdict_cautions_when_the_machine_drifted_during_the_sweep():
    from pipeline.report_sections import drift_caution

    def summary(start, end):
        return {
            "drift": {"start": {"step_ms": start}, "end": {"step_ms": end}, "step_drift": end / start - 1}
        }

    (line,) = drift_caution(summary(500.0, 1050.0))
    assert line.startswith(
        "- **caution**: the baseline step moved +110.0% between the sweep's start and end "
        "(500 -> 1050 ms; over 10%)"
    )
    assert drift_caution(summary(1000.0, 1104.0))[0].startswith(
        "- **caution**: the baseline step moved +10.4%"
    )
    assert drift_caution(summary(1134.9, 1078.3)) == []  # -5%: a quiet machine's noise
    assert drift_caution(summary(1000.0, 1099.0)) == []  # within 10%: no caution
    assert drift_caution({"drift": None}) == [] and drift_caution({}) == []
    assert line in verdict_of(*fake_trials(), summary(500.0, 1050.0))


def test_the_verdict_cautions_when_trials_did_not_have_their_cores(tmp_path):
    from pipeline.report_sections import contention_caution
    from pipeline.results import read_trials

    trials, samples = fake_trials()
    done = trials[trials["status"] == "complete"].copy()
    done["core_share"], done["core_waited"] = 0.97, 0.001
    assert contention_caution(done) == []
    done.loc[done.index[:2], "core_waited"] = [0.41, 0.2]
    (line,) = contention_caution(done)
    assert line.startswith(
        f"- **caution**: 2 of {len(done)} complete trials did not have their CPU cores (at worst the threads "
        "waited 41% of their core time for a core (their run-queue delay"
    )
    assert line in verdict_of(done, samples)
    # a serial stretch's low CPU share, the threads waiting for nothing: no caution
    done["core_share"], done["core_waited"] = 0.55, 0.0
    assert contention_caution(done) == []
    # a table with the CPU share alone: judged by it, as said
    done["core_share"], done["core_waited"] = 0.97, float("nan")
    done.loc[done.index[:1], "core_share"] = 0.41
    (line,) = contention_caution(done)
    assert "at worst the steps got 41% of the CPU time their threads could use (no run-queue delay" in line
    # A table from before the column: read with it unknown, and no caution.
    trials.drop(columns="core_share", errors="ignore").to_csv(tmp_path / "trials.csv", index=False)
    older = read_trials(tmp_path / "trials.csv")
    assert older["core_share"].isna().all() and contention_caution(older[older["status"] == "complete"]) == []


def test_the_verdicts_headline_says_when_every_trial_was_compiled():
    trials, samples = fake_trials()
    assert "no eager trial" not in verdict_of(trials, samples)[0]
    line = verdict_of(trials.assign(compile="head"), samples)[0]
    assert re.match(r"- conv / linear, box-head backward: \*\*\d\.\d\dx \(95% CI", line), line
    assert line.endswith(" (over the settings with compile head: no eager trial)."), line


def test_compare_medians_pool_the_headlines_settings():
    trials, _ = fixed_and_onednn_fixture()
    as_written = trials[(trials["status"] == "complete") & (trials["linearize"].astype(str) == "False")]
    expected = as_written[as_written["head"] == "conv"]["head_backward_ms"].median()
    assert compare.per_head(trials).loc["conv", "head_backward_ms"] == pytest.approx(expected)
    # The fixed ones would lower it
    assert expected > trials[trials["head"] == "conv"]["head_backward_ms"].median()


def test_the_box_heads_page_has_an_icicle_per_profiled_head_of_its_box_head_alone():
    from pipeline.report_page import BOX_HEAD, box_heads_page
    from pipeline.results import ADDED_MODULE_COLUMNS, read_table
    from rcnn.trial.schema import MODULE_TABLE_COLUMNS

    modules = read_table(
        ROOT / "reports" / "compile-cpu-xeon" / "modules.csv",
        MODULE_TABLE_COLUMNS,
        "sweep",
        added=ADDED_MODULE_COLUMNS,
    )
    page = box_heads_page(modules)
    # One per profiled setting and head: this sweep profiled each head eager, head compiled, model compiled
    heads = modules.groupby(["head", *[k for k in ("batch_size", "amp", "compile") if k in modules]]).ngroups
    assert page.count("<h2>") == heads == page.count("Plotly.newPlot")
    assert page.count("plotly.js v") == 1  # embedded once, for every icicle
    figures = [json.loads(m) for m in re.findall(r'Plotly\.newPlot\(\s*"[^"]+",\s*(\[.*?\]),\s*\{', page)]
    assert len(figures) == heads
    for (trace,) in figures:  # each: the box head's subtree, with every one of its modules
        ids = set(trace["ids"])
        assert all(i.startswith(BOX_HEAD) for i in ids), ids
        assert f"{BOX_HEAD}.0" in ids or f"{BOX_HEAD}.1" in ids
    assert box_heads_page(modules.iloc[:0]) is None


def test_the_report_stage_writes_the_box_heads_page_and_links_it(rendered):
    _, _, out = rendered
    assert "[box_heads.html](box_heads.html)" in (out / "report.md").read_text()
    assert (out / "box_heads.html").read_text().count("Plotly.newPlot") >= 3


def test_the_report_keeps_the_tables_it_was_rendered_from_and_renders_again_from_them(rendered):
    folder, params, rendered_out = rendered
    out = shutil.copytree(rendered_out, params.parent / "rendered-again")  # --out lies in the project
    tables = out / "tables"
    assert sorted(p.name for p in tables.iterdir()) == sorted(report.TABLES.values())
    assert (tables / "trials.csv").read_text() == (folder / "trials.csv").read_text()
    first = (out / "report.md").read_text()
    # The sweep's results gone: the report folder renders again from its own tables (its own files
    # rewritten), the same text
    hidden = folder.rename(folder.with_name("results-gone"))
    try:
        again = [f"--{role}={tables / name}" for role, name in report.TABLES.items()]
        assert report.main(["--params", str(params), *again, f"--out={out}"]) == 0
    finally:
        hidden.rename(folder)  # for the module's other tests
    assert (out / "report.md").read_text() == first


def test_per_setting_the_fixed_head_against_linear_how_it_was_paired_and_the_trials_own_spread():
    from pipeline.report_verdict import per_setting_lines
    from rcnn.trial.schema import OTHER_KNOBS

    base = dict.fromkeys(OTHER_KNOBS, "n/a") | {"onednn": True, "amp": "off", "channels_last": False}
    settings = [base | {"batch_size": b, "linearize": lin} for lin in (False, True) for b in (1, 2)]
    ratios = {  # (batch_size, linearize) -> head -> box-head backward / linear's
        (1, False): {"conv": 3.0, "conv_as_linear": 1.08},
        (2, False): {"conv": 3.1, "conv_as_linear": 1.01},
        (1, True): {"conv": 1.02, "conv_as_linear": 1.00},
        (2, True): {"conv": 1.10, "conv_as_linear": 1.04},
    }
    comparisons = pd.DataFrame(
        [
            s
            | {"numerator": head, "denominator": "linear", "phase": "head_backward"}
            | {"ratio": r, "ci_low": r - 0.01, "ci_high": r + 0.01, "rounds": 8 + s["batch_size"]}
            for s in settings
            for head, r in ratios[s["batch_size"], s["linearize"]].items()
        ]
    )
    trials = pd.DataFrame(
        [
            s | {"status": "complete", "head": "conv", "swapped": "roi_heads.box_head.0 roi_heads.box_head.2"}
            for s in settings
            if s["linearize"]
        ]
    )
    fixed, hand = per_setting_lines(comparisons, trials)
    assert fixed.startswith(
        "- per setting, conv with `linearize: true` / linear, box-head backward (the two heads in one "
        "twin step, 9-10 steps): within 1.05x (the CI wholly at or under it) in 1 of 2 settings, beyond it "
        "(the CI wholly over it) in 1, undecided (the CI across it) in 0; the point estimate at most 1.05x "
        "in 1; beyond: oneDNN on, amp off, NCHW, bs 2 1.100x [1.09, 1.11] (10 twin steps)"
    )
    # conv_as_linear: 1.08 beyond, 1.04 [1.03, 1.05] within (at the aim), 1.01 and 1.00 within
    assert "within 1.05x (the CI wholly at or under it) in 3 of 4 settings, beyond it" in hand
    assert "beyond: oneDNN on, amp off, NCHW, bs 1 1.080x [1.07, 1.09] (9 twin steps)" in hand
    assert "`python -m rcnn.bench --head conv_as_linear --head linear --max-seconds 180 " in hand
    assert "`python -m rcnn.bench --head conv --head linear --linearize --max-seconds 180 " in fixed
    assert "rcnn.bench" not in per_setting_lines(comparisons[comparisons["ratio"] < 1.05], trials)[0]
    comparisons["ci_low"] = comparisons["ratio"] - 0.1  # CIs across the aim: undecided, not beyond
    fixed = per_setting_lines(comparisons, trials)[0]
    assert (
        "within 1.05x (the CI wholly at or under it) in 1 of 2 settings, beyond it (the CI wholly over it) "
        "in 0, undecided (the CI across it) in 1; the point estimate at most 1.05x in 1; "
        "undecided: oneDNN on, amp off, NCHW, bs 2 1.100x [1.00, 1.11] (10 twin steps)"
    ) in fixed
    # conv / conv_as_linear, linearize on: 1.02 and 1.10 / 1.04 = 1.06, where the 7x7 conv was swapped
    assert "each read in its own trial, differ 1.02-1.06x over 2 settings here." in hand
    assert "one after the other" not in hand
    comparisons.loc[comparisons["batch_size"] == 2, "rounds"] = 0  # two trials, one after the other
    hand = per_setting_lines(comparisons, trials)[-1]
    assert "(the two heads in one twin step, 9 steps, in 2 of 4 settings)" in hand
    assert "trials run one after the other carry the machine's drift" in hand
    trials["swapped"] = "roi_heads.box_head.2"  # never the 7x7 conv: no spread of the same head to show
    assert "differ" not in per_setting_lines(comparisons, trials)[-1]


@pytest.mark.parametrize(
    "rounds, says",
    [
        ([9, 12], "is read from the two in one twin step of its trial."),
        ([0, float("nan")], "divides two trials run one after the other."),  # an older table: NaN
        ([9, float("nan")], "in one twin step of its trial (1 of 2), else it divides two trials"),
    ],
)
def test_the_report_says_how_its_head_ratios_were_read(rounds, says):
    from pipeline.report_sections import comparison_table
    from pipeline.report_verdict import ratios_read
    from rcnn.trial.schema import OTHER_KNOBS

    comparisons = pd.DataFrame(
        [
            dict.fromkeys(OTHER_KNOBS, "n/a")
            | {"batch_size": b, "numerator": "conv", "denominator": "linear", "phase": "head_backward"}
            | {"ratio": 3.0, "ci_low": 2.9, "ci_high": 3.1, "p_value": 0.01, "rounds": n}
            for b, n in zip((1, 2), rounds)
        ]
    )
    assert says in ratios_read(comparisons)
    shown = comparison_table(comparisons)["twin"].tolist()
    assert shown == [f"{n} steps" if n > 0 else "no: two trials" for n in rounds]


def test_the_verdict_says_what_linearize_gains_the_whole_backward_and_beyond_the_box_head():
    from pipeline.report_verdict import linearize_gain_lines

    g = {"ratio": 2.5, "ci_low": 2.4, "ci_high": 2.6, "pairs": 6}
    summary = {
        "linearize_gain": {"backward": g, "beyond_box_head": g | {"ratio": 2.1}, "by_head": {"conv": g}}
    }
    (line,) = linearize_gain_lines(summary)
    assert line.startswith(
        "- `linearize: true`, the detector's whole backward, without / with: **2.50x [95% CI 2.40, 2.60]** "
        "(geometric mean over 6 pairs of trials that differ in it alone); beyond the box head (each step's "
        "backward less the box head's own): 2.10x [95% CI 2.40, 2.60]"
    )
    assert line.endswith("; per head: conv 2.50x [95% CI 2.40, 2.60].")
    assert linearize_gain_lines({"linearize_gain": None}) == [] and linearize_gain_lines({}) == []


def test_the_by_module_tables_show_the_roi_pool_both_ways():
    from pipeline.report_sections import MODULES_SHOWN, POOL, module_section

    rows = []
    for linearize, pool_ms in ((False, 170.0), (True, 12.0)):
        for i, module in enumerate([f"backbone.{j}" for j in range(6)] + [POOL]):
            rows.append(
                {"head": "linear", "onednn": True, "amp": "off", "channels_last": False, "batch_size": 2,
                 "linearize": linearize, "module": module, "type": "T", "calls": 1,
                 "backward_ms": pool_ms if module == POOL else 20.0 + i, "flag": "",
                 "evidence": "linearized: runs as a sparse matrix product" if linearize else ""}
            )  # fmt: skip
    text = "\n".join(
        module_section(pd.DataFrame(rows).reindex(columns=list(dict.fromkeys([*rows[0], *MODULES_SHOWN]))))
    )
    assert text.count(f"| {POOL}") == 2  # under the top 5 with linearize, shown still
    assert f"The RoI pool (`{POOL}`, torchvision's MultiScaleRoIAlign) takes" in text
    assert "linear (oneDNN on, amp off, NCHW, bs 2) 170.0 -> 12.0 ms (14.2x)" in text
