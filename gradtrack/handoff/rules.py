"""The per-step rules' one vectorised check each, shared by both threads: the training thread's
``skip`` and ``raise`` (on a step's norms, before its optimizer step) and the worker's alerts
(on its record) trip on exactly the same columns.

Columns are a step's norms: the total or each layer's, in whichever order the caller holds
them; thresholds and ``enabled`` are per column.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from gradtrack.config.rules import SKIPPABLE, AlertRules
from gradtrack.handoff.layout import spike_fields


def nonfinite_columns(
    norms: np.ndarray, nan: np.ndarray | None = None, inf: np.ndarray | None = None
) -> np.ndarray:
    """Columns whose gradient holds NaN or Inf: a non-finite norm (exact norms are non-finite
    only where an element is), or counted NaN/Inf elements where they were counted.

    >>> nonfinite_columns(np.array([1.0, np.nan, np.inf])).tolist()
    [False, True, True]
    """
    bad = ~np.isfinite(norms)
    if nan is not None and inf is not None:
        bad |= (nan > 0) | (inf > 0)
    return bad


def exploding_columns(norms: np.ndarray, threshold: np.ndarray, enabled: np.ndarray) -> np.ndarray:
    """Columns whose finite norm is above their threshold (a non-finite norm is the nonfinite
    rule's finding, not this one's).

    >>> exploding_columns(np.array([5.0, 50.0, np.inf]), np.full(3, 10.0), np.ones(3, bool))
    array([False,  True, False])
    """
    with np.errstate(invalid="ignore"):
        return enabled & np.isfinite(norms) & (norms > threshold)


def spiking_columns(spiking: np.ndarray, enabled: np.ndarray) -> np.ndarray:
    """Columns the every-step spike window flagged (`gradtrack.handoff.layout.spike_fields`),
    where the rule is on."""
    return spiking & enabled


class Trip(NamedTuple):
    """A per-step rule a step tripped: the rule, and the layer it names (None: the total)."""

    rule: str
    layer: str | None


class StepRules:
    """Which columns of a step's norms each per-step rule watches for one action: column 0
    is the total, ``1 + i`` layer ``i`` (as `gradtrack.capture.spike.LayerNorms` orders
    them)."""

    def __init__(self, rules: AlertRules, layer_names: Sequence[str], action: str) -> None:
        self.layer_names = tuple(layer_names)
        self.rules = rules.with_action(action, SKIPPABLE)
        columns: list[str | None] = [None, *layer_names]

        def acts(rule: str) -> np.ndarray:
            found = [rules.for_layer(rule, layer) for layer in columns]
            return np.array([r.enabled and r.action == action for r in found])

        self._nonfinite, self._spike, self._exploding = (acts(rule) for rule in SKIPPABLE)
        self._explode_at = np.array(
            [rules.for_layer("exploding", layer).threshold for layer in columns], np.float64
        )

    def __bool__(self) -> bool:
        return bool(self.rules)

    def find(self, finite: bool, norms: np.ndarray, spike: np.ndarray | None) -> Trip | None:
        """The first of nonfinite, spike, exploding this step trips (``finite``: the guard's
        verdict over every device; ``norms`` cover the first)."""
        if not finite:
            # Any non-finite layer whose rule acts (the first of them), else the total where
            # no layer's norm shows it (the total overflowed, or another device's).
            bad = np.flatnonzero(nonfinite_columns(norms[1:])) + 1
            acting = bad[self._nonfinite[bad]] if len(bad) else bad
            if len(acting):
                return self._trip("nonfinite", int(acting[0]))
            if not len(bad) and self._nonfinite[0]:
                return self._trip("nonfinite", 0)
        if spike is not None:
            fields = spike_fields(spike)
            spiking = spiking_columns(fields["spiking"], self._spike)
            if spiking.any():
                z = np.where(spiking, fields["spike_z"], -np.inf)
                return self._trip("spike", int(np.argmax(z[1:]) + 1) if spiking[1:].any() else 0)
        over = exploding_columns(norms, self._explode_at, self._exploding)
        if over.any():
            past = np.where(over, norms / self._explode_at, -np.inf)
            return self._trip("exploding", int(np.argmax(past)))
        return None

    def _trip(self, rule: str, column: int) -> Trip:
        return Trip(rule, None if column == 0 else self.layer_names[column - 1])
