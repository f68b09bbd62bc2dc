"""`RuleBook`: the alert rules as they apply to each layer, looked up once.

A rule's fields for one layer (per-layer overrides applied) are cached, and so is one field
of one rule for every layer at once, as an array in depth order, for the rules that check
all layers in one vectorised pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gradtrack.config.rules import AlertRules
from gradtrack.formats.record import StepRecord


class RuleBook:
    """The rules of one engine, per layer; ``names`` and ``depth`` give the depth order."""

    def __init__(self, rules: AlertRules, depth_order: Sequence[str]) -> None:
        self.rules = rules
        self.names = list(depth_order)
        self.depth = {name: i for i, name in enumerate(depth_order)}
        self._rules: dict[tuple[str, str | None], Any] = {}
        self._fields: dict[tuple[str, str], np.ndarray] = {}

    def rule(self, name: str, layer: str | None) -> Any:
        """The rule ``name`` as it applies to ``layer`` (None: the total norm)."""
        key = (name, layer)
        if key not in self._rules:
            self._rules[key] = self.rules.for_layer(name, layer)
        return self._rules[key]

    def param(self, rule: str, field: str, idx: np.ndarray) -> np.ndarray:
        """One rule field for every layer (per-layer overrides applied), at ``idx``."""
        key = (rule, field)
        if key not in self._fields:
            values = [float(getattr(self.rule(rule, name), field)) for name in self.names]
            self._fields[key] = np.array(values, dtype=np.float64)
        return self._fields[key][idx]

    def enabled(self, rule: str, idx: np.ndarray) -> np.ndarray:
        """Whether ``rule`` is on, per layer at ``idx``."""
        return self.param(rule, "enabled", idx) > 0

    def positions(self, record: StepRecord) -> np.ndarray:
        """Each of the record's layers' position in depth order (the rows' ``idx``)."""
        return self.at(record.layers)

    def at(self, layers: Sequence[str]) -> np.ndarray:
        """The positions in depth order of ``layers``."""
        return np.fromiter((self.depth[name] for name in layers), np.int64, len(layers))
