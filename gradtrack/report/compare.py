"""Comparing runs (numpy on `RunData`): where two runs' gradient flow first parts
(`first_divergence`: the first step, and the layer that parts first), which layers differ
most and how early (`rank_layers`), and the comparison in brief (`Summary`): a JSON-ready
dict (``gradtrack compare --json``) and its sentences.

NaN, Inf and exact zero are differences in their own right (the strongest ones), never
dropped nor averaged away; "not logged" is no evidence either way. The JSON and the HTML
report's words both come from one `Summary`, so they never disagree.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from gradtrack.formats.flight import FlightWindow
from gradtrack.report.data import LAYER_FAMILIES, FirstNonFinite, RunData, common_layer_steps

# Float32 reductions in another order move a norm by ~1e-7..1e-6 relative; a change in what
# training does moves it far more. 1e-4 separates the two; parity checks use 0 (exact).
DEFAULT_RTOL = 1e-4
# Kinds of difference, strongest first: one run non-finite where the other is not (or the
# other non-finite kind), one exactly zero where the other is not, then plain values.
KINDS = ("nonfinite", "zero", "value")
SEVERITY = {"nonfinite": 3, "zero": 2, "value": 1}


@dataclass(frozen=True)
class Divergence:
    """Where runs ``a`` and ``b`` part.

    ``step`` is the first step at which anything differs (a layer statistic, or the total
    norm); ``layer`` the layer that differs most at ``layer_step``, the first step at which
    any layer differs (``step`` itself unless only the total norm was logged there).
    """

    step: int
    identical_until: int | None  # the last step compared before ``step`` (all equal there)
    layer: str | None
    layer_step: int | None
    layers: tuple[str, ...]  # every layer parting at ``layer_step``, most different first
    statistic: str  # the metric family that parts (grad_norm, …; grad/total_norm)
    values: tuple[float, float]  # a's and b's value of it
    kind: str  # one of KINDS
    decades: float  # |log10 a - log10 b| (inf for a non-finite or zero difference)

    def describe(self, a: str, b: str) -> str:
        """One sentence: "identical up to step N, then layer L"."""
        before = (
            f"identical up to step {self.identical_until}"
            if self.identical_until is not None
            else "different from their first common step"
        )
        what = {"nonfinite": "non-finite in one", "zero": "exactly zero in one"}.get(
            self.kind, f"{self.decades:.2g} decades apart"
        )
        where = f"layer {self.layer}" if self.layer is not None else "the total norm"
        text = f"{a} and {b} are {before}, then part at step {self.step} in {where}"
        if self.layer is not None and self.layer_step != self.step:
            text += f" (total norm at step {self.step}; layers first at step {self.layer_step})"
        va, vb = (_fmt(v) for v in self.values)
        return f"{text}: {self.statistic} {va} vs {vb} ({what})."


def parts(a: np.ndarray, b: np.ndarray, rtol: float) -> np.ndarray:
    """Where values ``a`` and ``b`` differ beyond relative tolerance ``rtol``.

    NaN equals NaN and an Inf equals the same Inf (both runs broke the same way); a finite
    value against a non-finite one always differs, as does zero against non-zero.

    >>> a, b = np.array([1.0, 1.0, np.nan, 0.0, np.inf]), np.array([1.0, 1.1, np.nan, 1e-30, 5])
    >>> parts(a, b, rtol=0.01)
    array([False,  True, False,  True,  True])
    """
    with np.errstate(invalid="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        finite = np.isfinite(a) & np.isfinite(b)
        close = np.abs(a - b) <= rtol * np.maximum(np.abs(a), np.abs(b))
    zero_mismatch = (a == 0) != (b == 0)
    return ~same & ~(finite & close & ~zero_mismatch)


def kind_of(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The kind of each difference: 3 non-finite, 2 zero, 1 value (see `SEVERITY`)."""
    nonfinite = ~np.isfinite(a) | ~np.isfinite(b)
    zero = (a == 0) | (b == 0)
    return np.where(nonfinite, 3, np.where(zero, 2, 1))


