"""The message corpus: every rule's events rendered from step records — every kind, one layer
and many, NaNs made by a layer, the forward pass, the loss and the weights — checked against
the texts a user reads (the event's message and the one-line title trackers show).

The records are built here, not trained, so the texts do not move with a torch release's
numerics; tests/test_alerts.py and tests/scenarios/ trip the same rules on real models.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest

from gradtrack.alerts.engine import AlertEngine
from gradtrack.config.rules import AlertRules
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord

LAYERS = ("stem", "block.0", "block.1", "head")
STACK = ("blocks.0", "blocks.1", "blocks.2", "blocks.3")  # one role, for the flow rule
N = np.nan


def record(step: int, norms: list[float], **fields: object) -> StepRecord:
    """A step whose layers have ``norms`` (100 elements each); ``nan``/``inf``: counts."""
    values = np.asarray(norms, dtype=float)
    nan = np.asarray(fields.pop("nan", [0.0] * len(values)), dtype=float)
    inf = np.asarray(fields.pop("inf", [0.0] * len(values)), dtype=float)
    stats = np.stack(
        [values, values, values / 10, values / 10, np.full(len(values), 100.0), nan, inf], axis=1
    )
    layers = fields.pop("layers", LAYERS)
    fields.setdefault("output_finite", True)
    fields.setdefault("output_grad_finite", True)
    total = float(np.sqrt(np.sum(values**2)))
    return StepRecord(step, 0.0, layers, stats, total, **fields)  # type: ignore[arg-type]


def healthy(steps: range) -> list[StepRecord]:
    return [record(step, [1.0, 1.0, 1.0, 1.0]) for step in steps]


def updates(ratios: list[float]) -> dict[str, np.ndarray]:
    """Update signals: weights of norm 10, each layer moved by ``ratios`` × that."""
    return {"param_norms": np.full(4, 10.0), "update_norms": 10.0 * np.asarray(ratios)}


def spiking(column: int) -> dict[str, np.ndarray]:
    """Spike statistics in which ``column`` (0: the total norm, 1 + i: layer i) spiked."""
    flags = np.zeros(5, dtype=bool)
    flags[column] = True
    return {"spike_z": np.full(5, 6.5), "spike_typical": np.full(5, 0.5), "spiking": flags}


CASES: dict[str, Callable[[], list[StepRecord]]] = {
    "nan_made_in_one_layers_backward": lambda: [
        record(
            10,
            [1, N, 1, 1],
            nan=[0, 5, 0, 0],
            origin_module="block.0",
            origin_module_stage="backward",
        ),
    ],
    "nan_made_in_a_backward_reaching_three_layers": lambda: [
        record(
            10,
            [N, N, N, 1],
            nan=[3, 5, 2, 0],
            origin_module="block.1",
            origin_module_stage="backward",
        ),
    ],
    "nan_made_by_the_loss": lambda: [  # as the replay names it
        record(
            10, [N, N, N, N], nan=[100] * 4, output_grad_finite=False, origin_module_stage="loss"
        ),
    ],
    "nan_made_by_the_loss_without_a_replay": lambda: [
        record(10, [N, N, 1, 1], nan=[7, 3, 0, 0], output_grad_finite=False),
    ],
    "inf_made_in_the_forward_pass": lambda: [
        record(
            10,
            [np.inf, 1, 1, 1],
            inf=[2, 0, 0, 0],
            output_finite=False,
            origin_module="stem",
            origin_module_stage="forward",
        ),
    ],
    "nan_and_inf_from_non_finite_weights": lambda: [
        record(
            10,
            [N, N, N, N],
            nan=[90, 90, 90, 90],
            inf=[10, 0, 0, 0],
            nonfinite_weights=("stem", "block.0"),
        ),
    ],
    "one_layer_exploding": lambda: [*healthy(range(0, 50, 10)), record(50, [1, 5000.0, 1, 1])],
    "vanishing_for_ten_logged_steps": lambda: [
        record(step, [1e-9, 1e-3, 1e-3, 1e-3]) for step in range(0, 100, 10)
    ],
    "one_layer_dead": lambda: (
        healthy(range(1)) + [record(step, [1, 0, 1, 1]) for step in range(10, 110, 10)]
    ),
    "two_layers_dead": lambda: (
        healthy(range(1)) + [record(step, [0, 0, 1, 1]) for step in range(10, 110, 10)]
    ),
    "total_norm_spike": lambda: [
        *healthy(range(0, 50, 10)),
        record(50, [1, 1, 1, 1], **spiking(0)),
    ],
    "one_layer_learns_too_fast": lambda: [
        record(step, [1, 1, 1, 1], **updates([1e-3, 0.3, 1e-3, 1e-3])) for step in range(0, 30, 10)
    ],
    "the_learning_rate_far_too_high": lambda: [
        record(0, [1, 1, 1, 1], **updates([3.0, 2.0, 5.0, 1.5])),
    ],
    "a_collapse_after_large_updates": lambda: [
        record(0, [1, 1, 1, 1], **updates([0.05, 0.04, 0.03, 0.02])),
        record(10, [0, 0, 1, 0.5], **updates([0.05, 0.04, 0.03, 0.02])),
    ],
    "a_break_between_depths": lambda: [record(0, [1e-6, 1e-6, 1, 1])],
    "gradual_vanishing_along_depth": lambda: [
        record(step, [1e-5, 2e-4, 5e-3, 1e-1], layers=STACK) for step in range(0, 30, 10)
    ],
    "amp_overflow": lambda: [
        record(10, [1, 1, 1, 1], amp_skipped=True, amp_scale=65536.0, amp_scale_after=32768.0),
    ],
}


def events_of(case: str) -> list[AlertEvent]:
    records = CASES[case]()
    engine = AlertEngine(AlertRules(), records[0].layers, kinds=["Linear"] * 4)
    return [e for r in records for e in engine.evaluate(r) if not e.silenced]


def rendered(case: str) -> list[str]:
    return [
        f"[{e.rule} {e.severity} step {e.step}] {e.title} | {e.message}" for e in events_of(case)
    ]


EXPECTED: dict[str, list[tuple[str, str]]] = {  # (title, message) of each event, in order
    "nan_made_in_one_layers_backward": [
        (
            "gradtrack: nonfinite in block.0",
            "NaN gradient first at block.0 (backward; model output finite). 5 NaN in 1 layer: "
            "block.0. Try: look at the ops in block.0's backward: an eps or a clamp where a "
            "log, sqrt or division meets 0 or a negative (torch.log(x.clamp_min(1e-8)), "
            "torch.sqrt(x + 1e-8), x / (y + 1e-8)), exp/pow overflow, and under fp16 AMP a "
            "GradScaler (or bf16); then the learning rate (lower it, or clip the gradient "
            "norm).",
        ),
    ],
    "nan_made_in_a_backward_reaching_three_layers": [
        (
            "gradtrack: nonfinite in block.1 and 2 more layers",
            "NaN gradient first at block.1 (backward; model output finite). 10 NaN in 3 layers: "
            "stem, block.0, block.1. Try: look at the ops in block.1's backward: an eps or a "
            "clamp where a log, sqrt or division meets 0 or a negative "
            "(torch.log(x.clamp_min(1e-8)), torch.sqrt(x + 1e-8), x / (y + 1e-8)), exp/pow "
            "overflow, and under fp16 AMP a GradScaler (or bf16); then the learning rate (lower "
            "it, or clip the gradient norm).",
        ),
    ],
    "nan_made_by_the_loss": [
        (
            "gradtrack: nonfinite in 4 layers, made by the loss",
            "NaN gradient made by the loss: the gradient reaching the model output was already "
            "non-finite. 400 NaN in 4 layers: stem, block.0, block.1, head. Try: the loss "
            "produced it (log(0), division by zero, sqrt of 0, targets outside the loss's "
            "range): an eps or a clamp where a log, sqrt or division meets 0 or a negative "
            "(torch.log(x.clamp_min(1e-8)), torch.sqrt(x + 1e-8), x / (y + 1e-8)), exp/pow "
            "overflow, and under fp16 AMP a GradScaler (or bf16); prefer fused losses "
            "(cross_entropy on logits, binary_cross_entropy_with_logits).",
        ),
    ],
    "nan_made_by_the_loss_without_a_replay": [
        (
            "gradtrack: nonfinite in 2 layers, made by the loss",
            "NaN gradient made by the loss: the gradient reaching the model output was already "
            "non-finite. 10 NaN in 2 layers: stem, block.0. Try: the loss produced it (log(0), "
            "division by zero, sqrt of 0, targets outside the loss's range): an eps or a clamp "
            "where a log, sqrt or division meets 0 or a negative (torch.log(x.clamp_min(1e-8)), "
            "torch.sqrt(x + 1e-8), x / (y + 1e-8)), exp/pow overflow, and under fp16 AMP a "
            "GradScaler (or bf16); prefer fused losses (cross_entropy on logits, "
            "binary_cross_entropy_with_logits).",
        ),
    ],
    "inf_made_in_the_forward_pass": [
        (
            "gradtrack: nonfinite in stem",
            "Inf gradient made in the forward pass at stem's output (the model output was "
            "already non-finite). 2 Inf in 1 layer: stem. Try: look at stem's forward: an eps "
            "or a clamp where a log, sqrt or division meets 0 or a negative "
            "(torch.log(x.clamp_min(1e-8)), torch.sqrt(x + 1e-8), x / (y + 1e-8)), exp/pow "
            "overflow, and under fp16 AMP a GradScaler (or bf16); and the input batch for "
            "NaN/Inf.",
        ),
    ],
    "nan_and_inf_from_non_finite_weights": [
        (
            "gradtrack: nonfinite in stem and 3 more layers",
            "NaN gradient because the weights are non-finite: stem, block.0 (2 layers) hold "
            "NaN/Inf since step 10 or earlier. Every forward and backward since is non-finite, "
            "whatever the batch: the run cannot recover by itself. 360 NaN and 10 Inf in 4 "
            "layers: stem, block.0, block.1, head. Try: stop, restore a checkpoint from before "
            "that step, find the first non-finite step (grad/nan_count, grad/inf_count), and "
            "keep bad updates out of the weights: alerts={'nonfinite': {'action': 'raise'}}, "
            "gradient clipping, or a GradScaler (it skips non-finite steps).",
        ),
    ],
    "one_layer_exploding": [
        (
            "gradtrack: exploding in block.0",
            "Gradient norm of block.0 is 5e+03, above 1e+03. Try: a lower learning rate, or "
            "clipping: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=2) (the 90th "
            "percentile of the total norms seen so far).",
        ),
        (
            "gradtrack: exploding in the total gradient norm",
            "Total gradient norm is 5e+03, above 1e+03. Try: a lower learning rate, or "
            "clipping: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=2) (the 90th "
            "percentile of the total norms seen so far).",
        ),
    ],
    "vanishing_for_ten_logged_steps": [
        (
            "gradtrack: jump in stem",
            "Gradient flow breaks between stem and block.0: every Linear layer up to stem has a "
            "gradient RMS of at most 1e-10, 1e+06× below every Linear layer from block.0 (at "
            "least 0.0001). stem is the weak side. Look at what lies between them: a scale far "
            "from 1 (a tiny constant, a near-zero initialisation), a saturating activation, a "
            ".detach(), or a missing residual path or normalisation.",
        ),
        (
            "gradtrack: vanishing in stem",
            "Gradient norm of stem is 1e-09, below 1e-07 for 10 logged steps: it barely learns. "
            "Try: residual connections, normalisation (LayerNorm/BatchNorm), a better "
            "initialisation (Kaiming/Xavier), or non-saturating activations (ReLU/GELU instead "
            "of sigmoid/tanh).",
        ),
    ],
    "one_layer_dead": [
        (
            "gradtrack: dead in block.0",
            "Gradient of block.0 has been exactly zero for 10 logged steps. The flow stops "
            "here: block.1, right after it, still gets gradient, so look at what block.0 feeds "
            "(its activation) first. Likely: dying ReLUs — every unit's input is negative. Try: "
            "LeakyReLU/GELU, a lower learning rate, and a bias initialisation that keeps units "
            "on (zero or slightly positive; a large negative bias switches them off); or an "
            "unintended freeze (a .detach(), torch.no_grad() or requires_grad=False upstream of "
            "this layer).",
        ),
    ],
    "two_layers_dead": [
        (
            "gradtrack: dead in block.0 and 1 more layer",
            "Dead in 2 layers at once; the culprit: gradient of block.0 has been exactly zero "
            "for 10 logged steps. The flow stops here: block.1, right after it, still gets "
            "gradient, so look at what block.0 feeds (its activation) first. Likely: dying "
            "ReLUs — every unit's input is negative. Try: LeakyReLU/GELU, a lower learning "
            "rate, and a bias initialisation that keeps units on (zero or slightly positive; a "
            "large negative bias switches them off); or an unintended freeze (a .detach(), "
            "torch.no_grad() or requires_grad=False upstream of this layer). The others: stem.",
        ),
    ],
    "total_norm_spike": [
        (
            "gradtrack: spike in the total gradient norm",
            "Total gradient norm spiked to 2 at step 50: 4.0x its typical 0.5 over the last 128 "
            "steps, 6.5 standard deviations above (log scale). Gradient-norm spikes come before "
            "loss spikes: a bad batch (look at this step's data), a learning rate too high for "
            "this phase (a longer warmup), or Adam's epsilon too small. Try: clipping, or "
            "alerts={'spike': {'action': 'skip'}} to leave such steps out.",
        ),
    ],
    "one_layer_learns_too_fast": [
        (
            "gradtrack: update_ratio in block.0",
            "Each step moves block.0's weights by 0.3 of their norm, above 0.1, for 3 logged "
            "steps: it learns too fast (healthy layers sit near 1e-3). Try: a lower learning "
            "rate for it (a parameter group), a longer warmup, or clipping.",
        ),
    ],
    "the_learning_rate_far_too_high": [
        (
            "gradtrack: learning_rate in block.1 and 2 more layers",
            "At step 0 one update moved the median layer by 2.5x its weights' norm (most: "
            "block.1, by 5x, then stem, block.0; healthy layers move about 1e-3 of theirs per "
            "step): the learning rate is far too high for the start of training — the weights "
            "are redrawn, not trained (Adam's first steps move every weight by about the "
            "learning rate, whatever the weight's scale: a warmup keeps them small). Try: a "
            "lower learning rate (3-10x lower), a warmup, and gradient clipping "
            "(torch.nn.utils.clip_grad_norm_).",
        ),
    ],
    "a_collapse_after_large_updates": [
        (
            "gradtrack: learning_rate in stem and 1 more layer",
            "Layers stem, block.0 went dead at step 10 (gradient exactly zero; it flowed at "
            "step 0) right after updates of up to 0.05x their weights at steps 0-10 (healthy "
            "layers move about 1e-3 of theirs per step): the learning rate is too high — the "
            "updates overshot and switched units off. The total gradient norm went 2 -> 1.12. "
            "Try: a lower learning rate (3-10x lower), a warmup, and gradient clipping "
            "(torch.nn.utils.clip_grad_norm_). Restart: dead units rarely come back.",
        ),
    ],
    "a_break_between_depths": [
        (
            "gradtrack: jump in block.0",
            "Gradient flow breaks between block.0 and block.1: every Linear layer up to block.0 "
            "has a gradient RMS of at most 1e-07, 1e+06× below every Linear layer from block.1 "
            "(at least 0.1). block.0 is the weak side. Look at what lies between them: a scale "
            "far from 1 (a tiny constant, a near-zero initialisation), a saturating activation, "
            "a .detach(), or a missing residual path or normalisation.",
        ),
    ],
    "gradual_vanishing_along_depth": [
        (
            "gradtrack: flow in blocks.0",
            "Gradient vanishes along depth: the first Linear layers (blocks.0) get 0.0001× the "
            "gradient RMS of the last ones (blocks.3) — across 4 Linear layers, 4.0 decades "
            "lost gradually, for 3 logged steps: the first layers barely learn. Try: "
            "non-saturating activations (ReLU/GELU instead of sigmoid/tanh), residual "
            "connections, normalisation (LayerNorm/BatchNorm), and a variance-preserving "
            "initialisation (Kaiming for ReLU, Xavier for tanh).",
        ),
    ],
    "amp_overflow": [
        (
            "gradtrack: amp",
            "Overflow: step skipped, scale 65536→32768.",
        ),
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_rules_events_read_as_expected(case: str) -> None:
    assert [(e.title, e.message) for e in events_of(case)] == EXPECTED[case]


@pytest.mark.parametrize("case", list(CASES))
def test_every_message_is_a_sentence(case: str) -> None:
    """A capital first, a full stop last; no "(s)" plurals, doubled words, "None", empty
    or unbalanced brackets."""
    for event in events_of(case):
        for text in (event.title, event.message):
            assert "None" not in text and "(s)" not in text, text
            assert not re.search(r"(?<![\w)])\(\)", text), text  # an empty bracket, not a call
            assert text.count("(") == text.count(")"), text
            assert not re.search(r"\b(\w+) \1\b", text), text
        message = event.message
        assert message[0].isupper() and message.endswith("."), message
        assert "  " not in message, message


def test_the_corpus_covers_every_rule() -> None:
    told = {e.rule for case in CASES for e in events_of(case)}
    rules = set(AlertRules.model_fields) - {"layers"}  # per-layer overrides, not a rule
    assert told == rules, rules - told
