"""Alert rules applied to step records: pure logic, `StepRecord` in, `AlertEvent`s out.

Each message carries a diagnosis — the likely cause and what to try — from the evidence.
`AlertEngine` (``engine``) applies the rules; each group of rules has a module of its own
(``nonfinite``: non-finite gradients and GradScaler overflow; ``magnitude``: exploding,
vanishing, dead and spiking norms; ``flow``: breaks and gradual fading along depth;
``learning_rate``: the learning rate as the cause, and update ratios) over the state they
share (``book``: the rules per layer, cooldowns and patience; ``wording``: message pieces and
the story, the incident a cause opens).
"""

from gradtrack.alerts.engine import AlertEngine
from gradtrack.formats.event import AlertEvent, Stage

__all__ = ["AlertEngine", "AlertEvent", "Stage"]
