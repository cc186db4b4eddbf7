"""Files kvconform writes for the user: checked before a run, written whole or not at all.

Every output a command is asked for (``--report-json``, ``--junit-xml``,
``--failure-dir``, ``--database``, ``report --html``, ``corpus export``) is checked
before the run starts, so a mistake costs seconds, not the run: :func:`check_output_file`
(a file: not a directory, not a device or FIFO, its folder, or the nearest folder above
it that exists, takes a new file), :func:`check_output_dir` (the same for a folder) and
:func:`check_distinct` (no two options name the same file); nothing is created before
the run. Each raises
:class:`OutputPathError`, a usage error (exit 2) whose one line names the option, the
path and what is wrong.

A file is written by :func:`write_text_atomic`: a temporary file in the same folder,
then a rename, so a full disk or a write error leaves the old file (or none), never a
truncated or empty one; it raises :class:`OutputWriteError` naming the file, which the
caller reports without changing the run's own exit code.

Worked example: ``check_output_file("/tmp", "--report-json")`` raises
``OutputPathError("--report-json '/tmp': is a directory, not a file")``;
``check_output_file("/dev/full", "--junit-xml")`` raises ``... is not a regular file``.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from reference.errors import KVConformError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: The mode of a written file: what ``open()`` would give it under this process's umask.
_FILE_MODE = 0o666 & ~_umask()


class OutputPathError(KVConformError):
    """An output path that cannot be written (a usage error, exit 2)."""


class OutputWriteError(KVConformError):
    """Writing an output failed after the run (the run's exit code stands)."""


def _probe_folder(folder: Path, option: str, shown: str) -> None:
    """``folder`` is a directory that takes a new file, or does not exist yet and its
    nearest existing ancestor is one (nothing is created: the write makes the folders)."""
    existing = folder
    try:
        while not existing.exists():
            if existing.is_symlink():  # a link to nothing (a loop, a missing target)
                raise OutputPathError(
                    f"{option} {shown!r}: {str(existing)!r} is a symbolic link that leads "
                    "nowhere (a loop or a missing target)"
                )
            if existing.parent == existing:
                break
            existing = existing.parent
        is_dir = existing.is_dir()
    except OSError as exc:  # a symbolic link loop, a name too long
        raise OutputPathError(f"{option} {shown!r}: {exc.strerror or exc}") from None
    if not is_dir:
        raise OutputPathError(f"{option} {shown!r}: {str(existing)!r} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvconform-probe-", dir=existing)
    except OSError as exc:
        raise OutputPathError(
            f"{option} {shown!r}: cannot write in {str(existing)!r}: {exc.strerror or exc}"
        ) from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def check_output_file(path: str | Path, option: str) -> Path:
    """``path`` can take the file ``option`` writes (module docstring); returns it."""
    shown = str(path)
    target = Path(path)
    if not shown.strip():
        raise OutputPathError(f"{option}: the path is empty")
    try:
        info = os.stat(target)
    except FileNotFoundError:
        info = None
    except OSError as exc:  # a symbolic link loop, a name too long, ...
        raise OutputPathError(f"{option} {shown!r}: {exc.strerror or exc}") from None
    if info is not None:
        if stat.S_ISDIR(info.st_mode):
            raise OutputPathError(f"{option} {shown!r}: is a directory, not a file")
        if not stat.S_ISREG(info.st_mode):
            raise OutputPathError(
                f"{option} {shown!r}: is not a regular file (a device, FIFO or socket)"
            )
    elif target.is_symlink():
        raise OutputPathError(f"{option} {shown!r}: is a symbolic link to nothing")
    _probe_folder(target.parent, option, shown)
    return target


def check_output_dir(path: str | Path, option: str) -> Path:
    """``path`` is (or can be made) a folder that takes new files; returns it."""
    shown = str(path)
    if not shown.strip():
        raise OutputPathError(f"{option}: the path is empty")
    _probe_folder(Path(path), option, shown)
    return Path(path)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist yet: compare where they would be
        return os.path.abspath(os.path.realpath(a)) == os.path.abspath(os.path.realpath(b))


def check_distinct(paths: Mapping[str, str | Path | None]) -> None:
    """No two options (option -> path, None: not given) name the same file."""
    given = [(option, Path(p)) for option, p in paths.items() if p is not None]
    for i, (first, a) in enumerate(given):
        for second, b in given[i + 1 :]:
            if _same_file(a, b):
                raise OutputPathError(
                    f"{first} and {second} name the same file {str(a)!r}: one would "
                    "overwrite the other"
                )


def write_text_atomic(path: str | Path, text: str, what: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all (module docstring); ``what`` names
    the file in the error (e.g. ``"the JSON report"``)."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        tmp = None
    except (OSError, RuntimeError) as exc:
        detail = getattr(exc, "strerror", None) or exc
        raise OutputWriteError(f"{what} {str(path)!r} was not written: {detail}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path
