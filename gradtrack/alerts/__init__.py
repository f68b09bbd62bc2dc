"""Alert rules applied to step records: pure logic, `StepRecord` in, `AlertEvent`s out.

Each message carries a diagnosis — the likely cause and what to try — from the evidence.
`AlertEngine` (``engine``) applies the rules; each group of rules has a module of its own
(``nonfinite``: non-finite gradients and GradScaler overflow; ``magnitude``: exploding,
vanishing, dead and spiking norms; ``flow``: breaks and gradual fading along depth;
``learning_rate``: the learning rate as the cause, and update ratios) over the state they
share (``book``: the rules per layer, cooldowns and patience, message pieces and the story, the
incident a cause opens). The per-step rules (nonfinite, spike, exploding) find their columns
with `gradtrack.handoff.rules.PerStepRules`, which skip and raise share on the training thread.
"""

from gradtrack.alerts.engine import AlertEngine

__all__ = ["AlertEngine"]
