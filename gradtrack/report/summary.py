"""The comparison in brief: a JSON-ready dict (``gradtrack compare --json``) and its sentences.

Both come from one `Summary`, so the HTML report's words and the JSON never disagree.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

from gradtrack.formats.flight import FlightWindow
from gradtrack.report.compare import LayerDifference, rank_layers
from gradtrack.report.data import FirstNonFinite, RunData
from gradtrack.report.divergence import DEFAULT_RTOL, Divergence, first_divergence


@dataclass(frozen=True)
class Summary:
    runs: list[RunData]
    rtol: float
    pairs: list[tuple[int, int, Divergence | None]]
    ranking: list[LayerDifference]

    def divergence_from_first(self) -> list[Divergence | None]:
        """Each run's first divergence from the first run (None for the first run itself)."""
        found = {b: d for a, b, d in self.pairs if a == 0}
        return [None, *(found.get(i) for i in range(1, len(self.runs)))]


def summarise(runs: list[RunData], rtol: float = DEFAULT_RTOL) -> Summary:
    pairs = [(i, j, first_divergence(runs[i], runs[j], rtol)) for i, j in _pairs(len(runs))]
    return Summary(runs, rtol, pairs, rank_layers(runs, rtol))


def _pairs(count: int) -> list[tuple[int, int]]:
    return list(combinations(range(count), 2))


def to_json(summary: Summary, top: int | None = None) -> dict[str, Any]:
    """Plain types only; a non-finite number is written as the string "NaN", "Infinity" or
    "-Infinity" (strict JSON has no such numbers)."""
    runs = summary.runs
    return {
        "rtol": summary.rtol,
        "findings": sentences(summary),
        "runs": [_run_json(run) for run in runs],
        "pairs": [
            {
                "a": _ref(runs[i]),
                "b": _ref(runs[j]),
                "first_divergence": None if d is None else _divergence_json(d),
                "text": _pair_text(runs[i], runs[j], d),
            }
            for i, j, d in summary.pairs
        ],
        "ranking": [
            {
                "layer": d.layer,
                "kind": d.kind,
                "first_step": d.first_step,
                "spread_decades": _number(d.spread),
                "mean_log10_norm": [_number(m) for m in d.mean_log10_norm],
            }
            for d in summary.ranking[:top]
        ],
    }


def sentences(summary: Summary) -> list[str]:
    """The summary in words, one sentence per finding: each run's incidents (the flight
    recorder's windows, with their first movers) and first non-finite step; for one run its
    weakest layer, for several the pairs."""
    lines = []
    for run in summary.runs:
        lines += [window_sentence(run.name, window) for window in run.windows]
        found = run.first_nonfinite()
        if found is not None:
            lines.append(nonfinite_sentence(run.name, found))
    if len(summary.runs) == 1:
        lines += _weakest_text(summary)
    for i, j, d in summary.pairs:
        lines.append(_pair_text(summary.runs[i], summary.runs[j], d))
    return lines


def nonfinite_sentence(name: str, found: FirstNonFinite) -> str:
    """A run's first non-finite step, where its event says it came from.

    >>> nonfinite_sentence("run", FirstNonFinite(517, None, "loss"))
    'run: first non-finite gradient at step 517, made by the loss (no layer made it).'
    >>> nonfinite_sentence("run", FirstNonFinite(9, "fc", "backward"))
    'run: first non-finite gradient at step 9 (first in fc).'
    """
    where = {
        "loss": ", made by the loss (no layer made it)",
        "weights": ", the weights already non-finite",
        "forward": " in the forward pass" + (f", at {found.layer}'s output" if found.layer else ""),
    }.get(found.stage or "", f" (first in {found.layer})" if found.layer else "")
    return f"{name}: first non-finite gradient at step {found.step}{where}."


