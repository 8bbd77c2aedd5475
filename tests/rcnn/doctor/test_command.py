import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from rcnn import fix
from rcnn.doctor import command as doctor
from rcnn.doctor.columns import MODULE_COLUMNS, OUTSIDE, ROOT, WHY_COLUMNS
from rcnn.measure.device import compile_unavailable
from tests import launcher
from tests.conftest import ROOT as REPO

QUICK = ["--batch-size", "2", "--image-size", "64", "--max-seconds", "2", "--device", "cpu"]
OUT_FILES = {"modules.csv", "why.csv", "env.json", "trace.json", "report.html"}  # what --out holds, no --fix


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A working folder that is its own project (--out must lie inside), with the fixtures importable."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO))
    return tmp_path


@pytest.mark.slow  # the doctor end to end with time for every why row: seconds
def test_tables_for_a_users_model(project, capsys):
    # time enough for every why row's timings, on a loaded machine too
    argv = ["tests.fixtures.models:box_head_like", *QUICK, "--max-seconds", "8", "--out", "out", "--top", "3"]
    assert doctor.main(argv) == 0
    modules = pd.read_csv(project / "out" / "modules.csv", keep_default_na=False).set_index("module")
    why = pd.read_csv(project / "out" / "why.csv").set_index("module")
    env = json.loads((project / "out" / "env.json").read_text())
    assert list(modules.reset_index().columns) == list(MODULE_COLUMNS)
    assert list(why.reset_index().columns) == list(WHY_COLUMNS)
    assert list(modules.index) == [ROOT, "features", "pool", "fc6", "fc7", "score", OUTSIDE]
    # The rows add up to the step, and the shares to one.
    assert modules["backward_ms"].sum() == pytest.approx(env["summary"]["backward_ms"])
    assert modules["backward_share"].sum() == pytest.approx(1)
    # The 7x7 conv on 7x7 features and the 1x1 conv on its 1x1 output are GEMMs; the padded 3x3 conv is not.
    # fc6's GEMM is 2x faster: flagged; fc7's (0.1 ms) is flagged where shown faster, checked in any case.
    assert modules.loc["fc6", "flag"].startswith("gemm-in-disguise:covers-input")
    assert modules.loc["fc7", "flag"].startswith("gemm-in-disguise:covers-input") or modules.loc[
        "fc7", "evidence"
    ].startswith("checked as gemm-in-disguise:covers-input")
    assert "7x7 covers its 7x7 input" in modules.loc["fc6", "evidence"]
    assert "gemm-in-disguise" not in modules.loc["features", "flag"]
    # FLOPs: fc6 is 2 * 2 images * 16*7*7 * 64 forward; backward twice that (input and weight gradients).
    assert modules.loc["fc6", "forward_gflop"] * 1e9 == pytest.approx(2 * 2 * 16 * 49 * 64)
    assert modules.loc["fc6", "backward_gflop"] * 1e9 == pytest.approx(2 * 2 * 2 * 16 * 49 * 64)
    assert modules.loc["fc6", "peak_fraction"] == pytest.approx(
        modules.loc["fc6", "backward_tflops"] / env["ceilings"]["matmul_tflops"]["fp32"]
    )
    # A flag is a measured saving: its GEMM timed in turn with it, faster with a CI that excludes 1.
    flagged = modules[modules["flag"] != ""]
    assert (
        pd.to_numeric(flagged["saves_ci_low"]) > 0
    ).all() and "rounds in turn: the GEMM is faster" in flagged["evidence"]["fc6"]
    # Every flagged module and the 3 of most backward have their why: what ran, and for a module with weights
    # both gradients timed alone, the implementation named.
    top = modules.drop(index=OUTSIDE).nlargest(3, "backward_ms").index
    assert set(flagged.index) | set(top) <= set(why.index)
    assert why["ran"].str.len().min() > 0 and why["bound"].str.len().min() > 0
    assert (why.loc["fc6", ["input_grad_ms", "weight_grad_ms", "gemm_ms"]] > 0).all()
    assert why.loc["fc6", "input_shape"] == "2x16x7x7" and why.loc["fc6", "dtype"] == "float32"
    assert why.loc["fc6", "input_grad_gflop"] * 1e9 == pytest.approx(2 * 2 * 16 * 49 * 64)
    assert why.loc[list(flagged.index), "input_grad_impl"].str.len().min() > 0
    assert env["fingerprint"]["torch"] and env["model"] == "tests.fixtures.models:box_head_like"
    assert env["batch"] == "float32 (2, 3, 64, 64)" and env["options"]["image_size"] == 64
    # One step traced: its backward ops in the ranges of their modules (rcnn.doctor.trace, tested there)
    traced = json.loads((project / "out" / "trace.json").read_text())["traceEvents"]
    assert {"backward: fc6", "forward: fc6", "step: backward"} <= {e.get("name") for e in traced}
    # The page: the icicles' tree holds every module, the flags named (rcnn.doctor.pictures, tested there)
    page = (project / "out" / "report.html").read_text()
    assert all(f'"{name}"' in page for name in modules.index) and "gemm-in-disguise:covers-input" in page
    printed = capsys.readouterr().out
    assert "Top 3 modules" in printed and "- fc6 [gemm-in-disguise:covers-input" in printed
    assert printed.splitlines()[0].endswith("batch float32 (2, 3, 64, 64), fp32")


