"""Reading a JSON file a user hands kvconform, bounded in every direction.

:func:`read_json` reads at most ``max_bytes`` (``/dev/zero`` or a FIFO that never ends is
refused after that many bytes, never read without bound), parses with integers of at
most :data:`MAX_INT_DIGITS` digits and nesting within the parser's recursion limit, and
raises :class:`InputError` (a usage error, exit 2) whose one line names the file and what
is wrong. Worked example: a trace holding a 5000-digit integer gives ``InputError("trace
file 'x.json': an integer of 5000 digits, more than the limit 20")``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from reference.errors import KVConformError

#: The most digits an integer of an input file may have (token ids, counts: 10 are used).
MAX_INT_DIGITS = 20


class InputError(KVConformError):
    """An input file is missing, unreadable, too large, too deep or not valid JSON."""


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _IntTooLong(digits)
    return int(text)


class _IntTooLong(ValueError):
    def __init__(self, digits: int) -> None:
        super().__init__(digits)
        self.digits = digits


def read_text(path: str | Path, what: str, max_bytes: int) -> str:
    """The UTF-8 text of the file at ``path``, read within ``max_bytes`` (a device or FIFO
    that never ends is refused after that many bytes; a symbolic link loop, a directory
    or binary content give one line naming the file); ``what`` names it in errors."""
    where = f"{what} {str(path)!r}"
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > max_bytes:  # a regular file: refused before reading it
                raise InputError(f"{where} is {size} bytes, more than the limit {max_bytes}")
            raw = handle.read(max_bytes + 1)
    except FileNotFoundError:
        raise InputError(f"{where} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{where} is a directory, not a file") from None
    except OSError as exc:
        raise InputError(f"cannot read {where}: {exc.strerror or exc}") from None
    if len(raw) > max_bytes:
        raise InputError(f"{where} gives over {max_bytes} bytes, more than the limit {max_bytes}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{where} is not UTF-8 text (a binary file?): {exc.reason} at byte {exc.start}"
        ) from None


def read_json(path: str | Path, what: str, max_bytes: int) -> Any:
    """The JSON value of the file at ``path`` (``what`` names it in errors, e.g. "trace
    file"), read and parsed within the bounds of the module docstring."""
    where = f"{what} {str(path)!r}"
    text = read_text(path, what, max_bytes)
    try:
        return json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except _IntTooLong as exc:
        raise InputError(
            f"{where}: an integer of {exc.digits} digits, more than the limit {MAX_INT_DIGITS}"
        ) from None
    except RecursionError:
        raise InputError(f"{where} is nested deeper than the JSON parser's limit") from None
