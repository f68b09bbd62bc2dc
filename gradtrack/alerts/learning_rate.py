"""The ``learning_rate`` rule: the learning rate named as the cause, from the update signals.

Two findings, whichever comes first: a logged step whose median layer moved by more than
``oversized`` × its weights (the weights are redrawn, not trained: no warmup, a rate far too
high), or a collapse — layers going dead right after updates above ``elevated`` × their
weights. A layer goes dead when its gradient, flowing at the last logged step, is now exactly
zero, or when its norm fell `FELL` times below its level of the last logged steps while the
gradient reaching the model output kept more than `OUTPUT_KEPT` of its own: the loss still
sends gradient, the layers stop passing it on (a model that fits its data lowers both
together). Where the output's gradient is not observed, as good as zero (`VANISHED`) beside
a layer that kept its gradient. Either opens the `Incident` that later events of the same run
point to (`Story`, in `gradtrack.alerts.book`).

The ``update_ratio`` rule: with ``update_signals``, layers whose update/weight ratio
‖ΔW‖/‖W‖ says they learn far too fast or barely at all, for ``patience`` logged steps.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from gradtrack.alerts.book import Check, Cooldowns, Incident, RuleBook, Runs, Story, counted, listed
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord

MOST_MOVED = 3  # layers an event names as those that moved most
# A layer goes dead when its gradient norm fell below 1/FELL of its level of the last logged
# steps while the gradient reaching the model output kept more than OUTPUT_KEPT of its own.
FELL = 100.0
OUTPUT_KEPT = 0.1
# Where the output's gradient is not observed: below VANISHED × its level, while another
# layer kept more than KEPT × its own (where every layer fell, the model fits its data).
VANISHED = 1e-6
KEPT = 1e-2
_TRY = (
    "Try: a lower learning rate (3-10x lower), a warmup, and gradient clipping "
    "(torch.nn.utils.clip_grad_norm_)."
)


class LearningRateCheck(Check):
    """Remembers, per layer in depth order, whether its gradient flowed at its last logged
    step, and the update ratios of the last ``lookback`` logged steps."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns, story: Story) -> None:
        super().__init__(book, cooldowns)
        self.story = story
        n = len(book.names)
        self._flowing = np.zeros(n, dtype=bool)
        lookback = book.rules.learning_rate.lookback
        self._ratios: deque[tuple[int, np.ndarray]] = deque(maxlen=lookback)
        # Each layer's gradient norm at the last ``lookback`` logged steps, a row each in
        # turn (-inf: not finite, or no step yet), and the last of those steps.
        self._levels = np.full((lookback, n), -np.inf)
        self._written = 0
        self._last_step = 0
        self._outputs: deque[float] = deque(maxlen=lookback)  # the output gradient's norms
        self._total = math.nan

    def check(self, record: StepRecord, idx: np.ndarray) -> list[AlertEvent]:
        """This step's finding, if any; the state moves on either way."""
        ratios = record.update_ratios()
        norms = np.full(len(self.book.names), np.nan)
        norms[idx] = record.column("norm")
        events: list[AlertEvent] = []
        if ratios is not None:
            full = np.full(len(self.book.names), np.nan)
            full[idx] = np.where(self.book.enabled("learning_rate", idx), ratios, np.nan)
            if self.book.rule("learning_rate", None).enabled:
                events = self._oversized(record, full) or self._collapse(record, norms, full)
            self._ratios.append((record.step, full))
        self._flowing[idx] = np.isfinite(norms[idx]) & (norms[idx] > 0)
        self._levels[self._written % len(self._levels)] = np.where(
            np.isfinite(norms), norms, -np.inf
        )
        self._written += 1
        self._last_step = record.step
        output = record.output_grad_norm
        self._outputs.append(math.nan if output is None else output)
        if math.isfinite(record.total_norm):
            self._total = record.total_norm
        return events

    def _oversized(self, record: StepRecord, ratios: np.ndarray) -> list[AlertEvent]:
        rule = self.book.rule("learning_rate", None)
        known = np.isfinite(ratios).nonzero()[0]
        if len(known) == 0 or ratios[known].max() <= rule.oversized:  # (no median above it)
            return []
        median = float(np.median(ratios[known]))
        if median <= rule.oversized:
            return []
        top = self._most_moved(known, ratios)
        names = [self.book.names[j] for j in top]
        most = f"{names[0]}, by {ratios[top[0]]:.3g}x" + (
            f", then {listed(names[1:])}" if len(names) > 1 else ""
        )
        message = (
            f"at step {record.step} one update moved the median layer by {median:.3g}x its "
            f"weights' norm (most: {most}; healthy layers "
            f"move about 1e-3 of theirs per step): the learning rate is far too high"
            f"{' for the start of training' if len(self._ratios) < 2 else ''} — the weights "
            "are redrawn, not trained (Adam's first steps move every weight by about the "
            f"learning rate, whatever the weight's scale: a warmup keeps them small). {_TRY}"
        )
        return self._emit(
            record, names, float(ratios[top[0]]), rule.oversized, record.step, message
        )

    def _collapse(
        self, record: StepRecord, norms: np.ndarray, ratios: np.ndarray
    ) -> list[AlertEvent]:
        rule = self.book.rule("learning_rate", None)
        if not self._ratios:
            return []
        went_dead = ((norms == 0.0) & self._flowing).nonzero()[0]
        fading, kept = self._fading(norms, record.output_grad_norm)
        if len(went_dead) == 0 and len(fading) == 0:
            return []
        dying = np.union1d(went_dead, fading)
        # The updates before the collapse are its evidence, and so is this step's: the
        # optimizer's state (momentum, Adam's moments) carries the steps that led to it.
        steps = [s for s, _ in self._ratios] + [record.step]
        window = np.stack([r for _, r in self._ratios] + [ratios])
        window = np.where(np.isfinite(window), window, -np.inf)
        moved = window.max(axis=0)
        culprits = dying[moved[dying] > rule.elevated]
        if len(culprits) == 0:
            return []
        top = self._most_moved(culprits, moved)
        names = [self.book.names[j] for j in culprits[np.argsort(-moved[culprits])]]
        large = [s for s, row in zip(steps, window) if (row[culprits] > rule.elevated).any()]
        first, last = large[0], large[-1]
        during = f"step {last}" if first == last else f"steps {first}-{last}"
        message = (
            f"{'Layer' if len(names) == 1 else 'Layers'} {listed(names)} went dead at step "
            f"{record.step} "
            f"({self._how_dead(culprits, went_dead, norms, kept)}) right after updates of up "
            f"to {moved[top[0]]:.3g}x {'its' if len(names) == 1 else 'their'} weights at "
            f"{during} (healthy layers move about 1e-3 of theirs per step): the learning rate "
            "is too high — the updates overshot and switched units off. The total gradient "
            f"norm went {self._total:.3g} -> {record.total_norm:.3g}. {_TRY}"
            + (f" Restart from a checkpoint before step {first}:" if first > 0 else " Restart:")
            + " dead units rarely come back."
        )
        return self._emit(record, names, float(moved[top[0]]), rule.elevated, first, message)

    def _fading(self, norms: np.ndarray, output: float | None) -> tuple[np.ndarray, str | None]:
        """Layers whose gradient fell away while the loss still sends gradient (see the
        module's doc), and what kept its gradient meanwhile, in words."""
        none = np.array([], dtype=np.int64)
        if not self._written:
            return none, None
        recent = self._recent_levels()
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where((recent > 0) & np.isfinite(norms), norms / recent, np.nan)
        if not np.isfinite(share).any():
            return none, None
        outputs = [o for o in self._outputs if math.isfinite(o)]
        if output is not None and math.isfinite(output) and outputs:
            if output < OUTPUT_KEPT * max(outputs):  # the loss sends less: it fits its data
                return none, None
            kept = f"the gradient reaching the model output kept its size ({output:.3g})"
            return ((share <= 1 / FELL) & (norms > 0)).nonzero()[0], kept
        best = int(np.nanargmax(share))
        if share[best] < KEPT:  # every layer fell: a model that fits its data
            return none, None
        kept = f"{self.book.names[best]} kept its gradient"
        return ((share <= VANISHED) & (norms > 0)).nonzero()[0], kept

    def _how_dead(
        self, culprits: np.ndarray, went_dead: np.ndarray, norms: np.ndarray, kept: str | None
    ) -> str:
        previous = self._last_step
        if np.isin(culprits, went_dead).all() or kept is None:
            return f"gradient exactly zero; it flowed at step {previous}"
        lowest = culprits[np.argmin(norms[culprits])]
        return (
            f"gradient norm down to {norms[lowest]:.3g} in {self.book.names[lowest]} from "
            f"{self._recent_levels()[lowest]:.3g} in the last logged steps, while {kept}"
        )

    def _recent_levels(self) -> np.ndarray:
        """Each layer's highest finite gradient norm of the last logged steps (-inf: none)."""
        return self._levels.max(axis=0)

    def _most_moved(self, candidates: np.ndarray, ratios: np.ndarray) -> np.ndarray:
        return candidates[np.argsort(-ratios[candidates])][:MOST_MOVED]

    def _emit(
        self,
        record: StepRecord,
        layers: list[str],
        ratio: float,
        threshold: float,
        since: int,
        message: str,
    ) -> list[AlertEvent]:
        # One incident for the whole model: the cooldown is the model's, not each layer's.
        events = self.cooldowns.emit(
            record,
            "learning_rate",
            None,
            statistic="update_ratio",
            value=ratio,
            threshold=threshold,
            message=message,
        )
        if events and not events[0].silenced:
            self.story.incident = Incident(record.step, tuple(layers[:MOST_MOVED]), ratio, since)
        return [e.model_copy(update={"layer": layers[0], "layers": tuple(layers)}) for e in events]