@pytest.mark.slow  # the doctor end to end: seconds
def test_the_header_and_env_say_what_the_batch_was_not_what_was_asked(project, capsys):
    """A factory with batches of its own (vectors of 64): no "64 px" anywhere, the batch as it was."""
    assert doctor.main(["tests.fixtures.models:sleepy", *QUICK, "--out", "out"]) == 0
    env = json.loads((project / "out" / "env.json").read_text())
    assert env["batch"] == "float32 (2, 64)" and "image_size" not in env
    header = capsys.readouterr().out.splitlines()[0]
    assert "batch float32 (2, 64)" in header and " px" not in header


@pytest.mark.slow  # the doctor end to end, three times: seconds
def test_out_is_rewritten_but_never_a_foreign_folder(project, capsys):
    (project / "notes").mkdir()
    (project / "notes" / "mine.txt").write_text("keep me")
    assert doctor.main(["tests.fixtures.models:sleepy", *QUICK, "--out", "notes"]) == 2
    assert "--out: notes holds files this command did not write (mine.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in (project / "notes").iterdir()) == ["mine.txt"]
    assert doctor.main(["tests.fixtures.models:sleepy", *QUICK, "--out", "out"]) == 0
    (project / "out" / "fix.csv").write_text("module,kind\n")  # as an earlier --fix run left it
    assert doctor.main(["tests.fixtures.models:sleepy", *QUICK, "--out", "out"]) == 0  # its own: rewritten
    assert {p.name for p in (project / "out").iterdir()} == OUT_FILES  # the earlier run's fix.csv gone


