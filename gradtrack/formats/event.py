"""`AlertEvent`: what one alert says — the rule, where, by how much, and what to do."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from gradtrack.config.rules import Severity

Stage = Literal["forward", "loss", "backward", "weights"]


class AlertEvent(BaseModel):
    """One alert: what tripped, where, by how much, and what to do about it.

    ``origin_layer`` / ``origin_stage`` say where non-finite gradients were made (see
    `gradtrack.capture.origin`): ``"forward"`` — the first module, in execution order, whose output
    was non-finite (None: the input batch already was); ``"loss"`` — the gradient reaching
    the model output was; ``"backward"`` — the innermost module whose input gradient was
    non-finite while its output gradient was finite (any module, not only a layer; without a
    replay, the non-finite layer nearest the loss); ``"weights"`` — the weights were already
    non-finite (an earlier bad update was applied): the first such layer.

    Per-layer rules that trip in several layers at one step make one event: ``layers`` names
    them all (depth order), ``layer``/``value``/``threshold`` are the worst of them.
    """

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")

    step: int
    wall_time: float
    rule: str
    layer: str | None
    statistic: str
    value: float
    threshold: float | None
    severity: Severity
    message: str
    rank: int = 0
    ranks: tuple[int, ...] | None = None  # DDP: ranks whose local gradient was non-finite
    origin_layer: str | None = None
    origin_stage: Stage | None = None
    layers: tuple[str, ...] = ()  # every layer it covers (non-finite: all); () if whole-model
    # Within its rule's cooldown: not notified (sinks, logs, callbacks never see it), made
    # only so that a rule whose action is "raise" raises every time.
    silenced: bool = False
    # An incident's first mover (`gradtrack.worker.flight_log`): the layer whose gradient norm left
    # its own range first in the flight recorder's window, and the step its move began.
    first_mover: str | None = None
    first_mover_step: int | None = None

    @property
    def title(self) -> str:
        """One line naming the rule and where: its worst layer (and how many more), or how
        many layers where it names none (a NaN the loss made reaches every layer).

        >>> base = dict(step=3, wall_time=0.0, statistic="norm", value=1.0, threshold=None,
        ...             severity="error", message="")
        >>> AlertEvent(rule="nonfinite", layer=None, layers=("a", "b"),
        ...            origin_stage="loss", **base).title
        'gradtrack: nonfinite in 2 layers, made by the loss'
        >>> AlertEvent(rule="dead", layer="fc", layers=("fc", "out"), **base).title
        'gradtrack: dead in fc and 1 more layer'
        """
        where = ""
        if self.layer:
            where = f" in {self.layer}"
            more = len(self.layers) - 1
            if more > 0:
                where += f" and {more} more layer{'s' if more > 1 else ''}"
        elif self.layers:
            where = f" in {len(self.layers)} layer{'s' if len(self.layers) > 1 else ''}"
        elif self.statistic == "total_norm":
            where = " in the total gradient norm"
        if self.origin_stage == "loss" and self.origin_layer is None:
            where += ", made by the loss"
        return f"gradtrack: {self.rule}{where}"
