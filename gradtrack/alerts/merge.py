"""One event per rule for the layers that tripped it together, led by the culprit.

A deep model whose gradient vanishes trips the rule in hundreds of layers at once; that is
one finding, and a tracker that notifies per alert must see it once.
"""

from __future__ import annotations

from gradtrack.alerts.rulebook import RuleBook
from gradtrack.alerts.wording import listed
from gradtrack.formats.event import AlertEvent


def merge_layers(events: list[AlertEvent], book: RuleBook) -> list[AlertEvent]:
    """One event per rule (and severity, action) for the layers that tripped together, in
    the order each group first appears; non-finite and whole-model events stay apart."""
    slots: dict[tuple[str, str, str, str], int] = {}  # group → its place in the output
    groups: list[list[AlertEvent]] = []
    for event in events:
        if event.rule == "nonfinite" or event.layer is None:
            groups.append([event])
            continue
        action = book.rule(event.rule, event.layer).action
        key = (event.rule, event.severity, action, str(event.silenced))
        if key not in slots:
            slots[key] = len(groups)
            groups.append([])
        groups[slots[key]].append(event)
    return [group[0] if len(group) == 1 else _merged(group, book.depth) for group in groups]


def _merged(group: list[AlertEvent], depth: dict[str, int]) -> AlertEvent:
    """The events of one rule at one step as one, led by the culprit: for ``dead``, the
    deepest dead layer whose next layer still gets gradient (where the flow stops); for
    ``jump``, the weak side of the largest break; otherwise the layer furthest past its
    threshold (per-layer overrides may set different ones)."""

    def past_threshold(event: AlertEvent) -> float:
        return event.value / event.threshold if event.threshold else event.value

    if group[0].rule == "dead":
        stops = [e for e in group if "The flow stops here" in e.message] or group
        worst = max(stops, key=lambda e: depth.get(e.layer or "", -1))
    else:
        worst = (min if group[0].rule == "vanishing" else max)(group, key=past_threshold)
    layers = tuple(e.layer for e in group if e.layer is not None)
    others = [name for name in layers if name != worst.layer]
    lead = "the culprit" if group[0].rule in ("dead", "jump") else "the worst"
    message = (
        f"{worst.rule} in {len(layers)} layers at once; {lead}: {worst.message} "
        f"The others: {listed(others)}."
    )
    return worst.model_copy(update={"layers": layers, "message": message})
