"""Two array tests the control plane's bulk paths share: are all entries alike
(:func:`same_everywhere`), and are these rows one run (:func:`row_index`). A batch
prefilled together holds consecutive rows with equal counts, and both tests cost one
bytes comparison, no numpy ufunc: cheap enough to try before a bulk path.

Example: ``same_everywhere(np.array([5, 5]))`` -> True; ``row_index(np.array([4, 5]))``
-> ``slice(4, 6)``.
"""

from __future__ import annotations

import numpy as np


def same_everywhere(values: np.ndarray) -> bool:
    """Does every entry (every row, of a matrix) equal the first (a non-empty array)? One
    bytes comparison. Example: ``[5, 5, 5]`` -> True; ``[5, 6]`` -> False; ``[[1, 0], [1,
    0]]`` -> True."""
    return values.tobytes() == values[:1].tobytes() * len(values)


def row_index(rows: np.ndarray) -> np.ndarray | slice:
    """``rows`` as a slice when they are consecutive and increasing (views instead of
    gathers), else themselves. Example: ``[4, 5, 6]`` -> ``slice(4, 7)``."""
    first = rows.item(0)
    if rows.tobytes() == np.arange(first, first + rows.size, dtype=rows.dtype).tobytes():
        return slice(first, first + rows.size)
    return rows