@pytest.mark.parametrize(
    "args, message",
    [
        (["torchvision:nope"], "error: MODEL: torchvision:nope is not a torchvision"),
        (["no_such_package.models:make"], "error: MODEL: cannot import 'no_such_package.models'"),
        (
            ["tests.fixtures.models:raises"],
            "error: MODEL: tests.fixtures.models:raises() raised RuntimeError",
        ),
        pytest.param(
            ["tests.fixtures.models:flat"],
            "error: MODEL: tests.fixtures.models:flat failed on its synthetic batch",
            marks=pytest.mark.slow,  # the machine's ceilings are measured before the first step: seconds
        ),
        (["detector:fc"], "error: MODEL: detector:fc: unknown head; allowed: detector:linear"),
        (
            ["tests.fixtures.models:sleepy", "--batch-size", "0"],
            "error: --batch-size: 0 is too small; allowed: >= 1",
        ),
        (
            ["tests.fixtures.models:sleepy", "--image-size", "8"],
            "error: --image-size: 8 is too small; allowed: >= 16",
        ),
        (
            ["detector:conv", "--image-size", "100"],
            "error: --image-size: 100 is not allowed; allowed: a multiple of 32 (the detector's FPN)",
        ),
        (
            ["detector:conv", "--backbone", "vgg"],
            "error: --backbone: 'vgg' is not allowed; allowed: resnet50_fpn",
        ),
        (
            ["tests.fixtures.models:sleepy", "--amp", "fp8"],
            "error: --amp: 'fp8' is not allowed; allowed: off, fp16, bf16",
        ),
        (
            ["tests.fixtures.models:sleepy", "--amp", "fp16", "--device", "cpu"],
            "error: --amp: fp16 does not apply on cpu",
        ),
        (["tests.fixtures.models:sleepy", "--top", "0"], "error: --top: 0 is too small; allowed: >= 1"),
        (
            ["tests.fixtures.models:sleepy", "--compile", "head"],
            "error: --compile: head compiles a detector's box head (roi_heads.box_head, "
            "roi_heads.box_predictor), and tests.fixtures.models:sleepy has no roi_heads.box_head; "
            "allowed: off, model",
        ),
        (
            ["tests.fixtures.models:sleepy", "--compile", "model", "--fix"],
            "error: --compile: model with --fix: the fix times the eager model; allowed: one of the two",
        ),
        (["tests.fixtures.models:sleepy", "--out", "/"], "error: --out: / holds files this command did not"),
        ([":sleepy"], "error: MODEL: ':sleepy' is not a model spec"),
        (["broken_module:make"], "error: MODEL: cannot import 'broken_module' (SyntaxError: "),
        (
            ["tests.fixtures.models:sleepy", "--mlflow"],
            "error: MLFLOW_TRACKING_URI: /elsewhere/mlflow.db resolves outside",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(project, capsys, monkeypatch, args, message):
    (project / "broken_module.py").write_text("def make(:\n")
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere/mlflow.db")
    with pytest.raises(SystemExit) as exited:
        sys.exit(doctor.main([*QUICK[:4], *args]))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_the_modules_that_matter_get_a_why_row_whatever_their_flops(monkeypatch):
    """A module of no FLOPs and no flag (a pooling's backward) still gets its why: what ran, the bytes and
    what bounds it."""
    import torch

    import rcnn.doctor.verdict

    # As if the steps had their cores: on a loaded machine what bounds a module is not judged (said so)
    monkeypatch.setattr(rcnn.doctor.verdict.cores, "contended", lambda record: False)

    from rcnn.doctor.diagnosis import diagnose
    from rcnn.doctor.workloads import build_workload
    from rcnn.measure.stats import TimingPolicy

    cpu = torch.device("cpu")
    workload = build_workload("tests.fixtures.models:pooled", batch_size=2, image_size=64, device=cpu)
    policy = TimingPolicy(warmup=1, max_warmup=1, iterations=3, max_iterations=3)
    diagnosis = diagnose(workload, device=cpu, policy=policy, peak_tflops=1.0)
    modules, why = diagnosis.modules.set_index("module"), diagnosis.why.set_index("module")
    own = modules.drop(index=OUTSIDE)
    matter = set(own.nlargest(3, "backward_ms").index) | set(own.index[own["backward_share"] > 0.05])
    assert set(why.index[why["matters"]]) == matter
    assert "pool" in why.index and why.loc["pool", "backward_gflop"] == 0
    assert "aten::_adaptive_avg_pool2d_backward" in why.loc["pool", "ran"]
    assert why.loc["pool", "backward_moved_mb"] > 0 and why.loc["pool", "remedy"] == "no known fix"
    # small ops run on one thread of torch's: named so, with their fractions
    assert why["bound"].str.contains("compute-bound|memory-bound|bound by neither|^serial: ").all()
    serial = why[why["bound"].str.contains("serial")]
    assert (modules.loc[serial.index, "backward_cores"] < 1.5).all()
    assert diagnosis.summary["copy_gbps"] > 0 and diagnosis.trace  # the profiled step's trace


@pytest.mark.slow
def test_the_command_as_a_user_runs_it(tmp_path):
    done = launcher.run(
        [
            sys.executable,
            "-m",
            "rcnn.doctor",
            "tests.fixtures.models:box_head_like",
            *QUICK,
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
    )
    # tmp_path lies outside the project: an explicit --out may be anywhere
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "modules.csv").is_file()


@pytest.mark.gpu
def test_on_a_gpu_the_kernels_are_named(project):
    assert (
        doctor.main(
            [
                "tests.fixtures.models:box_head_like",
                "--batch-size",
                "8",
                "--image-size",
                "64",
                "--max-seconds",
                "2",
                "--device",
                "cuda",
                "--out",
                "out",
            ]
        )
        == 0
    )
    why = pd.read_csv(project / "out" / "why.csv").set_index("module")
    assert why.loc["fc6", "input_grad_ms"] > 0 and len(why.loc["fc6", "weight_grad_impl"]) > 0


@pytest.mark.slow  # the doctor end to end and an MLflow store: seconds
def test_mlflow_gets_the_tables(project, monkeypatch, capsys):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
    assert doctor.main(["tests.fixtures.models:box_head_like", *QUICK, "--mlflow"]) == 0
    assert "MLflow run " in capsys.readouterr().out
    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow.db'}")
    run = mlflow.search_runs(experiment_names=["rcnn-doctor"]).iloc[0]
    assert run["params.model"] == "tests.fixtures.models:box_head_like" and run["metrics.backward_ms"] > 0
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run["run_id"])}
    assert {"modules.csv", "why.csv", "env.json", "report.html"} <= artifacts


@pytest.mark.slow  # the command end to end, the fix measured both ways: seconds
def test_fix_measures_the_model_before_and_after(project, capsys):
    assert doctor.main(["tests.fixtures.models:box_head_like", *QUICK, "--fix", "--out", "out"]) == 0
    swaps = pd.read_csv(project / "out" / "fix.csv").set_index("module")
    after = pd.read_csv(project / "out" / "modules_fixed.csv", keep_default_na=False).set_index("module")
    fixed = json.loads((project / "out" / "env.json").read_text())["fix"]
    assert list(swaps.index) == ["fc6", "fc7"] and set(swaps["kind"]) == {"covers-input"}
    assert (swaps[["original_ms", "fixed_ms"]] > 0).all().all() and (swaps["rounds"] >= 3).all()
    before = pd.read_csv(project / "out" / "modules.csv", keep_default_na=False).set_index("module")
    for name, swap in swaps.iterrows():  # mode auto: kept where the conv was shown >5% faster; flags swapped
        assert swap["swapped"] == (swap["ci_low"] <= fix.KEEP_ABOVE)
        assert swap["swapped"] or not before.loc[name, "flag"]
        assert (after.loc[name, "type"] == "Conv2dAsLinear") == swap["swapped"]
        # a swapped conv runs as its matrix product: no longer a GEMM in disguise
        assert ("gemm-in-disguise" in after.loc[name, "flag"]) != swap["swapped"]
    assert (
        fixed["eligible"] == 2 and fixed["swapped"] == swaps["swapped"].sum() and fixed["paired_steps"] >= 2
    )
    for phase in ("forward", "backward", "forward_backward"):
        p = fixed[phase]
        assert p["ratio"] == pytest.approx(p["after_ms"] / p["before_ms"])
        assert p["ci_low"] <= p["ratio"] <= p["ci_high"] or p["ci_low"] != p["ci_low"]
    assert "The fix (rcnn.fix.linearize, mode auto)" in capsys.readouterr().out


@pytest.mark.slow
def test_out_is_written_before_anything_is_printed(project, monkeypatch):
    def closed_pipe(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")  # `| head` that has read its lines

    monkeypatch.setattr(doctor, "print", closed_pipe, raising=False)
    assert doctor.main(["tests.fixtures.models:box_head_like", *QUICK, "--out", "out"]) == 141
    assert {p.name for p in (project / "out").iterdir()} == OUT_FILES


@pytest.mark.slow
def test_out_may_lie_outside_the_project_but_replaces_nothing_foreign(project, tmp_path_factory, capsys):
    elsewhere = tmp_path_factory.mktemp("elsewhere")  # not under the working folder, the project
    assert doctor.main(["tests.fixtures.models:sleepy", *QUICK, "--out", str(elsewhere / "d")]) == 0
    assert (elsewhere / "d" / "modules.csv").is_file()
    (elsewhere / "d" / "thesis.tex").write_text("mine")
    assert doctor.main(["tests.fixtures.models:sleepy", *QUICK, "--out", str(elsewhere / "d")]) == 2
    assert "holds files this command did not write (thesis.tex)" in capsys.readouterr().err


@pytest.mark.slow  # the command's whole run, the machine's ceilings measured first: seconds
def test_the_rows_that_are_no_module_are_explained_under_the_table(project, capsys):
    assert doctor.main(["tests.fixtures.models:box_head_like", *QUICK, "--top", "20"]) == 0
    printed = capsys.readouterr().out
    assert f"{ROOT}: work in the model's own forward, outside its submodules" in printed
    assert f"{OUTSIDE}: work no module's forward created" in printed


def _diagnosis(saves, core_share=None, core_waited=None, core_pressure=None):
    """A Diagnosis of modules named by ``saves`` (name -> what its flag saves a step, ms; None: no flag),
    backward time falling in that order; a step of 100 ms."""
    from rcnn.doctor.verdict import Diagnosis

    names = list(saves)
    modules = pd.DataFrame({c: [0.0] * len(names) for c in MODULE_COLUMNS})
    modules["module"], modules["type"], modules["evidence"] = names, "Conv2d", ""
    modules["flag"] = ["gemm-in-disguise:pointwise" if saves[n] is not None else "" for n in names]
    modules["saves_ms"] = [saves[n] if saves[n] is not None else float("nan") for n in names]
    modules["backward_ms"] = [50.0 - i for i in range(len(names))]
    why = pd.DataFrame({c: [0.0] * len(names) for c in WHY_COLUMNS})
    why["module"], why["flag"], why["type"] = names, modules["flag"], "Conv2d"
    why["matters"] = [i < 3 for i in range(len(names))]
    for column in ("ran", "bound", "remedy", "input_shape", "dtype", "layout"):
        why[column] = "x"
    for column in ("input_grad_impl", "weight_grad_impl"):
        why[column] = ""
    why["input_grad_ms"] = float("nan")
    summary = {
        "warmup_steps": 1,
        "steps": 3,
        "precision": 0.1,
        "forward_ms": 40.0,
        "backward_ms": 60.0,
        "peak_tflops": 1.0,
        "dtype": "fp32",
        "core_share": core_share,
        "core_waited": core_waited,
        "core_pressure": core_pressure,
    }
    return Diagnosis(modules, why, summary)


def test_the_printout_lists_the_flags_that_save_a_percent_of_the_step_and_counts_the_rest(capsys):
    saves = {"a": None, "b": None, "c": None, "small.1": 0.5, "big": 4.0, "small.2": 0.2, "mid": 1.5}
    doctor._print(_diagnosis(saves), top=15, title="t", out="d")
    lines = capsys.readouterr().out.splitlines()
    flags = lines[lines.index(next(line for line in lines if line.startswith("Flags"))) + 1 :]
    assert flags[0].startswith("- big [gemm-in-disguise:pointwise]: saves 4.00 ms a step")
    assert flags[1].startswith("- mid [") and flags[2] == "- and 2 smaller flags, each under 1%: in d/"
    why = [line.split(" (")[0] for line in lines if line.startswith("- ") and "(Conv2d)" in line]
    assert why == ["- a", "- b", "- c", "- big", "- mid"]  # the modules that matter, then the flags shown


def test_no_fraction_of_the_peak_above_one_is_printed(capsys):
    from rcnn.doctor.verdict import ceiling

    table = pd.DataFrame({"backward_tflops": [0.2, 0.45, 0.1]}, index=["a", "b", OUTSIDE])
    assert ceiling(0.3, table) == (0.45, "b")  # raised to the fastest module's, and said
    assert ceiling(0.5, table) == (0.5, "") and ceiling(None, table) == (None, "")
    diagnosis = _diagnosis({"a": None})
    diagnosis.summary.update(peak_tflops=0.45, peak_measured_tflops=0.3, peak_raised_by="b")
    doctor._print(diagnosis, top=5, title="t")
    assert "matmul peak raised to 0.45 TFLOP/s (fp32): b's backward ran faster than the 0.3 measured" in (
        capsys.readouterr().out
    )


def test_contended_cores_are_said_in_one_line_with_what_said_so(capsys):
    # the run-queue delay decides where there is one: a serial stretch's low CPU share is no contention
    doctor._print(_diagnosis({"a": None}, core_share=0.45, core_waited=0.4), top=5, title="t")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("The cores were")]
    assert lines == [
        "The cores were shared with other work: the threads waited 40% of their core time for a core (their "
        "run-queue delay, /proc/self/task/*/schedstat), so times are the scheduler's, not the modules'; what "
        "bounds a module is not judged. Rerun on an idle machine, or with fewer threads (OMP_NUM_THREADS)."
    ]
    doctor._print(_diagnosis({"a": None}, core_share=0.45, core_waited=0.001), top=5, title="t")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("The cores were")]
    assert lines == [
        "The cores were not shared: the threads waited 0% of their core time for a core (their run-queue "
        "delay, /proc/self/task/*/schedstat)."
    ]
    # no run-queue delay: the CPU pressure, then the CPU share, and the printout says which
    doctor._print(_diagnosis({"a": None}, core_share=0.95, core_pressure=0.3), top=5, title="t")
    assert "some task waited for a core 30% of the time (the system's CPU pressure" in capsys.readouterr().out
    doctor._print(_diagnosis({"a": None}, core_share=0.45), top=5, title="t")
    assert (
        "the steps got 45% of the CPU time their threads could use (no run-queue delay or CPU pressure "
        in (capsys.readouterr().out)
    )
    doctor._print(_diagnosis({"a": None}, core_share=None), top=5, title="t")  # CUDA: nothing applies
    assert "The cores were" not in capsys.readouterr().out


