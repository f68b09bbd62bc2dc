"""A step as flat ``{key: value}`` metrics: what every sink writes for it."""

from __future__ import annotations

import math

from gradtrack.formats.keys import (
    ACTIVATION_KEY_PREFIX,
    LAYER_KEY_PREFIX,
    NOISE_SCALE_KEY_PREFIX,
    NONFINITE_KEY_PREFIX,
    RANK_KEY_PREFIX,
    UPDATE_KEY_PREFIX,
    metric_key,
)
from gradtrack.formats.record import ABS_STATS, StepRecord


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
