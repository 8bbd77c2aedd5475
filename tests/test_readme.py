"""The README's commands name modules, flags, make targets, stages, params keys and scripts that exist: each
runs in a dry form (``--help``, ``make -n``), so a rename that leaves the README behind fails here."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.params import YamlLoader, parse_params
from tests.conftest import ROOT, merged

README = (ROOT / "README.md").read_text()
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


COMMANDS = readme_commands(README)


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
    return subprocess.run(
        argv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"NO_COLOR": "1", "COLUMNS": "200"},
    )


def check_help(argv: list[str], passed: list[str]) -> None:
    """The help ``argv`` prints (exit 0) names every option in ``passed``."""
    result = run(*argv)
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


@pytest.mark.parametrize("argv", COMMANDS, ids=[shlex.join(argv)[:70] for argv in COMMANDS])
def test_a_readme_command_names_what_exists(argv):
    for start, reason in SKIPPED.items():
        if shlex.join(argv).startswith(start):
            pytest.skip(reason)
    check(argv)


def test_the_readme_commands_are_found():
    """The extraction itself: each kind of command the README shows is among those checked."""
    starts = {shlex.join(argv[:2]) for argv in COMMANDS}
    assert {
        "make repro",
        "make test",
        "make test-fast",
        "make exp",
        ".venv/bin/dvc exp",
        ".venv/bin/dvc repro",
        ".venv/bin/python -m",
        "python3 -m",
        "mlflow server",
        "scripts/device-check.sh presets/h200.yaml",
    } <= starts


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


def test_the_readme_python_snippets_import_what_exists():
    """Each import in the README's python blocks names a module and attribute that exist."""
    blocks = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)
    imports = [
        line for block in blocks for line in block.splitlines() if re.match(r"(from \S+ )?import ", line)
    ]
    assert imports
    result = run(sys.executable, "-c", "\n".join(imports))
    assert result.returncode == 0, result.stderr[-2000:]
