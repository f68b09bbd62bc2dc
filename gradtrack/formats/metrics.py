"""Metric keys, and what every sink writes as metrics: a step's (`scalar_metrics`) and a
flight recorder window's ``grad_norm/<layer>`` series (`window_series`).

Every sink names metrics this way, and every reader looks them up the same way, so runs line
up across backends: the families a step's metrics use, and how a key is built from a name.
"""

from __future__ import annotations

import math
import re

from gradtrack.formats.flight import FlightWindow
from gradtrack.formats.record import ABS_STATS, StepRecord

TOTAL_NORM_KEY = "grad/total_norm"
# Every family a step's metrics use (the first key segment: a W&B panel section).
FAMILIES = (
    "grad",
    "grad_norm",
    "grad_max",
    "grad_mean_abs",
    "grad_rms",
    "grad_nan",
    "grad_inf",
    "act_grad_norm",
    "param_norm",
    "update_norm",
    "update_ratio",
    "grad_noise_scale",
)
# Metric family per statistic; NaN/Inf families appear only where the count is non-zero.
LAYER_KEY_PREFIX = {
    "norm": "grad_norm",
    "max_abs": "grad_max",
    "mean_abs": "grad_mean_abs",
    "rms": "grad_rms",
}
NONFINITE_KEY_PREFIX = {"nan": "grad_nan", "inf": "grad_inf"}
ACTIVATION_KEY_PREFIX = "act_grad_norm"
# With ``distributed.gather_ranks``: grad_norm_rank<r>/<layer>, rank r's local gradient.
RANK_KEY_PREFIX = "grad_norm_rank"
# With an optimizer (``update_signals``): ‖W‖, ‖ΔW‖ of the applied update, their ratio.
UPDATE_KEY_PREFIX = {"param": "param_norm", "update": "update_norm", "ratio": "update_ratio"}

# With ``noise_scale.per_layer``: grad_noise_scale/<layer>, each layer's B_simple.
NOISE_SCALE_KEY_PREFIX = "grad_noise_scale"

_UNSAFE_KEY_CHARS = re.compile(r"[^\w.\- :/]")


def safe_key(key: str) -> str:
    """A metric key every backend accepts, mapped the same way everywhere.

    Characters outside ``[A-Za-z0-9_.- :/]`` become ``_``, as do the path forms MLflow
    refuses (``//``, ``./``, ``..``, a leading or trailing ``/``); keys stay ≤ 250 chars.

    >>> safe_key("grad_norm/blocks[0].attn@x")
    'grad_norm/blocks_0_.attn_x'
    >>> safe_key("grad_norm/a//b/../c/")
    'grad_norm/a/_b/._/c_'
    """
    key = _UNSAFE_KEY_CHARS.sub("_", key)
    key = key.replace("//", "/_").replace("./", "_/").replace("..", "_.")
    if key.startswith("/"):
        key = "_" + key[1:]
    if key.endswith("/"):
        key = key[:-1] + "_"
    return key[:250]


def metric_key(family: str, name: str, model_name: str | None = None) -> str:
    """``family/name``, or ``family/model_name/name`` when several models share a run."""
    return safe_key(f"{family}/{model_name}/{name}" if model_name else f"{family}/{name}")


