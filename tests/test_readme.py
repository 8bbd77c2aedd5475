"""The README's and the manual's (docs/*.md) commands name modules, flags, make targets, stages, params keys
and scripts that exist: each runs in a dry form (``--help``, ``make -n``), so a rename that leaves a page
behind fails here. Their links, paths and module names point at what exists; the README stays short and
links every page of the manual."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pipeline.params import YamlLoader, parse_params
from tests import launcher
from tests.conftest import ROOT, merged
from tests.services import free_port

README = (ROOT / "README.md").read_text()
MANUAL = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *MANUAL]  # every page whose commands are checked
TEXTS = {path: path.read_text() for path in PAGES}
README_WORDS = 1500  # the README stays under this many words (as wc -w counts them)
BIN = Path(sys.executable).parent  # the .venv's: python, dvc, mlflow
PYTHONS = {"python", "python3", ".venv/bin/python"}
PROGRAMS = PYTHONS | {"make", "dvc", ".venv/bin/dvc", "mlflow", ".venv/bin/mlflow"}
SEPARATORS = {"&&", "||", ";", "|"}

# Commands not run even dry, by how they start, and why.
SKIPPED = {
    ".venv/bin/python -c": "the scale-out recipe's user administration: it needs the MLflow tracking server",
}


def shell_blocks(text: str) -> list[str]:
    """The lines of the fenced shell code blocks (bash, sh or no language), heredoc bodies left out."""
    lines, language, heredoc = [], None, None
    for line in text.splitlines():
        fence = re.match(r"\s*```(\w*)", line)
        if fence:
            language = None if language is not None else (fence.group(1) or "sh")
        elif heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
        elif language in ("bash", "sh", "shell"):
            lines.append(line)
            if found := re.search(r"<<-?\s*['\"]?(\w+)", line):
                heredoc = found.group(1)
    return re.sub(r"\\\n", " ", "\n".join(lines)).splitlines()


def inline_spans(text: str) -> list[str]:
    """Inline code in the prose (fenced blocks left out) that starts with a program, wrapped lines joined."""
    prose = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
    return [span for span in spans if span.split()[0] in PROGRAMS or span.startswith("scripts/")]


def commands(line: str) -> list[list[str]]:
    """The commands on a shell line, split at && || ; |, comments and leading VAR=value left out."""
    found, current = [], []
    for token in [*shlex.split(line, comments=True), ";"]:
        if token in SEPARATORS:
            while current and re.fullmatch(r"\w+=.*", current[0]):
                current.pop(0)
            if current:
                found.append(current)
            current = []
        else:
            current.append(token)
    return found


def is_project_command(argv: list[str]) -> bool:
    if re.search(
        r"<\w[^>]*>|\.\.\.|\$\(", " ".join(argv)
    ):  # a placeholder: pipeline.<stage>, -S ..., $(ARGS)
        return False
    if argv[0] in PYTHONS:
        return len(argv) > 1  # not the word `python` in a sentence
    return argv[0] in PROGRAMS or argv[0].startswith("scripts/")


def readme_commands(text: str) -> list[list[str]]:
    found = [argv for line in shell_blocks(text) + inline_spans(text) for argv in commands(line)]
    unique = {shlex.join(argv): argv for argv in found if is_project_command(argv)}
    return list(unique.values())


def page(path: Path) -> str:
    return str(path.relative_to(ROOT))


COMMANDS = readme_commands(README)
PAGE_COMMANDS = [(path, argv) for path in PAGES for argv in readme_commands(TEXTS[path])]


def options(argv: list[str]) -> list[str]:
    """The options a command passes (``--out``, ``-S``), values left out."""
    return [arg.partition("=")[0] for arg in argv if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", arg)]


def subcommand(argv: list[str]) -> list[str]:
    """The words before the first option (``exp run``, ``install``): they choose the help to read."""
    words = []
    for arg in argv:
        if arg.startswith("-"):
            break
        words.append(arg)
    return words


@functools.cache
def run(*argv: str) -> subprocess.CompletedProcess:
    env = os.environ | {"NO_COLOR": "1", "COLUMNS": "200"}
    if argv[0] == sys.executable:  # a Python command: forked warm (tests/launcher.py)
        return launcher.run(list(argv), cwd=ROOT, env=env, timeout=120)
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


@functools.cache
def help_of(*argv: str) -> subprocess.CompletedProcess:
    """What ``argv`` (a command's ``--help``) prints: run once per session, as many pages show one command."""
    return run(*argv)


def check_help(argv: list[str], passed: list[str]) -> None:
    """The help ``argv`` prints (exit 0) names every option in ``passed``."""
    result = help_of(*argv)
    assert result.returncode == 0, f"{shlex.join(argv)}: exit {result.returncode}\n{result.stderr[-2000:]}"
    missing = [
        flag for flag in passed if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", result.stdout)
    ]
    assert not missing, f"{shlex.join(argv)} does not list {', '.join(missing)}"


def set_params(argv: list[str]) -> list[str]:
    """The ``key=value`` of each -S / --set-param."""
    return [value for flag, value in zip(argv, argv[1:]) if flag in ("-S", "--set-param")]


def check_set_params(assignments: list[str]) -> None:
    """The params.yaml with these changes, as DVC would make them, passes the params parser."""
    raw = yaml.load((ROOT / "params.yaml").read_text(), Loader=YamlLoader)  # as load_params reads it
    for assignment in assignments:
        key, _, text = assignment.partition("=")
        change = yaml.load(text, Loader=YamlLoader)
        for part in reversed(key.split(".")):
            change = {part: change}
        raw = merged(raw, change)
    parse_params(raw)


def check_paths(args: list[str]) -> None:
    """The positional arguments that are paths into this project's folders exist (an option's value may be an
    output, and a path outside the project, or under a folder the project lacks, may be made elsewhere)."""
    values = {value for flag, value in zip(args, args[1:]) if flag.startswith("-")}
    paths = [arg for arg in args if "/" in arg and arg not in values and not arg.startswith(("-", "/", "$"))]
    missing = [path for path in paths if (ROOT / path.split("/")[0]).is_dir() and not (ROOT / path).exists()]
    assert not missing, f"no such path in the project: {', '.join(missing)}"


def check_python(argv: list[str]) -> None:
    if argv[1] == "-m":
        words = subcommand(argv[2:])
        check_help([sys.executable, "-m", *words, "--help"], options(argv[2 + len(words) :]))
        check_paths(argv[3:])
    else:
        assert argv[1].endswith(".py") and (ROOT / argv[1]).is_file(), f"{argv[1]}: no such script"
        check_help([sys.executable, argv[1], "--help"], options(argv[2:]))
        check_paths(argv[2:])


def check_make(argv: list[str]) -> None:
    result = run("make", "-n", *argv[1:])
    assert result.returncode == 0, f"make -n {shlex.join(argv[1:])}: {result.stderr.strip()}"
    for assignment in argv[1:]:
        if assignment.startswith("ARGS="):
            check_set_params(set_params(shlex.split(assignment.partition("=")[2])))


def check_dvc(argv: list[str]) -> None:
    words = subcommand(argv[1:])
    check_help([str(BIN / "dvc"), *words, "--help"], options(argv[1 + len(words) :]))
    if words[0] == "repro":  # its targets: stages of dvc.yaml (a dry repro would take the repository's lock)
        stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
        unknown = set(words[1:]) - set(stages)
        assert not unknown, f"{shlex.join(argv)}: not stages of dvc.yaml: {', '.join(sorted(unknown))}"
    check_set_params(set_params(argv))


def check_mlflow(argv: list[str]) -> None:
    words = subcommand(argv[1:])
    check_help([str(BIN / "mlflow"), *words, "--help"], options(argv[1 + len(words) :]))


def check_script(argv: list[str]) -> None:
    path = ROOT / argv[0]
    assert path.is_file() and os.access(path, os.X_OK), f"{argv[0]}: no such executable script"
    check_paths(argv[1:])


def check(argv: list[str]) -> None:
    program = argv[0].rpartition("/")[2]
    if argv[0] in PYTHONS:
        check_python(argv)
    elif program == "make":
        check_make(argv)
    elif program == "dvc":
        check_dvc(argv)
    elif program == "mlflow":
        check_mlflow(argv)
    else:
        check_script(argv)


@pytest.mark.slow  # each runs a command's --help in a subprocess (torch's import: seconds)
@pytest.mark.parametrize(
    "path, argv",
    PAGE_COMMANDS,
    ids=[f"{page(path)}: {shlex.join(argv)[:70]}" for path, argv in PAGE_COMMANDS],
)
def test_a_readme_command_names_what_exists(path, argv):
    for start, reason in SKIPPED.items():
        if shlex.join(argv).startswith(start):
            pytest.skip(reason)
    check(argv)


def test_the_readme_commands_are_found():
    """The extraction itself: each kind of command the README and the manual show is among those checked,
    the quick start's in the README itself, and every page of the manual has commands to check."""
    starts = {shlex.join(argv[:2]) for argv in COMMANDS}
    assert {
        "make repro",
        "make test",
        "make test-fast",
        "make lint",
        "make exp",
        ".venv/bin/python -m",
    } <= starts
    everywhere = {shlex.join(argv[:2]) for _, argv in PAGE_COMMANDS}
    assert {
        ".venv/bin/dvc exp",
        ".venv/bin/dvc repro",
        ".venv/bin/python -m",
        "python3 -m",
        "mlflow server",
        "scripts/device-check.sh presets/h200.yaml",
    } <= everywhere
    assert MANUAL, "no docs/*.md"
    empty = [page(path) for path in MANUAL if not readme_commands(TEXTS[path])]
    assert not empty, f"no command to check in {', '.join(empty)}"


@pytest.mark.slow  # runs two commands' --help in a subprocess
def test_a_manual_page_naming_a_flag_that_does_not_exist_fails():
    """A page's fenced and inline commands are both checked: a flag no --help lists fails either way."""
    text = (
        "Run it:\n\n```bash\n.venv/bin/python -m rcnn.doctor torchvision:vit_b_16 --no-such-flag 3\n```\n\n"
        "or `.venv/bin/python -m rcnn.bench --head conv --no-such-option`.\n"
    )
    found = readme_commands(text)
    assert [argv[2] for argv in found] == ["rcnn.doctor", "rcnn.bench"]
    for argv, flag in zip(found, ("--no-such-flag", "--no-such-option")):
        with pytest.raises(AssertionError, match=f"does not list {flag}"):
            check(argv)


@pytest.mark.slow  # runs a command's --help in a subprocess
def test_a_renamed_flag_module_target_or_param_fails():
    with pytest.raises(AssertionError, match="does not list --no-such-flag"):
        check([".venv/bin/python", "-m", "rcnn.bench", "--no-such-flag", "1"])
    with pytest.raises(AssertionError, match="exit 1"):
        check(["python", "-m", "pipeline.no_such_stage"])
    with pytest.raises(AssertionError, match="make -n no-such-target"):
        check(["make", "no-such-target"])
    with pytest.raises(AssertionError, match="not stages of dvc.yaml"):
        check([".venv/bin/dvc", "repro", "no_such_stage"])
    with pytest.raises(ValueError, match="model.backbone"):
        check(["make", "exp", "ARGS=-S model.backbone=no_such_backbone"])
    with pytest.raises(AssertionError, match="no such path in the project: presets/no_such.yaml"):
        check(["scripts/device-check.sh", "presets/no_such.yaml", "$OUT"])
    with pytest.raises(AssertionError, match="no such executable script"):
        check(["scripts/no_such.sh"])


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


# What the snippets leave to the reader, made small: a model with the question's 7x7 conv, its input, and a
# training loop's parts (a loader of labelled batches, a loss, an optimizer, a GradScaler).
SNIPPET_PREAMBLE = """
import torch
from torch import nn
model = nn.Sequential(nn.Conv2d(256, 1024, kernel_size=7), nn.Flatten(), nn.ReLU())
example_images = torch.randn(4, 256, 7, 7)
loader = [(example_images, torch.arange(4))] * 30
criterion = nn.CrossEntropyLoss()
optimizer = opt = torch.optim.SGD(model.parameters(), lr=0.0)
scaler = torch.amp.GradScaler("cpu", enabled=False)
"""


def test_the_readme_python_snippets_import_what_exists():
    """Each import in the python blocks of the README and the manual names a module and attribute that
    exist."""
    assert python_blocks(README), "the README shows no python snippet"
    blocks = [block for path in PAGES for block in python_blocks(TEXTS[path])]
    imports = [
        line for block in blocks for line in block.splitlines() if re.match(r"(from \S+ )?import ", line)
    ]
    assert imports
    exec(compile("\n".join(imports), "the pages' imports", "exec"), {})  # ImportError names what is missing


SNIPPETS = [(path, block) for path in PAGES for block in python_blocks(TEXTS[path])]


@pytest.mark.slow  # each runs in a subprocess
@pytest.mark.parametrize(
    "path, block", SNIPPETS, ids=[f"{page(path)}: snippet {i}" for i, (path, _) in enumerate(SNIPPETS)]
)
def test_a_python_snippet_runs(path, block, tmp_path):
    """Each python block runs as written, given a model and its example input where it names them, in a
    folder of its own (a snippet may save files: w.save("doctor-run/")), as the one process of a torchrun
    (a DistributedDataParallel snippet reads torchrun's environment)."""
    torchrun = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    result = launcher.run(
        [sys.executable, "-c", SNIPPET_PREAMBLE + block],
        cwd=tmp_path,
        timeout=120,
        env=os.environ | {"PYTHONPATH": str(ROOT), "LOCAL_RANK": "0", **torchrun},
    )
    assert result.returncode == 0, f"{page(path)}:\n{block}\n{result.stderr[-2000:]}"


def test_the_readme_is_short_and_links_every_page_of_the_manual():
    words = len(README.split())  # as wc -w counts them
    assert words < README_WORDS, f"README.md has {words} words; it stays under {README_WORDS}"
    linked = {target for target, _ in links(ROOT / "README.md")}
    unlinked = [page(path) for path in MANUAL if path not in linked]
    assert not unlinked, f"README.md does not link {', '.join(unlinked)}"


def links(path: Path) -> list[tuple[Path, str]]:
    """The relative links and images of a page: the file each points at, and its #fragment (or "")."""
    prose = re.sub(r"^\s*```.*?^\s*```", "", TEXTS.get(path) or path.read_text(), flags=re.S | re.M)
    prose = re.sub(r"`[^`]*`", "", prose)
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z][\w+.-]*:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        found.append(((path.parent / file).resolve() if file else path, fragment))
    return found


