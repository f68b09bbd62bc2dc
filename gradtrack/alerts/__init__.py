"""Alert rules applied to step records: pure logic, `StepRecord` in, `AlertEvent`s out.

Each message carries a diagnosis — the likely cause and what to try — from the evidence.
`AlertEngine` (``engine``) applies the rules; each rule family has a module of its own
(``nonfinite``, ``exploding``, ``vanishing``, ``dead``, ``spikes``, ``update_ratio``,
``learning_rate``, ``jump``, ``flow``, ``amp``) over the state they share (``rulebook``,
``cooldown``, ``patience``, ``kinds``, ``blame``, and ``story``: the incident a cause opens).
"""

from gradtrack.alerts.engine import AlertEngine
from gradtrack.formats.event import AlertEvent, Stage

__all__ = ["AlertEngine", "AlertEvent", "Stage"]
