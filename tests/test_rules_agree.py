"""The per-step rules judged twice — on the training thread by `StepRules` (for ``raise`` and
``skip``, before the optimizer step) and on the worker by the alerts (on the step's record) —
must trip on the same columns: a raise that no alert explains, or an alert a raise rule
ignored, is a user told two different things about one step.

Random steps are drawn (finite norms over eight decades, NaN, Inf, huge norms, zeros, spiking
columns), with per-layer overrides of thresholds, actions and ``enabled``, and both judges
run on each.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradtrack.alerts.engine import AlertEngine
from gradtrack.config.rules import AlertRules
from gradtrack.formats.record import StepRecord
from gradtrack.handoff.rules import PerStepRules, StepRules

LAYERS = ("stem", "block.0", "block.1", "head")
PER_STEP = ("nonfinite", "spike", "exploding")

RULES = {
    "nonfinite": {"action": "raise"},
    "spike": {"action": "raise"},
    "exploding": {"action": "raise", "threshold": 100.0},
    "layers": {
        "head": {"exploding": {"threshold": 1e4}},
        "block.0": {"exploding": {"enabled": False}, "spike": {"enabled": False}},
        "block.1": {"nonfinite": {"action": "warn"}},  # alerted, not raised
    },
}


def draw(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One step: each layer's norm, and which columns (0: the total) the window flagged."""
    kinds = rng.choice(
        ["finite", "nan", "inf", "huge", "zero"], size=len(LAYERS), p=[0.6, 0.08, 0.05, 0.2, 0.07]
    )
    norms = 10.0 ** rng.uniform(-4, 1.9, size=len(LAYERS))
    norms[kinds == "nan"] = np.nan
    norms[kinds == "inf"] = np.inf
    norms[kinds == "huge"] = 10.0 ** rng.uniform(2, 5, size=int((kinds == "huge").sum()))
    norms[kinds == "zero"] = 0.0
    spiking = rng.random(1 + len(LAYERS)) < 0.15
    return norms, spiking


def record(step: int, norms: np.ndarray, spiking: np.ndarray) -> StepRecord:
    nan = np.isnan(norms) * 7.0
    inf = np.isinf(norms) * 3.0
    stats = np.stack(
        [norms, norms, norms / 10, norms / 10, np.full(len(norms), 100.0), nan, inf], axis=1
    )
    with np.errstate(invalid="ignore", over="ignore"):
        total = float(np.sqrt(np.sum(norms**2)))
    columns = 1 + len(LAYERS)
    return StepRecord(
        step,
        0.0,
        LAYERS,
        stats,
        total,
        output_finite=True,
        output_grad_finite=True,
        spike_z=np.full(columns, 7.0),
        spike_typical=np.full(columns, 0.5),
        spiking=spiking,
    )


def raised(
    judge: StepRules, norms: np.ndarray, spiking: np.ndarray, total: float
) -> tuple[str, str | None] | None:
    """The (rule, layer) a raise acts on at this step, as the training thread judges it."""
    columns = np.concatenate([[total], norms])
    spike = np.concatenate([np.full(len(columns), 7.0), np.full(len(columns), 0.5), spiking * 1.0])
    trip = judge.find(bool(np.isfinite(columns).all()), columns, spike)
    if trip is None:
        return None
    return trip.rule, None if trip.rule == "nonfinite" else trip.layer


@pytest.mark.parametrize("seed", range(4))
def test_raise_and_the_alerts_trip_the_same_columns(seed: int) -> None:
    rules = AlertRules(**RULES)  # type: ignore[arg-type]
    judge = StepRules(PerStepRules(rules, LAYERS), "raise")
    rng = np.random.default_rng(seed)
    tripped_any = set()
    watched = np.array([rules.for_layer("spike", c).enabled for c in (None, *LAYERS)])
    for step in range(250):
        norms, spiking = draw(rng)
        spiking &= watched  # (the window never flags a column whose spike rule is off)
        step_record = record(step, norms, spiking)
        engine = AlertEngine(rules, LAYERS, rank=0)  # fresh: no cooldown between draws
        alerted: set[tuple[str, str | None]] = set()
        for event in engine.evaluate(step_record):  # (one event may name several layers)
            if event.rule not in PER_STEP or event.silenced:
                continue
            for layer in {event.layer, *(event.layers or ())}:
                if rules.for_layer(event.rule, layer).action == "raise":
                    alerted.add((event.rule, None if event.rule == "nonfinite" else layer))
        trip = raised(judge, norms, spiking, step_record.total_norm)
        # The training thread raises on the first rule a step trips; the worker alerts on
        # every one: the raise must be among the alerts, and no alert without a raise.
        assert (trip is None) == (not alerted), (step, norms.tolist(), spiking.tolist(), alerted)
        assert trip is None or trip in alerted, (step, norms.tolist(), trip, alerted)
        if trip is not None:
            tripped_any.add(trip[0])
    assert tripped_any == set(PER_STEP)  # every rule was exercised


def test_a_nan_in_a_layer_whose_rule_raises_is_raised_beside_one_whose_rule_warns() -> None:
    """Found by the draws above: the training thread judged a NaN step by its first
    non-finite layer only, so a NaN in ``head`` (raise) beside one in ``block.1`` (warn)
    went on, while the worker's alert named ``head``."""
    rules = AlertRules(
        nonfinite={"action": "raise"}, layers={"block.1": {"nonfinite": {"action": "warn"}}}
    )
    norms, spiking = np.array([1.0, 1.0, np.nan, np.nan]), np.zeros(5, dtype=bool)
    step = record(0, norms, spiking)
    assert raised(
        StepRules(PerStepRules(rules, LAYERS), "raise"), norms, spiking, step.total_norm
    ) == (
        "nonfinite",
        None,
    )
    (event,) = AlertEngine(rules, LAYERS, rank=0).evaluate(step)
    assert event.layer == "head" and rules.for_layer("nonfinite", event.layer).action == "raise"


def test_a_layer_whose_nonfinite_rule_is_off_is_neither_raised_nor_alerted() -> None:
    """``enabled`` per layer reads the same on both threads: a NaN only in a layer whose
    nonfinite rule is off trips nothing; beside a NaN in a watched layer, only that one is
    named (the alert used to read ``enabled`` for the total only)."""
    rules = AlertRules(
        nonfinite={"action": "raise"}, layers={"block.1": {"nonfinite": {"enabled": False}}}
    )
    judge = StepRules(PerStepRules(rules, LAYERS), "raise")
    quiet = np.zeros(5, dtype=bool)
    only_off = np.array([1.0, 1.0, np.nan, 1.0])
    step = record(0, only_off, quiet)
    assert raised(judge, only_off, quiet, step.total_norm) is None
    assert AlertEngine(rules, LAYERS, rank=0).evaluate(step) == []
    both = np.array([1.0, 1.0, np.nan, np.nan])
    step = record(1, both, quiet)
    assert raised(judge, both, quiet, step.total_norm) == ("nonfinite", None)
    (event,) = AlertEngine(rules, LAYERS, rank=0).evaluate(step)
    assert event.rule == "nonfinite" and event.layers == ("head",)