def scalar_metrics(record: StepRecord) -> dict[str, float]:
    """The record as flat ``{key: value}`` metrics, with the keys every sink uses.

    >>> import numpy as np
    >>> stats = np.array([[5.0, 4.0, 3.5, 3.54, 2, 0, 0]])
    >>> for key in sorted(scalar_metrics(StepRecord(0, 0.0, ("fc",), stats, 5.0))):
    ...     print(key)
    grad/inf_count
    grad/max_layer_norm
    grad/min_layer_norm
    grad/nan_count
    grad/total_norm
    grad_max/fc
    grad_mean_abs/fc
    grad_norm/fc
    grad_rms/fc
    >>> sorted(scalar_metrics(StepRecord(0, 0.0, ("fc",), stats, 5.0, layer_detail="none")))[-1]
    'grad/total_norm'
    """
    if record.window_only:
        return {}
    model = record.model_name
    metrics = {metric_key("grad", "total_norm", model): record.total_norm}
    if record.counted:
        metrics[metric_key("grad", "nan_count", model)] = float(record.nan_count)
        metrics[metric_key("grad", "inf_count", model)] = float(record.inf_count)
    if record.dropped_steps:
        metrics[metric_key("gradtrack", "dropped", model)] = float(record.dropped_steps)
    if record.skipped_steps:
        metrics[metric_key("grad", "skipped", model)] = float(record.skipped_steps)
    metrics.update(_noise_scale(record))
    extremes = record.extreme_layers()
    if extremes is not None:
        metrics[metric_key("grad", "min_layer_norm", model)] = extremes[0][1]
        metrics[metric_key("grad", "max_layer_norm", model)] = extremes[1][1]
    for stat, prefix in NONFINITE_KEY_PREFIX.items():
        for layer, value in zip(record.layers, record.column(stat).tolist()):
            if value:
                metrics[metric_key(prefix, layer, model)] = value
    if not record.per_layer:
        return metrics
    for stat in record.layer_metrics:
        if stat in ABS_STATS and not record.abs_stats:
            continue
        prefix = LAYER_KEY_PREFIX[stat]
        for layer, value in zip(record.layers, record.column(stat).tolist()):
            metrics[metric_key(prefix, layer, model)] = value
    ratios = record.update_ratios()
    if ratios is not None:
        columns = {"param": record.param_norms, "update": record.update_norms, "ratio": ratios}
        for name, prefix in UPDATE_KEY_PREFIX.items():
            for layer, value in zip(record.layers, columns[name].tolist()):  # type: ignore[union-attr]
                metrics[metric_key(prefix, layer, model)] = value
    for module, value in record.activation_grad_norms.items():
        metrics[metric_key(ACTIVATION_KEY_PREFIX, module, model)] = value
    if record.rank_grad_norms is not None:
        for rank, norms in enumerate(record.rank_grad_norms.tolist()):
            for layer, value in zip(record.layers, norms):
                metrics[metric_key(f"{RANK_KEY_PREFIX}{rank}", layer, model)] = value
    return metrics


def _noise_scale(record: StepRecord) -> dict[str, float]:
    """grad/noise_scale (where |G|^2's EMA is positive), its trace and |G|^2, at every
    logged step that has them; each layer's with ``noise_scale.per_layer``."""
    model, found = record.model_name, dict[str, float]()
    if record.noise_scale_g2 is None or record.noise_scale_trace is None:
        return found
    if record.noise_scale is not None and math.isfinite(record.noise_scale):
        found[metric_key("grad", "noise_scale", model)] = record.noise_scale
    found[metric_key("grad", "noise_scale_trace", model)] = record.noise_scale_trace
    found[metric_key("grad", "noise_scale_g2", model)] = record.noise_scale_g2
    if record.layer_noise_scales is not None:
        for layer, value in zip(record.layers, record.layer_noise_scales.tolist()):
            if math.isfinite(value):
                found[metric_key(NOISE_SCALE_KEY_PREFIX, layer, model)] = value
    return found


def window_series(window: FlightWindow, model_name: str | None) -> list[tuple[str, float, int]]:
    """``(grad_norm/<layer>, norm, step)`` for every step of the window whose per-layer norms
    did not reach the tracker yet (0 where the layer had no gradient at that step).

    MLflow takes past steps in any order, so a window's steps also go out as series (up to
    ``flight.series_max_values``: MLflow stores each value as a row); W&B's history takes
    only increasing steps, so a W&B run keeps the window's file and picture only."""
    prefix = LAYER_KEY_PREFIX["norm"]
    keys = [metric_key(prefix, layer, model_name) for layer in window.layers]
    logged = window.logged if len(window.logged) == len(window.steps) else None
    series = []
    for i, (step, row) in enumerate(zip(window.steps.tolist(), window.norms.tolist())):
        if logged is not None and logged[i]:
            continue
        series += [(key, value, step) for key, value in zip(keys, row)]
    return series