def decades(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|log10 a - log10 b|: inf where either is zero or non-finite."""
    with np.errstate(all="ignore"):
        gap = np.abs(np.log10(np.abs(a)) - np.log10(np.abs(b)))
    return np.where(np.isfinite(a) & np.isfinite(b) & (a != 0) & (b != 0), gap, np.inf)


def first_divergence(a: RunData, b: RunData, rtol: float = DEFAULT_RTOL) -> Divergence | None:
    """The first step at which ``a`` and ``b`` part, or None if they agree wherever both
    logged the same statistic. Steps where only one run logged are not compared.

    >>> steps, layers = np.array([0, 10, 20]), ["x", "y"]
    >>> norms = np.array([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])
    >>> a = RunData("a", "", steps, layers, {"grad_norm": norms}, np.ones(3))
    >>> nudged = norms.copy(); nudged[1:, 1] = 3.0
    >>> b = RunData("b", "", steps, layers, {"grad_norm": nudged}, np.ones(3))
    >>> d = first_divergence(a, b)
    >>> d.step, d.layer, d.identical_until, d.values
    (10, 'y', 0, (2.0, 3.0))
    >>> first_divergence(a, a) is None
    True
    """
    common, rows_a, rows_b = np.intersect1d(a.steps, b.steps, return_indices=True)
    total = _first_total_part(a, b, rows_a, rows_b, rtol)
    layer_hit = _first_layer_part(a, b, rows_a, rows_b, rtol)
    if total is None and layer_hit is None:
        return None
    layer_row = layer_hit[0] if layer_hit is not None else None
    candidates = [r for r in (total, layer_row) if r is not None]
    row = min(candidates)
    step = int(common[row])
    compared = _compared_rows(a, b, rows_a, rows_b)
    earlier = compared[compared < row]
    until = int(common[earlier[-1]]) if len(earlier) else None
    if layer_hit is not None:
        layer_row, ranked, family, values, kind, gap = layer_hit
        return Divergence(
            step,
            until,
            ranked[0],
            int(common[layer_row]),
            tuple(ranked),
            family,
            values,
            KINDS[3 - kind],
            gap,
        )
    assert total is not None
    va, vb = float(a.total_norm[rows_a[total]]), float(b.total_norm[rows_b[total]])
    kind = int(kind_of(np.array(va), np.array(vb)))
    gap = float(decades(np.array(va), np.array(vb)))
    return Divergence(
        step, until, None, None, (), "grad/total_norm", (va, vb), KINDS[3 - kind], gap
    )


def _first_total_part(
    a: RunData, b: RunData, rows_a: np.ndarray, rows_b: np.ndarray, rtol: float
) -> int | None:
    both = a.total_logged_mask()[rows_a] & b.total_logged_mask()[rows_b]
    hit = both & parts(a.total_norm[rows_a], b.total_norm[rows_b], rtol)
    return int(np.argmax(hit)) if hit.any() else None


def _first_layer_part(
    a: RunData, b: RunData, rows_a: np.ndarray, rows_b: np.ndarray, rtol: float
) -> tuple[int, list[str], str, tuple[float, float], int, float] | None:
    """(row in the common steps, parting layers most different first, family, values,
    severity, decades) at the first common step where a layer parts."""
    layers = [layer for layer in a.layers if layer in b.layers]
    if not layers or not len(rows_a):
        return None
    cols_a = np.array([a.layers.index(layer) for layer in layers])
    cols_b = np.array([b.layers.index(layer) for layer in layers])
    families = [f for f in LAYER_FAMILIES if f in a.stats and f in b.stats]
    hits = []
    for family in families:
        va = a.stats[family][np.ix_(rows_a, cols_a)]
        vb = b.stats[family][np.ix_(rows_b, cols_b)]
        both = (
            a.logged_mask(family)[np.ix_(rows_a, cols_a)]
            & b.logged_mask(family)[np.ix_(rows_b, cols_b)]
        )
        hits.append((family, va, vb, both & parts(va, vb, rtol)))
    any_hit = np.logical_or.reduce([hit for *_, hit in hits])
    rows = np.flatnonzero(any_hit.any(axis=1))
    if not len(rows):
        return None
    row = int(rows[0])
    # Per layer at that step, its strongest difference over the families; family order
    # breaks ties, the norm first (a layer scaled as a whole moves every statistic by the
    # same factor, up to float32 rounding: gaps within 1e-6 decades are alike).
    best: dict[int, tuple[int, float, str, float, float]] = {}
    for family, va, vb, hit in hits:
        for j in np.flatnonzero(hit[row]).tolist():
            x, y = va[row, j], vb[row, j]
            score = (int(kind_of(x, y)), float(decades(x, y)), family, float(x), float(y))
            if j not in best or _stronger(score[:2], best[j][:2]):
                best[j] = score
    order = sorted(best, key=lambda j: (-best[j][0], -best[j][1], j))
    severity, gap, family, x, y = best[order[0]]
    return row, [layers[j] for j in order], family, (x, y), severity, gap


def _stronger(score: tuple[int, float], than: tuple[int, float]) -> bool:
    """(severity, decades) clearly above ``than``: a stronger kind, or 1e-6 decades more."""
    return score[0] > than[0] or (score[0] == than[0] and score[1] > than[1] + 1e-6)


def _compared_rows(a: RunData, b: RunData, rows_a: np.ndarray, rows_b: np.ndarray) -> np.ndarray:
    """Rows of the common steps where both runs logged something comparable."""
    both = a.total_logged_mask()[rows_a] & b.total_logged_mask()[rows_b]
    layers = [layer for layer in a.layers if layer in b.layers]
    if layers:
        cols_a = np.array([a.layers.index(layer) for layer in layers])
        cols_b = np.array([b.layers.index(layer) for layer in layers])
        for family in (f for f in LAYER_FAMILIES if f in a.stats and f in b.stats):
            la = a.logged_mask(family)[np.ix_(rows_a, cols_a)]
            lb = b.logged_mask(family)[np.ix_(rows_b, cols_b)]
            both |= (la & lb).any(axis=1)
    return np.flatnonzero(both)


def _fmt(value: float) -> str:
    return f"{value:.4g}" if np.isfinite(value) else str(value)


@dataclass(frozen=True)
class LayerDifference:
    layer: str
    mean_log10_norm: tuple[float, ...]  # per run, over the finite non-zero norms of the steps
    spread: float  # mean over those steps of (max - min) finite log10 norm across runs
    first_step: int | None = None  # the first step at which the runs part in this layer
    kind: str | None = None  # the strongest difference seen: one of KINDS, None if never

    @property
    def rank_key(self) -> tuple[int, float, float]:
        """Strongest kind first, then earliest, then largest spread."""
        severity = 3 - KINDS.index(self.kind) if self.kind else 0
        first = math.inf if self.first_step is None else self.first_step
        spread = -np.inf if math.isnan(self.spread) else self.spread
        return (-severity, first, -spread)


def rank_layers(runs: list[RunData], rtol: float = DEFAULT_RTOL) -> list[LayerDifference]:
    """Layers present in every run, most different first: a layer that is non-finite (or
    exactly zero) in one run and not in another comes before any finite difference, then
    the earlier parting, then the larger spread in decades.

    With one run, the layers compared are the run's own: non-finite or zero layers first,
    then the distance below the run's strongest layer (the weakest gradient flow first).

    >>> steps, layers = np.array([0, 1]), ["x", "y", "z"]
    >>> ones, broken = np.ones((2, 3)), np.array([[1e-6, 1, 1], [1e-6, 1, np.nan]])
    >>> a = RunData("a", "", steps, layers, {"grad_norm": ones}, steps)
    >>> b = RunData("b", "", steps, layers, {"grad_norm": broken}, steps,
    ...             logged={"grad_norm": ones > 0})  # logged everywhere: z's NaN is a NaN gradient
    >>> [(d.layer, d.kind, d.first_step, round(d.spread, 3)) for d in rank_layers([a, b])]
    [('z', 'nonfinite', 1, 0.0), ('x', 'value', 0, 6.0), ('y', None, None, 0.0)]
    """
    layers = [layer for layer in runs[0].layers if all(layer in run.layers for run in runs)]
    steps = np.array(common_layer_steps(runs), dtype=np.int64)
    norms = np.stack([_norms(run, layers, steps) for run in runs])  # [runs, steps, layers]
    with np.errstate(all="ignore"):
        logs = np.log10(np.abs(norms))
    logs[~np.isfinite(logs)] = np.nan
    means = _nanmean(logs, axis=1)  # [runs, layers]
    if len(runs) > 1:
        spread = _nanmean(np.fmax.reduce(logs, axis=0) - np.fmin.reduce(logs, axis=0), axis=0)
    else:
        spread = np.fmax.reduce(means[0]) - means[0] if means.size else means[0]
    if len(runs) > 1:
        reference = norms[0]
        differ = np.stack([parts(reference, other, rtol) for other in norms[1:]])
        kinds = np.stack([kind_of(reference, other) for other in norms[1:]])
        severity = np.where(differ, kinds, 0).max(axis=0)  # [steps, layers]
    else:
        own = norms[0]
        severity = np.where(~np.isfinite(own), 3, np.where(own == 0, 2, 0))
    severity = np.where(_all_logged(runs, layers, steps), severity, 0)  # no evidence: no gap
    ranked = []
    for j, layer in enumerate(layers):
        column = severity[:, j]
        hit = np.flatnonzero(column)
        ranked.append(
            LayerDifference(
                layer,
                tuple(float(m) for m in means[:, j]),
                float(spread[j]),
                int(steps[hit[0]]) if len(hit) else None,
                KINDS[3 - int(column.max())] if len(hit) else None,
            )
        )
    return sorted(ranked, key=lambda d: d.rank_key)


def _nanmean(values: np.ndarray, axis: int) -> np.ndarray:
    """Mean of the non-NaN values; NaN where there are none. Unlike ``np.nanmean`` it warns
    of nothing, and so needs no warnings filter (not thread-safe: sinks draw on their own
    threads)."""
    present = ~np.isnan(values)
    count = present.sum(axis=axis)
    total = np.where(present, values, 0.0).sum(axis=axis)
    with np.errstate(all="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _norms(run: RunData, layers: list[str], steps: np.ndarray) -> np.ndarray:
    """[steps, layers] norms; NaN where the norm was NaN or not logged (see `_all_logged`)."""
    rows = np.searchsorted(run.steps, steps)
    cols = np.array([run.layers.index(layer) for layer in layers], dtype=np.int64)
    return run.norms[np.ix_(rows, cols)] if len(cols) else np.empty((len(steps), 0))


def _all_logged(runs: list[RunData], layers: list[str], steps: np.ndarray) -> np.ndarray:
    """[steps, layers]: every run logged the norm there (a NaN norm then is a NaN gradient)."""
    mask = np.ones((len(steps), len(layers)), dtype=bool)
    for run in runs:
        rows = np.searchsorted(run.steps, steps)
        cols = np.array([run.layers.index(layer) for layer in layers], dtype=np.int64)
        if len(cols):
            mask &= run.logged_mask("grad_norm")[np.ix_(rows, cols)]
    return mask


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
