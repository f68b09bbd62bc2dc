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


def counted(n: int, noun: str) -> str:
    """``n`` with ``noun``, plural where it is not one.

    >>> counted(1, "layer"), counted(3, "layer"), counted(12000, "step")
    ('1 layer', '3 layers', '12,000 steps')
    """
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def sentence(text: str) -> str:
    """``text`` as a sentence: its first letter a capital. Messages never begin with a layer
    name, whose case is the model's.

    >>> sentence("gradient flow breaks between 2 and 5.")
    'Gradient flow breaks between 2 and 5.'
    """
    return text[:1].upper() + text[1:]
