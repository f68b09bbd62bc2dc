"""Where two runs' gradient flow first parts: the first step, and the layer that parts first.

Pure numpy on `RunData`. NaN, Inf and exact zero are differences in their own right (the
strongest ones), never dropped; "not logged" is no evidence either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradtrack.report.data import LAYER_FAMILIES, RunData

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
            step, until, ranked[0], int(common[layer_row]), tuple(ranked), family, values,
            KINDS[3 - kind], gap,
        )  # fmt: skip
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
