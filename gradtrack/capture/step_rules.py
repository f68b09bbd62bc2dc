"""The per-step rules (nonfinite, spike, exploding) judged in the training thread, on a step's
norms, for the actions that must act before its optimizer step: ``skip`` and ``raise``.

The checks themselves are `gradtrack.handoff.trips`', which the worker's alerts share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from gradtrack.config.rules import SKIPPABLE, AlertRules
from gradtrack.handoff.layout import spike_fields
from gradtrack.handoff.trips import exploding_columns, nonfinite_columns, spiking_columns


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
