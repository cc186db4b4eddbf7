"""Readable differences between two values a check compares (lists of block ids above all).

A mismatch never prints thousands of ids: two lists that differ are shown as their
lengths, the number of positions that differ, the first differing position and a window
of a few entries around it (the full values are in the saved trace). A list of lists
(block tables, group by group) names the first group that differs and diffs that group.

Worked example::

    >>> print(diff_lists([1, 2, 3, 4, 5, 6], [1, 2, 9, 4, 5, 6], ("reference", "engine"), 1))
    lengths 6 and 6, 1 position differs, the first at index 2:
      reference [... 2, 3, 4 ...] (indices 1-3)
      engine    [... 2, 9, 4 ...]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Entries shown either side of the first differing position.
WINDOW = 4
#: A list at most this long is shown whole.
SHORT = 16


def is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def short(value: Any, limit: int = SHORT) -> str:
    """``value`` in at most about ``limit`` entries: a long list keeps its head and its
    tail and says its length. Example: ``short(list(range(100)), 6)`` is
    ``'[0, 1, 2, ... 97, 98, 99] (100 entries)'``."""
    if not is_list(value):
        return repr(value)
    if len(value) <= limit:
        return "[" + ", ".join(short(v, limit) for v in value) + "]"
    head = ", ".join(short(v, limit) for v in value[: limit // 2])
    tail = ", ".join(short(v, limit) for v in value[len(value) - limit // 2 :])
    return f"[{head}, ... {tail}] ({len(value)} entries)"


def _window(values: Sequence[Any], lo: int, hi: int) -> str:
    inner = ", ".join(short(v) for v in values[lo:hi])
    return f"[{'... ' if lo > 0 else ''}{inner}{' ...' if hi < len(values) else ''}]"


def diff_lists(
    expected: Sequence[Any],
    observed: Sequence[Any],
    names: tuple[str, str] = ("expected", "observed"),
    window: int = WINDOW,
) -> str:
    """How ``observed`` differs from ``expected`` (see the module docstring); lists of
    lists are diffed group by group (the first group that differs)."""
    if all(is_list(v) for v in (*expected, *observed)) and (expected or observed):
        for gid in range(max(len(expected), len(observed))):
            e = expected[gid] if gid < len(expected) else None
            o = observed[gid] if gid < len(observed) else None
            if e != o:
                if e is None or o is None:
                    which = names[0] if e is None else names[1]
                    return (
                        f"group {gid} is missing in the {which}'s answer "
                        f"({len(expected)} and {len(observed)} groups)"
                    )
                return f"group {gid}: " + diff_lists(e, o, names, window)
        return "equal"
    differing = [
        i
        for i in range(max(len(expected), len(observed)))
        if i >= len(expected) or i >= len(observed) or expected[i] != observed[i]
    ]
    if not differing:
        return "equal"
    first = differing[0]
    lo = max(0, first - window)
    hi = first + window + 1
    width = max(len(n) for n in names)
    count = len(differing)
    span_end = min(hi, max(len(expected), len(observed))) - 1
    return (
        f"lengths {len(expected)} and {len(observed)}, {count} "
        f"position{' differs' if count == 1 else 's differ'}, the first at index {first}:\n"
        f"  {names[0].ljust(width)} {_window(expected, lo, hi)} (indices {lo}-{span_end})\n"
        f"  {names[1].ljust(width)} {_window(observed, lo, hi)}"
    )


def describe_mismatch(
    expected: Any, observed: Any, names: tuple[str, str] = ("expected", "observed")
) -> str:
    """Two differing values in a few lines: ``A gives a, B gives b`` when both are small
    (at most :data:`SHORT` entries, counting the entries of nested lists), a diff
    (:func:`diff_lists`) for longer lists."""
    if is_list(expected) and is_list(observed) and size(expected) + size(observed) > 2 * SHORT:
        return diff_lists(expected, observed, names)
    return f"{names[0]} gives {short(expected)}, {names[1]} gives {short(observed)}"


def size(value: Any) -> int:
    """Entries of ``value``, counting nested lists' entries: ``size([[1, 2], [3]])`` is 3."""
    if not is_list(value):
        return 1
    return sum(size(v) for v in value)


def token_range(end: int, start: int = 0) -> str:
    """A prefix as a token range: ``token_range(8)`` is ``'tokens [0, 8)'``."""
    return f"tokens [{start}, {end})"


def short_record(record: Any) -> str:
    """A call record (a dict of the log) with its long lists shortened (:func:`short`).
    Example: ``short_record({"call": "free", "result": None})`` is
    ``"{'call': 'free', 'result': None}"``."""
    if not isinstance(record, dict):
        return short(record)
    inner = ", ".join(f"{k!r}: {short_value(v)}" for k, v in record.items())
    return "{" + inner + "}"


def short_value(value: Any) -> str:
    """``value`` shortened: lists by :func:`short`, dicts by :func:`short_record`."""
    if isinstance(value, dict):
        return short_record(value)
    return short(value) if is_list(value) and size(value) > SHORT else repr(value)