class UpdateRatioCheck(Check):
    """Counts, per layer, the logged steps in a row its ratio was out of range."""

    def __init__(self, book: RuleBook, cooldowns: Cooldowns) -> None:
        super().__init__(book, cooldowns)
        self._runs = Runs(len(book.names))

    def check(
        self, record: StepRecord, idx: np.ndarray, cause: Incident | None = None
    ) -> list[AlertEvent]:
        """Layers that learn far too fast or barely at all, for ``patience`` logged steps.
        ``cause``: an open learning-rate incident (`gradtrack.alerts.book`), which a slow
        layer's advice must not contradict."""
        ratios = record.update_ratios()
        if ratios is None:
            return []
        active = self.book.enabled("update_ratio", idx) & np.isfinite(ratios)
        high = self.book.param("update_ratio", "high", idx)
        low = self.book.param("update_ratio", "low", idx)
        # A layer without gradient barely moves because nothing drives it: the dead rule's.
        driven = record.column("norm") > 0
        fast, slow = ratios > high, (ratios > 0) & (ratios < low) & driven
        runs = self._runs.advance(idx, active, fast | slow)
        patience = self.book.param("update_ratio", "patience", idx)
        events: list[AlertEvent] = []
        for j in (active & (runs >= patience)).nonzero()[0]:
            layer, ratio = record.layers[j], float(ratios[j])
            limit = float(high[j] if fast[j] else low[j])
            finding = _finding(layer, ratio, limit, int(runs[j]), bool(fast[j]), cause is not None)
            events += self.cooldowns.emit(
                record,
                "update_ratio",
                layer,
                statistic="update_ratio",
                value=ratio,
                threshold=limit,
                message=finding,
            )
        return events


def _finding(layer: str, ratio: float, limit: float, run: int, fast: bool, caused: bool) -> str:
    if fast:
        return (
            f"each step moves {layer}'s weights by {ratio:.3g} of their norm, above "
            f"{limit:.3g}, for {counted(run, 'logged step')}: it learns too fast (healthy "
            "layers sit near 1e-3). Try: a lower learning rate for it (a parameter "
            "group), a longer warmup, or clipping."
        )
    slow = (
        f"each step moves {layer}'s weights by only {ratio:.3g} of their norm, "
        f"below {limit:.3g}, for {counted(run, 'logged step')}: it barely learns "
        "(healthy layers sit near 1e-3)."
    )
    if caused:  # after a too-high learning rate, never advise a higher one
        return slow
    return (
        f"{slow} Try: a higher learning rate for it, a "
        "smaller weight decay, Adam's eps below the gradient's scale, or check it "
        "is not meant to be frozen."
    )