@pytest.mark.slow  # the doctor and its fix measured to their bound: seconds
def test_max_seconds_bounds_the_measuring_the_fix_included(project, monkeypatch):
    import time

    # Steps of 60 ms (two sleeps in backward). Unbounded, warm-up and the least 12 steps of the diagnosis and
    # of the fixed model, and 14 rounds of the fix's 2 variants in turn take over 4 s. The machine's ceiling
    # comes before the bound: given here, so that the time taken is the measuring's.
    monkeypatch.setattr(doctor, "matmul_paths", lambda device, dtype: {"mm 1024": 0.1})
    args = ["tests.fixtures.models:sleepy", "--batch-size", "2", "--image-size", "64", "--device", "cpu"]
    started = time.monotonic()
    assert doctor.main([*args, "--max-seconds", "3", "--fix", "--out", "out"]) == 0
    took = time.monotonic() - started
    assert took < 3 + 0.8, took  # past the bound: at most the least steps a median needs
    env = json.loads((project / "out" / "env.json").read_text())
    assert env["summary"]["steps"] >= 3 and env["fix"]["paired_steps"] >= 3


@pytest.mark.slow
def test_a_closed_pipe_loses_none_of_the_files(tmp_path):
    done = subprocess.run(
        f"set -o pipefail; {sys.executable} -m rcnn.doctor tests.fixtures.models:box_head_like "
        f"{' '.join(QUICK)} --out {tmp_path / 'd'} | head -3",
        shell=True,
        executable="/bin/bash",
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    # 141 where a write met the closed pipe; 0 where the printout fit the pipe's buffer before head closed it
    assert done.returncode in (0, 141) and "Traceback" not in done.stderr and "Exception" not in done.stderr
    assert len(done.stdout.splitlines()) == 3
    assert {p.name for p in (tmp_path / "d").iterdir()} == OUT_FILES


@pytest.mark.slow  # one compile: 20-30 s on 2 CPU cores
@pytest.mark.skipif(bool(compile_unavailable(torch.device("cpu"))), reason="no torch.compile here")
def test_compile_model_gives_the_compiled_table_with_its_kernels_and_eager_too_beside(project, capsys):
    argv = [
        "tests.fixtures.models:box_head_like",
        *QUICK,
        "--compile",
        "model",
        "--eager-too",
        "--out",
        "out",
    ]
    assert doctor.main(argv) == 0
    printed = capsys.readouterr().out
    assert ", torch.compile (Inductor)" in printed.splitlines()[0]
    said = "Compiled with Inductor: 1 forward and 1 backward graphs, graph breaks: 0; compiling took"
    assert said in printed
    modules = pd.read_csv("out/modules.csv").set_index("module")
    assert "convolution_backward" in modules.loc["fc6", "compiled"] and modules.loc["fc6", "backward_ms"] > 0
    assert json.loads(Path("out/env.json").read_text())["compile"] == "model"
    # --eager-too: the eager model stepped in turn beside it, each module either way
    assert "Eager against compiled, the 15 longest eager backwards" in printed
    compared = pd.read_csv("out/compare.csv").set_index("module")
    assert compared.loc["fc6", "eager_backward_ms"] > 0
    assert compared.loc["fc6", "compiled_backward_ms"] == pytest.approx(modules.loc["fc6", "backward_ms"])


@pytest.mark.slow  # one compile of the box head: 15-20 s on 2 CPU cores
@pytest.mark.skipif(bool(compile_unavailable(torch.device("cpu"))), reason="no torch.compile here")
def test_compile_head_times_the_compiled_box_head_by_its_kernels_and_the_rest_eagerly(project, capsys):
    argv = ["tests.fixtures.models:detector_like", *QUICK, "--compile", "head", "--eager-too", "--out", "out"]
    assert doctor.main(argv) == 0
    printed = capsys.readouterr().out
    assert ", its box head torch.compile'd (Inductor)" in printed.splitlines()[0]
    assert (
        "Compiled with Inductor (roi_heads.box_head, roi_heads.box_predictor): 2 forward and 2 backward"
        in printed
    )
    modules = pd.read_csv("out/modules.csv", keep_default_na=False).set_index("module")
    conv = modules.loc["roi_heads.box_head.0"]  # inside the compiled head: its kernels' time
    assert "convolution_backward" in conv["compiled"] and float(conv["backward_ms"]) > 0
    features = modules.loc["features"]  # outside it: timed eagerly, as without --compile
    assert (
        features["compiled"] == "" and float(features["backward_ms"]) > 0 and float(features["saved_mb"]) > 0
    )
    assert json.loads(Path("out/env.json").read_text())["compile"] == "head"
    compared = pd.read_csv("out/compare.csv").set_index("module")  # --eager-too: an eager copy beside
    assert compared.loc["roi_heads.box_head.0", "eager_backward_ms"] > 0