def terminal_summary(summary: Summary, report: Path) -> str:
    """What ``gradtrack report`` and ``compare`` print: each finding on a line of its own,
    then the page that draws them (as a test runner ends with its summary).

    >>> print(terminal_summary(Summary([], 1e-6, [], []), Path("out/report.html")))
    no findings: nothing non-finite, no incident, no divergence.
    report: out/report.html
    """
    found = sentences(summary)
    lines = [f"  {s}" for s in found] or [
        "no findings: nothing non-finite, no incident, no divergence."
    ]
    if found:
        lines.insert(0, f"{len(found)} finding{'s' if len(found) > 1 else ''}:")
    return "\n".join([*lines, f"report: {report}"])


def window_sentence(name: str, window: FlightWindow) -> str:
    """One incident the flight recorder kept, and its first mover.

    >>> import numpy as np
    >>> w = FlightWindow("nonfinite", 517, ("a",), np.arange(261, 518), np.ones((257, 1)))
    >>> window_sentence("run", w)[:61]
    "run: nonfinite at step 517, every layer's norm kept for steps"
    """
    steps = f"steps {window.steps[0]}–{window.steps[-1]}" if len(window.steps) else "no step"
    mover = window.message or "no layer left its range before it."
    return (
        f"{name}: {window.incident} at step {window.incident_step}, every layer's norm kept for "
        f"{steps}; {mover}"
    )


def _weakest_text(summary: Summary) -> list[str]:
    """One run: its weakest layer, and how far below the strongest it sits on average."""
    run = summary.runs[0]
    finite = [d for d in summary.ranking if math.isfinite(d.spread) and d.mean_log10_norm]
    if len(finite) < 2:
        return []
    weakest = max(finite, key=lambda d: d.spread)
    strongest = min(finite, key=lambda d: d.spread)
    return [
        f"{run.name}: the weakest layer is {weakest.layer}, {weakest.spread:.1f} decades "
        f"(×{10**weakest.spread:.3g}) below the strongest, {strongest.layer} (mean log10 "
        "gradient norm over the steps that logged every layer)."
    ]


def _pair_text(a: RunData, b: RunData, divergence: Divergence | None) -> str:
    if divergence is not None:
        return divergence.describe(a.name, b.name)
    return f"{a.name} and {b.name} never part: equal wherever both logged the same statistic."


def _ref(run: RunData) -> dict[str, str]:
    return {"id": run.run_id, "name": run.name}


def _run_json(run: RunData) -> dict[str, Any]:
    found = run.first_nonfinite()
    per_layer = run.per_layer_steps()
    return {
        "id": run.run_id,
        "name": run.name,
        "source": run.source,
        "steps": {
            "logged": len(run.steps),
            "first": int(run.steps[0]) if len(run.steps) else None,
            "last": int(run.steps[-1]) if len(run.steps) else None,
            "per_layer": len(per_layer),
        },
        "layers": len(run.layers),
        "first_nonfinite": None if found is None else found.step,
        "first_nonfinite_layer": None if found is None else found.layer,
        "first_nonfinite_stage": None if found is None else found.stage,
        "flight_windows": [
            {
                "incident": w.incident,
                "incident_step": w.incident_step,
                "steps": [int(w.steps[0]), int(w.steps[-1])] if len(w.steps) else None,
                "first_mover": w.first_mover,
                "first_mover_step": w.first_mover_step,
            }
            for w in run.windows
        ],
        "alerts": {
            "total": len(run.alerts),
            "by_rule": dict(Counter(a.rule for a in run.alerts)),
            "by_severity": dict(Counter(a.severity for a in run.alerts)),
        },
    }


def _divergence_json(d: Divergence) -> dict[str, Any]:
    return {
        "step": d.step,
        "layer": d.layer,
        "layer_step": d.layer_step,
        "layers": list(d.layers),
        "identical_until": d.identical_until,
        "statistic": d.statistic,
        "values": [_number(v) for v in d.values],
        "kind": d.kind,
        "decades": _number(d.decades),
    }


def _number(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value
