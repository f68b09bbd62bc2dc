"""Where a non-finite gradient arose, in words, and what to try for it."""

from __future__ import annotations

from gradtrack.formats.event import Stage
from gradtrack.formats.record import StepRecord

# The seed's fix column: an eps or a clamp on the op that made it, a GradScaler under fp16.
_FIX = (
    "an eps or a clamp where a log, sqrt or division meets 0 or a negative "
    "(torch.log(x.clamp_min(1e-8)), torch.sqrt(x + 1e-8), x / (y + 1e-8)), "
    "exp/pow overflow, and under fp16 AMP a GradScaler (or bf16)"
)


def nonfinite_diagnosis(record: StepRecord, origin: str | None, stage: Stage) -> tuple[str, str]:
    """Where it arose, and what to try; a ``"weights"`` stage has a message of its own
    (`gradtrack.alerts.nonfinite`)."""
    if stage == "forward" and record.origin_note.startswith("the input batch"):
        return (
            "from the input batch: it already held NaN/Inf (forward pass)",
            "check the data pipeline (missing values, a division in preprocessing): "
            "torch.isfinite(batch).all() where the batch is made",
        )
    if stage == "forward":
        made = f" at {origin}'s output" if record.origin_module else ""
        return (
            f"made in the forward pass{made} (the model output was already non-finite)",
            f"look at {origin}'s forward: {_FIX}; and the input batch for NaN/Inf"
            if record.origin_module
            else f"the input batch for NaN/Inf and the forward numerics: {_FIX}",
        )
    if stage == "loss":
        return (
            "made by the loss: the gradient reaching the model output was already non-finite",
            f"the loss produced it (log(0), division by zero, sqrt of 0, targets outside "
            f"the loss's range): {_FIX}; prefer fused losses (cross_entropy on logits, "
            "binary_cross_entropy_with_logits)",
        )
    return (
        f"first at {origin} (backward; model output finite)",
        f"look at the ops in {origin}'s backward: {_FIX}; then the learning rate (lower it, "
        "or clip the gradient norm)",
    )
