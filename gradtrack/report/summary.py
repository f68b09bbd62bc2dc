"""The comparison in brief: a JSON-ready dict (``gradtrack compare --json``) and its sentences.

Both come from one `Summary`, so the HTML report's words and the JSON never disagree.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from gradtrack.report.compare import LayerDifference, rank_layers
from gradtrack.report.data import RunData
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
    """The summary in words, one sentence per finding: non-finite runs, then pairs."""
    lines = []
    for run in summary.runs:
        found = run.first_nonfinite()
        if found is not None:
            where = f" (first in {found[1]})" if found[1] else ""
            lines.append(f"{run.name}: first non-finite gradient at step {found[0]}{where}.")
    for i, j, d in summary.pairs:
        lines.append(_pair_text(summary.runs[i], summary.runs[j], d))
    return lines


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
        "first_nonfinite": None if found is None else found[0],
        "first_nonfinite_layer": None if found is None else found[1],
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
