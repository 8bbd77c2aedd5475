"""Where a command may write: inside the project, and over nothing it did not write itself; and how.

The project is the nearest folder at or above a start folder (the params file's, or the working folder)
that holds dvc.yaml, else the start folder itself. An output must resolve inside it (symlinks followed).
An existing file is replaced only when it has the layout the command writes (a trials table's header, the
report's title), so a mistyped path cannot overwrite params.yaml, dvc.yaml or
a source file; a folder is emptied only when every file in it is one the command writes. Each check runs
before anything is measured or written, and raises OutputError naming the path.
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rcnn.rules import UserError


class OutputError(UserError):
    """An output path that would leave the project or replace what the command did not write."""


@dataclass(frozen=True)
class Kind:
    """What a command writes at a path, recognised in an existing file by its layout."""

    name: str  # with its article: "an Optuna journal"
    recognises: Callable[[Path], bool]


def _head(path: Path, size: int = 1 << 16) -> bytes:
    with path.open("rb") as f:
        return f.read(size)


def first_line_of(path: Path) -> str:
    return _head(path).decode("utf-8", errors="replace").partition("\n")[0]


def parse_json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def csv_with(*columns: str) -> Kind:
    """A CSV table whose header names ``columns`` (among others: the column set may grow)."""
    return Kind("a results table", lambda path: set(columns) <= set(first_line_of(path).strip().split(",")))


def json_object(name: str, *keys: str) -> Kind:
    """A JSON object holding any of ``keys``."""
    return Kind(
        name,
        lambda path: (
            isinstance(data := parse_json(path.read_text(errors="replace")), dict)
            and any(k in data for k in keys)
        ),
    )


def text_start(name: str, prefix: str) -> Kind:
    return Kind(name, lambda path: first_line_of(path).startswith(prefix))


CSV = Kind("a CSV table", lambda path: "," in first_line_of(path) and b"\0" not in _head(path))
PNG = Kind("a PNG image", lambda path: _head(path, 8) == b"\x89PNG\r\n\x1a\n")
# SQLite creates a database file empty and writes its header with the first table.
SQLITE = Kind(
    "an SQLite database", lambda path: path.stat().st_size == 0 or _head(path, 16) == b"SQLite format 3\0"
)


def project_root(start: str | Path) -> Path:
    """The nearest folder at or above ``start`` holding dvc.yaml, else ``start``."""
    start = Path(start).resolve()
    return next((folder for folder in (start, *start.parents) if (folder / "dvc.yaml").is_file()), start)


def inside(path: str | Path, root: Path, what: str) -> Path:
    """``path`` resolved; OutputError unless it lies inside ``root``."""
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(root):
        raise OutputError(f"{what}: {path} resolves outside the project {root}; allowed: a path inside it")
    return resolved


def is_ours(path: Path, kind: Kind) -> bool:
    try:
        return path.is_file() and kind.recognises(path)
    except OSError:
        return False


def check_output(path: str | Path, kind: Kind, *, root: Path, what: str) -> Path:
    """Raise OutputError unless ``path`` resolves inside ``root`` and is absent or a ``kind`` file."""
    resolved = inside(path, root, what)
    if resolved.is_dir():
        raise OutputError(f"{what}: {path} is a folder; allowed: a file path")
    if resolved.exists() and not is_ours(resolved, kind):
        raise OutputError(
            f"{what}: {path} exists and is not {kind.name} this command wrote; allowed: a new "
            f"path or one it wrote before (nothing was changed)"
        )
    return resolved


def check_sqlite_url(url: str, *, root: Path, what: str) -> None:
    """For an ``sqlite:///path`` URL, the checks of ``check_output`` on its database file; other URLs (a
    database server, an MLflow server) write nothing here and pass."""
    scheme, sep, rest = url.partition(":///")
    if sep and scheme.split("+")[0] == "sqlite" and rest:
        check_output(rest.partition("?")[0], SQLITE, root=root, what=what)


def check_folder(folder: str | Path, files: dict[str, Kind], *, root: Path, what: str) -> Path:
    """Check that writing ``files`` (relative path -> kind) under ``folder`` replaces nothing foreign."""
    resolved = inside(folder, root, what)
    if resolved.exists() and not resolved.is_dir():
        raise OutputError(f"{what}: {folder} is a file; allowed: a folder path")
    for name, kind in files.items():
        check_output(Path(folder) / name, kind, root=root, what=what)
    return resolved


def claim_folder(folder: str | Path, owned: re.Pattern, *, root: Path | None = None, what: str) -> list[Path]:
    """The files to remove before rewriting ``folder``: OutputError unless it lies inside ``root`` (None: any
    folder, for a tool installed to run anywhere, its ``--out`` given explicitly) and is absent, empty, or
    holds only plain files whose names match ``owned`` (the layout the command writes)."""
    resolved = inside(folder, root, what) if root is not None else Path(folder).resolve()
    if not resolved.exists():
        return []
    if not resolved.is_dir():
        raise OutputError(f"{what}: {folder} is a file; allowed: an absent or empty folder, or one it wrote")
    entries = list(resolved.iterdir())
    foreign = sorted(
        e.name for e in entries if e.is_symlink() or not e.is_file() or not owned.fullmatch(e.name)
    )
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutputError(
            f"{what}: {folder} holds files this command did not write ({shown}); allowed: an absent "
            "or empty folder, or one it wrote (nothing was deleted)"
        )
    return entries


def write_atomic(path: str | Path, text: str) -> None:
    """Write through a temporary file and rename, so readers never see half a file; the file gets the mode the
    umask gives any new file (the temporary file's 0600 would survive the rename). A write that fails (a full
    disk, a file marked immutable) raises NotWritable naming the path and the errno: the file as it was stays,
    and no temporary file is left."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as err:
        raise NotWritable(f"{path}: cannot write it ({_errno(err)})") from err
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise NotWritable(
                f"{path}: cannot write it ({_errno(err)}); the file as it was is untouched"
            ) from err
        raise


