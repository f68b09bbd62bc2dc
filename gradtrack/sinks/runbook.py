"""What a tracker sink notes about its run once, or only when it changes.

The first non-finite alert, the weakest and strongest layer, and the layers in order of first
appearance: each sink turns these into its tracker's own calls (MLflow tags and files, W&B
summary and config entries).
"""

from __future__ import annotations

from collections.abc import Iterable

from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord


class RunBook:
    """One run's notes, each handed out only when it is new."""

    def __init__(self) -> None:
        self._nonfinite_seen = False
        self._extremes: tuple[str, str] | None = None
        self._layers: dict[str, None] = {}  # layer names in order of first appearance

    def first_nonfinite(self, event: AlertEvent) -> dict[str, int | str]:
        """The first non-finite alert's step, layer and stage, named as the trackers name
        them; empty for any other event, and for every non-finite one after the first."""
        if event.rule != "nonfinite" or self._nonfinite_seen:
            return {}
        self._nonfinite_seen = True
        return {
            "first_nonfinite_step": event.step,
            "first_nonfinite_layer": event.origin_layer or "",
            "first_nonfinite_stage": event.origin_stage or "",
        }

    def extremes(self, record: StepRecord) -> dict[str, str]:
        """The weakest and strongest layer by gradient norm, when they differ from the last
        ones handed out; empty otherwise."""
        extremes = record.extreme_layers()
        names = None if extremes is None else (extremes[0][0], extremes[1][0])
        if names is None or names == self._extremes:
            return {}
        self._extremes = names
        return {"weakest_layer": names[0], "strongest_layer": names[1]}

    def add_layers(self, layers: Iterable[str]) -> bool:
        """Note the layers not seen before; True if there were any."""
        new = [layer for layer in layers if layer not in self._layers]
        self._layers.update(dict.fromkeys(new))
        return bool(new)

    @property
    def layers(self) -> list[str]:
        """Every layer noted so far, in order of first appearance."""
        return list(self._layers)
