"""The per-step rules (nonfinite, spike, exploding), built once per watch and shared by both
threads: the training thread's ``skip`` and ``raise`` (on a step's norms, before its optimizer
step) and the worker's alerts (on its record) ask the one `PerStepRules` which columns trip,
so they trip on exactly the same ones. The alert modules only word what it found.

Columns are a step's norms: column 0 the total, ``1 + i`` layer ``i`` of the watch (as
`gradtrack.capture.spike.LayerNorms` orders them); thresholds, ``enabled`` and the action are
per column, per-layer overrides applied.
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


class Trip(NamedTuple):
    """A per-step rule a step tripped: the rule, and the layer it names (None: the total)."""

    rule: str
    layer: str | None


class PerStepRules:
    """The per-step rules of one watch, per column: on or off, their action, the exploding
    threshold and the spike window's ``z`` and ``ratio``. Nothing else reads these fields of
    the three rules.

    >>> rules = PerStepRules(AlertRules(exploding={"threshold": 10.0}), ["a", "b"])
    >>> rules.exploding(np.array([50.0, 5.0, np.inf]), np.arange(3)).tolist()
    [True, False, False]
    """

    def __init__(self, rules: AlertRules, layer_names: Sequence[str]) -> None:
        self.alert_rules = rules
        self.layer_names = tuple(layer_names)
        found = {
            rule: [rules.for_layer(rule, c) for c in (None, *layer_names)] for rule in SKIPPABLE
        }
        self.enabled = {rule: np.array([r.enabled for r in found[rule]]) for rule in SKIPPABLE}
        self.actions = {rule: np.array([r.action for r in found[rule]]) for rule in SKIPPABLE}
        self.explode_at = np.array([r.threshold for r in found["exploding"]], np.float64)
        self.spike_z = [float(r.z) for r in found["spike"]]
        self.spike_ratio = np.array([r.ratio for r in found["spike"]], np.float64)

    def nonfinite(
        self,
        cols: np.ndarray,
        norms: np.ndarray,
        nan: np.ndarray | None = None,
        inf: np.ndarray | None = None,
    ) -> np.ndarray:
        """Of columns ``cols`` (their norms and, where counted, NaN/Inf counts), those whose
        gradient holds NaN or Inf and whose nonfinite rule is on."""
        return nonfinite_columns(norms, nan, inf) & self.enabled["nonfinite"][cols]

    def exploding(self, norms: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Of columns ``cols`` (their ``norms``), those above their exploding threshold."""
        return exploding_columns(norms, self.explode_at[cols], self.enabled["exploding"][cols])

    def spiking(self, flagged: np.ndarray) -> np.ndarray:
        """Of every column, those the every-step spike window flagged where the rule is on."""
        return flagged & self.enabled["spike"]

    def acting(self, rule: str, action: str) -> np.ndarray:
        """Per column, whether ``rule`` is on there with ``action``."""
        return self.enabled[rule] & (self.actions[rule] == action)


class StepRules:
    """The per-step rules whose action is one of ``skip`` or ``raise``, judged on a step's
    norms before its optimizer step (`PerStepRules` gives the columns)."""

    def __init__(self, per_step: PerStepRules, action: str) -> None:
        self.layer_names = per_step.layer_names
        self.rules = per_step.alert_rules.with_action(action, SKIPPABLE)
        self.per_step = per_step
        self._nonfinite, self._spike, self._exploding = (
            per_step.acting(rule, action) for rule in SKIPPABLE
        )
        self._explode_at = per_step.explode_at

    def __bool__(self) -> bool:
        return bool(self.rules)

    def find(self, finite: bool, norms: np.ndarray, spike: np.ndarray | None) -> Trip | None:
        """The first of nonfinite, spike, exploding this step trips (``finite``: the guard's
        verdict over every device; ``norms`` cover the first)."""
        if not finite:
            # Any non-finite layer whose rule acts (the first of them), else the total where
            # no layer's norm shows it (the total overflowed, or another device's).
            bad = nonfinite_columns(norms[1:]).nonzero()[0] + 1
            acting = bad[self._nonfinite[bad]] if len(bad) else bad
            if len(acting):
                return self._trip("nonfinite", int(acting[0]))
            if not len(bad) and self._nonfinite[0]:
                return self._trip("nonfinite", 0)
        if spike is not None:
            fields = spike_fields(spike)
            spiking = fields["spiking"] & self._spike
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