def _umask() -> int:
    mask = os.umask(0o22)  # read by setting it: put back at once
    os.umask(mask)
    return mask


def _errno(err: OSError) -> str:
    """'errno 28, No space left on device'."""
    return f"errno {err.errno}, {err.strerror}" if err.errno else str(err)


class NotWritable(UserError, OSError):
    """An output whose folder cannot be created or written to."""


# Free space an output's filesystem must have before measuring: the tables are small, but the stores (the
# journal, MLflow's runs and artifacts) grow while measuring.
MIN_FREE_MB = 50
# chattr's immutable and append-only flags (FS_IOC_GETFLAGS): such a file cannot be replaced, even by root.
_FS_IOC_GETFLAGS, _UNREPLACEABLE = 0x80086601, 0x10 | 0x20


def check_writable(*paths: str | Path) -> None:
    """Raise NotWritable naming the first output path whose folder cannot be created or written to, whose
    filesystem has under MIN_FREE_MB free, or which is a file marked immutable or append-only."""
    for path in map(Path, paths):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=path.parent).close()
            free_mb = shutil.disk_usage(path.parent).free / 2**20
        except OSError as err:
            raise NotWritable(f"{path}: cannot write there ({_errno(err)})") from None
        if free_mb < MIN_FREE_MB:
            raise NotWritable(
                f"{path}: {free_mb:.0f} MB free on its filesystem; allowed: at least {MIN_FREE_MB} MB free"
            )
        if _unreplaceable(path):
            raise NotWritable(
                f"{path}: marked immutable or append-only (chattr +i or +a); allowed: a file it may replace"
            )


def _unreplaceable(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            flags = array.array("l", [0])
            fcntl.ioctl(f.fileno(), _FS_IOC_GETFLAGS, flags)
    except OSError:  # absent, unreadable, or a filesystem without the flags
        return False
    return bool(flags[0] & _UNREPLACEABLE)
