"""`BackwardOrder`: which layer, and which pass, a step's non-finite gradient is blamed on.

A replay (`gradtrack.capture.origin`) or the weights check names it when it ran; otherwise the
non-finite layer nearest the loss — the first whose gradient became ready in backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradtrack.formats.event import Stage
from gradtrack.formats.record import StepRecord


class BackwardOrder:
    """The order layers' gradients became ready in a backward pass, and what it blames."""

    def __init__(self, depth: dict[str, int]) -> None:
        self._depth = depth
        self._position: dict[str, int] = {}

    def set(self, layers: Sequence[str]) -> None:
        """Layers in the order their gradients became ready in a backward pass."""
        self._position = {name: i for i, name in enumerate(layers)}

    def origin(self, record: StepRecord, bad: list[str]) -> tuple[str | None, Stage]:
        """Where the non-finite gradient of ``record`` was made, of its ``bad`` layers."""
        if record.nonfinite_weights:
            return record.nonfinite_weights[0], "weights"
        if record.origin_module_stage in ("loss", "forward") and record.origin_module is None:
            return None, record.origin_module_stage  # type: ignore[return-value]
        if record.origin_module is not None and record.origin_module_stage is not None:
            return record.origin_module, record.origin_module_stage  # type: ignore[return-value]
        if record.output_finite is False:
            stage: Stage = "forward"
        elif record.output_grad_finite is False:
            stage = "loss"
        else:
            stage = "backward"
        if not bad or stage == "loss":  # no layer made it: the loss did
            return None, stage
        unknown = len(self._position)
        # Nearest the loss: first in backward order; never seen there → deepest in the model.
        origin = min(
            bad,
            key=lambda layer: (self._position.get(layer, unknown), -self._depth.get(layer, 0)),
        )
        return origin, stage