def anchors(path: Path) -> set[str]:
    """The #fragments of a markdown page's headings, as GitHub makes them."""
    headings = re.findall(
        r"^#+\s+(.*?)\s*$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M), re.M
    )
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("path", PAGES, ids=page)
def test_every_relative_link_points_to_an_existing_file(path):
    broken = []
    for target, fragment in links(path):
        if not target.exists():
            broken.append(
                f"{target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}: no such file"
            )
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{target.relative_to(ROOT)}#{fragment}: no such heading")
    assert not broken, f"{page(path)}: " + "; ".join(broken)


PROJECT_FOLDERS = ("rcnn", "pipeline", "benchmarks", "tests", "scripts", "presets", "reports", "docs")
PACKAGES = ("rcnn", "pipeline", "benchmarks", "tests")
RESOLVE = """
import importlib, sys
bad = []
for name in sys.argv[1:]:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
            break
        except ModuleNotFoundError:
            continue
    else:
        bad.append(name)
        continue
    try:
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
    except AttributeError:
        bad.append(name)
print(" ".join(bad))
"""


def without_links(text: str) -> str:
    return re.sub(r"\]\([^)]*\)", "]", text)  # links are test_every_relative_link_...'s


def missing_paths(text: str) -> list[str]:
    """The paths into the project's committed folders a text names that do not exist (placeholders and
    globs left out)."""
    folders = "|".join(PROJECT_FOLDERS)
    paths = {
        found.rstrip(".,:;")
        for found in re.findall(rf"(?<![\w./-])(?:{folders})/[\w./*<>-]*", without_links(text))
        if not re.search(r"[<*]", found)
    }
    return sorted(path for path in paths if not (ROOT / path).exists())


