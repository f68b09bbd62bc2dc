"""What the worker hands to sinks: one `StepRecord` per logged step, and its metric keys.

Every sink names metrics with `scalar_metrics`, so runs line up across backends.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from gradtrack.histogram import Histogram

# Columns of `StepRecord.stats`, one row per layer that had a gradient at this step.
STAT_COLUMNS = ("norm", "max_abs", "mean_abs", "rms", "numel", "nan", "inf")

TOTAL_NORM_KEY = "grad/total_norm"
# Every family a step's metrics use (the first key segment: a W&B panel section).
FAMILIES = (
    "grad", "grad_norm", "grad_max", "grad_mean_abs", "grad_rms", "grad_nan", "grad_inf",
    "act_grad_norm", "param_norm", "update_norm", "update_ratio",
)  # fmt: skip
# Metric family per statistic; NaN/Inf families appear only where the count is non-zero.
LAYER_KEY_PREFIX = {
    "norm": "grad_norm",
    "max_abs": "grad_max",
    "mean_abs": "grad_mean_abs",
    "rms": "grad_rms",
}
NONFINITE_KEY_PREFIX = {"nan": "grad_nan", "inf": "grad_inf"}
# Computed only on the steps that write per-layer metrics (see `StepRecord.abs_stats`).
ABS_STATS = ("max_abs", "mean_abs")
ACTIVATION_KEY_PREFIX = "act_grad_norm"
# With ``distributed.gather_ranks``: grad_norm_rank<r>/<layer>, rank r's local gradient.
RANK_KEY_PREFIX = "grad_norm_rank"
# With ``update_signals``: ‖W‖, ‖ΔW‖ of the applied update, and their ratio, per layer.
UPDATE_KEY_PREFIX = {"param": "param_norm", "update": "update_norm", "ratio": "update_ratio"}


class LayerStats(NamedTuple):
    """One layer's gradient at one step."""

    norm: float
    max_abs: float
    mean_abs: float
    rms: float
    numel: int
    nan: int
    inf: int


