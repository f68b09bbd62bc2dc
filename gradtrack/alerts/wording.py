"""Small pieces of alert messages shared by several rules."""

from __future__ import annotations

from collections.abc import Sequence

SHOWN_LAYERS = 8


def listed(names: Sequence[str]) -> str:
    """The first few ``names``, and how many more there are.

    >>> listed([f"l{i}" for i in range(10)])
    'l0, l1, l2, l3, l4, l5, l6, l7 and 2 more'
    """
    shown = ", ".join(names[:SHOWN_LAYERS])
    more = len(names) - SHOWN_LAYERS
    return shown + (f" and {more} more" if more > 0 else "")