def module_names(text: str) -> list[str]:
    packages = "|".join(PACKAGES)
    return sorted(set(re.findall(rf"(?<![\w./:-])(?:{packages})(?:\.[A-Za-z_]\w*)+", without_links(text))))


def missing_modules(text: str) -> list[str]:
    """The dotted names of the project's modules a text names (``rcnn.fix.linearize``) that do not import,
    down to their attribute."""
    result = run(sys.executable, "-c", RESOLVE, *module_names(text))
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


@pytest.mark.slow  # imports every module named, in a subprocess
@pytest.mark.parametrize("path", PAGES, ids=page)
def test_every_project_path_and_module_named_exists(path):
    """A path into the project's committed folders (``rcnn/doctor/attribution.py``) exists, and a module
    named with dots (``rcnn.fix.linearize``, ``pipeline.compare``) imports, down to its attribute: a page
    left naming a module that moved fails here."""
    missing = missing_paths(TEXTS[path])
    assert not missing, f"{page(path)} names paths that do not exist: {', '.join(missing)}"
    missing = missing_modules(TEXTS[path])
    assert not missing, f"{page(path)} names modules that do not exist: {', '.join(missing)}"


@pytest.mark.slow
def test_a_moved_module_or_path_fails():
    text = (
        "`rcnn/schema.py` and `rcnn/detector/schema.py`; `rcnn.attribution` and `rcnn.doctor.attribution`; "
        "`rcnn.fix.linearize` and `rcnn.fix.no_such_function`; `python -m rcnn.timing`; `pipeline.<stage>`."
    )
    assert module_names(README) and module_names(text) == [
        "rcnn.attribution",
        "rcnn.doctor.attribution",
        "rcnn.fix.linearize",
        "rcnn.fix.no_such_function",
        "rcnn.timing",
    ]
    assert missing_paths(text) == ["rcnn/schema.py"]
    assert missing_modules(text) == ["rcnn.attribution", "rcnn.fix.no_such_function", "rcnn.timing"]