@dataclass(frozen=True)
class StepRecord:
    """One logged step: per-layer statistics (rows follow ``layers``) and histograms."""

    step: int
    wall_time: float
    layers: tuple[str, ...]
    stats: np.ndarray
    total_norm: float
    histograms: Mapping[str, Histogram] = field(default_factory=dict)
    # Forward/loss evidence for non-finite origins: None where it was not observed.
    output_finite: bool | None = None
    output_grad_finite: bool | None = None
    # With a GradScaler: whether it skipped this step, and its scale before/after.
    amp_skipped: bool | None = None
    amp_scale: float | None = None
    amp_scale_after: float | None = None
    # With ``activations=True``: gradient norm w.r.t. each module's output, and the module
    # whose output gradient was the first non-finite one in backward.
    activation_grad_norms: Mapping[str, float] = field(default_factory=dict)
    activation_origin: str | None = None
    # At a non-finite step (where its verdict is read at the step, see `gradtrack.origin`):
    # the module a replay found made it, in which pass, and what the replay could not see;
    # and the layers whose weights (not gradients) were already non-finite.
    origin_module: str | None = None
    origin_module_stage: str | None = None
    origin_note: str = ""
    nonfinite_weights: tuple[str, ...] | None = None
    model_name: str | None = None  # set when several models share one run
    # torch.distributed with replicated gradients (DDP): ranks whose local gradient (before
    # the all-reduce) was non-finite; with ``gather_ranks``, [ranks, layers] local norms.
    nonfinite_ranks: tuple[int, ...] | None = None
    rank_grad_norms: np.ndarray | None = None
    # Sharded gradients (any device mesh): ``nonfinite_ranks`` are the ranks whose model
    # output or its gradient was non-finite; here each as "3 (dp=1, tp=1)", its mesh place.
    nonfinite_rank_places: tuple[str, ...] | None = None
    # The per-layer statistics sinks write as metrics (``layer_metrics`` in the config).
    layer_metrics: tuple[str, ...] = tuple(LAYER_KEY_PREFIX)
    # Whether sinks write the per-layer metrics at this step (``layer_every``); the grad/
    # totals and non-zero NaN/Inf counts are written at every logged step.
    per_layer: bool = True
    # Whether max |g| and mean |g| were computed (on the steps ``layer_every`` makes per-layer:
    # they cost two more passes over every gradient); NaN in ``stats`` otherwise.
    abs_stats: bool = True
    # Whether NaN/Inf elements were counted. Not at a non-finite step that an accelerator's
    # guard latched between logged steps (see `gradtrack.latch`): its norms say which
    # layers went non-finite, and its count columns are 0 and never written.
    counted: bool = True
    # Steps lost so far between the training thread and the sinks (a full queue): written as
    # gradtrack/dropped once non-zero.
    dropped_steps: int = 0
    # Spike statistics of this step (`gradtrack.spike`), per column: 0 the total norm, 1 + i
    # the watcher's layer i (every layer, not only ``layers``): z-score, the window's typical
    # norm, and whether it spiked. None where the spike rule is off.
    spike_z: np.ndarray | None = None
    spike_typical: np.ndarray | None = None
    spiking: np.ndarray | None = None
    # With ``update_signals``, rows follow ``layers``: ‖W‖ before the optimizer step and
    # ‖ΔW‖ of the update it applied (NaN where unknown). None where not measured.
    param_norms: np.ndarray | None = None
    update_norms: np.ndarray | None = None
    # A rule whose action is "skip" left this step's optimizer step out; how many steps were
    # skipped so far (written as grad/skipped once non-zero).
    skipped_by: str | None = None
    skipped_steps: int = 0

    def update_ratios(self) -> np.ndarray | None:
        """‖ΔW‖/‖W‖ per layer (rows follow ``layers``), or None if not measured."""
        if self.update_norms is None or self.param_norms is None:
            return None
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.update_norms / self.param_norms

    def column(self, name: str) -> np.ndarray:
        return self.stats[:, STAT_COLUMNS.index(name)]

    def layer_stats(self) -> dict[str, LayerStats]:
        return {
            name: LayerStats(*row[:4].tolist(), *(int(v) for v in row[4:]))
            for name, row in zip(self.layers, self.stats)
        }

    def extreme_layers(self) -> tuple[tuple[str, float], tuple[str, float]] | None:
        """(weakest, strongest) layer by finite gradient norm: where flow bottlenecks."""
        norms = self.column("norm")
        finite = np.flatnonzero(np.isfinite(norms))
        if len(finite) == 0:
            return None
        low, high = finite[np.argmin(norms[finite])], finite[np.argmax(norms[finite])]
        return (self.layers[low], float(norms[low])), (self.layers[high], float(norms[high]))

    @property
    def nan_count(self) -> int:
        return int(self.column("nan").sum())

    @property
    def inf_count(self) -> int:
        return int(self.column("inf").sum())


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
    >>> sorted(scalar_metrics(StepRecord(0, 0.0, ("fc",), stats, 5.0, per_layer=False)))[-1]
    'grad/total_norm'
    """
    model = record.model_name
    metrics = {metric_key("grad", "total_norm", model): record.total_norm}
    if record.counted:
        metrics[metric_key("grad", "nan_count", model)] = float(record.nan_count)
        metrics[metric_key("grad", "inf_count", model)] = float(record.inf_count)
    if record.dropped_steps:
        metrics[metric_key("gradtrack", "dropped", model)] = float(record.dropped_steps)
    if record.skipped_steps:
        metrics[metric_key("grad", "skipped", model)] = float(record.skipped_steps)
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


def summarise_layers(
    layer_names: tuple[str, ...],
    tensor_layer: np.ndarray,
    tensor_numel: np.ndarray,
    tensor_stats: np.ndarray,
) -> tuple[tuple[str, ...], np.ndarray, float]:
    """Per-tensor rows (L2, L1, max, NaN, Inf) → per-layer rows of `STAT_COLUMNS`.

    Only layers with at least one tensor present get a row. Returns names, rows, total norm.
    """
    n = len(layer_names)
    weights = {"minlength": n}
    l2, l1, linf, nan, inf = tensor_stats.T
    present = np.bincount(tensor_layer, **weights) > 0
    max_abs = np.full(n, -np.inf)
    with np.errstate(invalid="ignore"):
        np.maximum.at(max_abs, tensor_layer, linf)
    numel = np.bincount(tensor_layer, tensor_numel.astype(np.float64), **weights)
    safe_numel = np.maximum(numel, 1.0)  # an empty layer's gradient is all (no) zeros
    norms = root_sum_squares(l2, tensor_layer, n)
    rows = np.stack(
        [
            norms,
            max_abs,
            np.bincount(tensor_layer, l1, **weights) / safe_numel,
            norms / np.sqrt(safe_numel),
            numel,
            np.bincount(tensor_layer, nan, **weights),
            np.bincount(tensor_layer, inf, **weights),
        ],
        axis=1,
    )[present]
    names = tuple(name for name, keep in zip(layer_names, present) if keep)
    total = root_sum_squares(norms[present], np.zeros(int(present.sum()), np.int64), 1)
    return names, rows, float(total[0]) if len(total) else 0.0


def root_sum_squares(values: np.ndarray, groups: np.ndarray, n: int) -> np.ndarray:
    """sqrt(sum of squares) per group, scaled by each group's largest value so that squares
    of norms near fp64's limits neither overflow nor underflow; NaN and Inf propagate.

    >>> root_sum_squares(np.array([3e200, 4e200, 1e-200]), np.array([0, 0, 1]), 2)
    array([5.e+200, 1.e-200])
    """
    scale = np.zeros(n)
    np.fmax.at(scale, groups, values)  # fmax: a NaN does not hide the finite maximum
    usable = np.isfinite(scale) & (scale > 0)
    divisor = np.where(usable, scale, 1.0)
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = values / divisor[groups]
        return np.sqrt(np.bincount(groups, ratio * ratio, minlength=n)) * divisor
