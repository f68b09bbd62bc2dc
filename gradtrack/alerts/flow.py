"""The ``flow`` rule: gradient that vanishes or explodes gradually along depth — the first
layers of a role get far less (or more) gradient than its last, for ``patience`` steps."""

from __future__ import annotations

import math
import re
from collections import deque

import numpy as np

from gradtrack.alerts.check import Check
from gradtrack.alerts.cooldown import Cooldowns
from gradtrack.alerts.kinds import LayerKinds
from gradtrack.alerts.rulebook import RuleBook
from gradtrack.alerts.wording import counted
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.record import StepRecord

_DIGITS = re.compile(r"\d+")


class FlowCheck(Check):
    """The seed's profile, first layers over last, compared like with like: per *role* —
    a kind of layer at one place in a repeated block (``blocks.#.attn.q``; every layer of
    a plain stack) with at least 3 layers — the geometric-mean gradient RMS of its first
    quarter over its last quarter; the model's ratio is the median role's. Query and key
    projections, small by nature, are so compared only with each other."""

    def __init__(
        self, book: RuleBook, cooldowns: Cooldowns, kinds: LayerKinds, total_norms: deque[float]
    ) -> None:
        super().__init__(book, cooldowns)
        self.kinds = kinds
        self.total_norms = total_norms  # the finite total norms so far, for a clipping norm
        self._run = 0  # logged steps in a row the rule tripped, signed by direction

    def check(self, record: StepRecord, broken: set[str | None]) -> list[AlertEvent]:
        """``broken``: the kinds the jump rule found a break in at this step (its finding)."""
        rule = self.book.rule("flow", None)
        comparable = self.kinds.comparable(record)
        if not rule.enabled or not comparable:
            return []
        median = _median_role(record, comparable)
        if median is None:
            self._run = 0
            return []
        log_ratio, kind, rows = median
        ratio = float(np.exp(log_ratio))
        direction = -1 if ratio < 1 / rule.ratio else 1 if ratio > rule.ratio else 0
        if direction == 0 or kind in broken:  # a break is the jump rule's finding
            self._run = 0
            return []
        same = self._run * direction > 0
        self._run = self._run + direction if same else direction
        if abs(self._run) < rule.patience:
            return []
        names = [record.layers[j] for j in rows]  # first: the starving (or flooded) end
        return self.cooldowns.emit(
            record, "flow", names[0], statistic="flow_ratio", value=ratio,
            threshold=1 / rule.ratio if direction < 0 else rule.ratio,
            message=self._message(kind, names, ratio, direction),
        )  # fmt: skip

    def _message(self, kind: str, names: list[str], ratio: float, direction: int) -> str:
        quarter = max(1, len(names) // 4)
        first_names, last_names = ", ".join(names[:quarter]), ", ".join(names[-quarter:])
        decades = abs(math.log10(ratio))
        span = f"across {len(names)} {kind} layers, {decades:.1f} decades"
        if direction < 0:
            return (
                f"gradient vanishes along depth: the first {kind} layers ({first_names}) get "
                f"{ratio:.3g}× the gradient RMS of the last ones ({last_names}) — {span} lost "
                f"gradually, for {counted(abs(self._run), 'logged step')}: the first layers barely "
                "learn. Try: non-saturating activations (ReLU/GELU instead of sigmoid/tanh), "
                "residual connections, normalisation (LayerNorm/BatchNorm), and a "
                "variance-preserving initialisation (Kaiming for ReLU, Xavier for tanh)."
            )
        history = list(self.total_norms)
        clip = float(np.percentile(history, 50)) if history else 1.0
        return (
            f"gradient explodes along depth: the first {kind} layers ({first_names}) get "
            f"{ratio:.3g}× the gradient RMS of the last ones ({last_names}) — {span} "
            f"gained, for {counted(abs(self._run), 'logged step')}. Try: clipping, "
            f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={clip:.2g}) (the "
            "median total norm so far), a lower learning rate, normalisation "
            "(LayerNorm/BatchNorm), or a smaller initialisation."
        )


def _median_role(
    record: StepRecord, comparable: dict[str, np.ndarray]
) -> tuple[float, str, list[int]] | None:
    """The median role's log ratio of first to last quarter, its kind and rows (depth order);
    None if no role has 3 layers."""
    rms = record.column("rms")
    roles: dict[tuple[str, str], list[int]] = {}
    for kind, kind_rows in comparable.items():
        for j in kind_rows:
            role = (kind, _DIGITS.sub("#", record.layers[j]))
            roles.setdefault(role, []).append(int(j))
    profiles = []  # (log ratio, kind, rows in depth order)
    for (kind, _), role_rows in roles.items():
        if len(role_rows) >= 3:
            quarter = max(1, len(role_rows) // 4)
            head, tail = rms[role_rows[:quarter]], rms[role_rows[-quarter:]]
            profiles.append((np.log(head).mean() - np.log(tail).mean(), kind, role_rows))
    if not profiles:
        return None
    profiles.sort(key=lambda profile: profile[0])
    return profiles[(len(profiles) - 1) // 2]  # the median role