@pytest.mark.slow
def test_the_readme_doctor_command_runs_and_answers_the_question(tmp_path):
    """The README's doctor command, as written, with a time bound: it prints the by-module table, and the
    answer to the question: the conv head's 7x7 conv is the box head's slowest module, flagged as the matrix
    product it is, whatever the time bound (the longest convolution's flag gets the rounds a decision
    needs); every FPN level is counted."""
    argv = next(argv for argv in COMMANDS if argv[1:3] == ["-m", "rcnn.doctor"])
    assert argv[3] == "detector:conv"
    result = launcher.run(
        [sys.executable, *argv[1:], "--max-seconds", "3", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        timeout=600,
        env=os.environ | {"NO_COLOR": "1", "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "backward_ms" in result.stdout, result.stdout[-2000:]
    assert "- roi_heads.box_head.0 [gemm-in-disguise:covers-input" in result.stdout
    modules = pd.read_csv(tmp_path / "out" / "modules.csv", keep_default_na=False).set_index("module")
    box_head = modules.filter(regex=r"^roi_heads\.box_(head|predictor)\.", axis=0)
    assert box_head["backward_ms"].idxmax() == "roi_heads.box_head.0"
    assert modules.loc["roi_heads.box_head.0", "flag"].startswith("gemm-in-disguise:covers-input")
    calls = modules["calls"]
    assert calls["roi_heads.box_head.0"] == 1 and calls["rpn.head.conv.0.0"] == 5
