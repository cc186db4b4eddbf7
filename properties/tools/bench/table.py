"""The bench's text tables: columns padded to their widest cell, two spaces apart.

Example: ``aligned([("trace", "ms"), ("decode-heavy", "0.105")], left={0})`` ->
``"trace            ms\\ndecode-heavy  0.105"``.
"""

from __future__ import annotations

from collections.abc import Container, Sequence


def aligned(table: Sequence[Sequence[str]], left: Container[int]) -> str:
    """One line per row of ``table`` (the header first): the columns whose index is in
    ``left`` flush left (names), the others flush right (figures), trailing spaces
    dropped."""
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i in left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths))
        ).rstrip()
        for line in table
    )
