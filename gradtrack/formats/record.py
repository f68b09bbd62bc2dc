"""What the worker hands to sinks: one `StepRecord` per logged step.

Sinks name its metrics with `gradtrack.formats.metrics.scalar_metrics`, so runs line up
across backends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from gradtrack.formats.flight import FlightWindow
from gradtrack.formats.histogram import Histogram

# Columns of `StepRecord.stats`, one row per layer that had a gradient at this step.
STAT_COLUMNS = ("norm", "max_abs", "mean_abs", "rms", "numel", "nan", "inf")

# Computed only on the steps that write per-layer metrics (see `StepRecord.abs_stats`).
ABS_STATS = ("max_abs", "mean_abs")


class LayerStats(NamedTuple):
    """One layer's gradient at one step."""

    norm: float
    max_abs: float
    mean_abs: float
    rms: float
    numel: int
    nan: int
    inf: int


# Per-layer metrics of a step: "none" (a logged step between ``layer_every`` ones: totals
# only), "norms" (the per-layer metrics, but max |g| and mean |g| were not computed: a bad
# step between per-layer steps, or one an accelerator's guard latched), or "all".
LayerDetail = Literal["none", "norms", "all"]


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
    # The L2 norm of the gradient reaching the model output (the loss's), where observed:
    # small when the model fits its data, large while its layers pass none on.
    output_grad_norm: float | None = None
    # With a GradScaler: whether it skipped this step, and its scale before/after.
    amp_skipped: bool | None = None
    amp_scale: float | None = None
    amp_scale_after: float | None = None
    # With ``activations=True``: gradient norm w.r.t. each module's output, and the module
    # whose output gradient was the first non-finite one in backward.
    activation_grad_norms: Mapping[str, float] = field(default_factory=dict)
    activation_origin: str | None = None
    # At a non-finite step (where its verdict is read at the step, see `gradtrack.capture.origin`):
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
    # The per-layer statistics sinks write as metrics (``layer_metrics`` in the config; each
    # has its family in `gradtrack.formats.metrics.LAYER_KEY_PREFIX`).
    layer_metrics: tuple[str, ...] = ("norm", "max_abs", "mean_abs", "rms")
    # What this step writes per layer (see `LayerDetail`); the grad/ totals and non-zero
    # NaN/Inf counts are written at every logged step.
    layer_detail: LayerDetail = "all"
    # Whether NaN/Inf elements were counted. Not at a non-finite step that an accelerator's
    # guard latched between logged steps (see `gradtrack.capture.verdict`): its norms say which
    # layers went non-finite, and its count columns are 0 and never written.
    counted: bool = True
    # Steps lost so far between the training thread and the sinks (a full queue): written as
    # gradtrack/dropped once non-zero.
    dropped_steps: int = 0
    # Spike statistics of this step (`gradtrack.capture.spike`), per column: 0 the total norm, 1 + i
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
    # The flight recorder's window, on the step whose incident sent it
    # (`gradtrack.worker.flight_log`);
    # ``window_only``: a record that carries nothing else (training ended in an exception
    # after its last step was handed on): sinks write no step metrics for it.
    flight: FlightWindow | None = None
    window_only: bool = False
    # The gradient noise scale (`gradtrack.worker.noise_scale`), EMAs up to this step: B_simple (the
    # critical batch size, in examples; NaN while |G|^2's EMA is not positive), tr(Sigma) and
    # |G|^2; with ``noise_scale.per_layer``, each layer's B_simple (rows follow ``layers``).
    # None where not estimated.
    noise_scale: float | None = None
    noise_scale_trace: float | None = None
    noise_scale_g2: float | None = None
    layer_noise_scales: np.ndarray | None = None

    @property
    def per_layer(self) -> bool:
        """Whether sinks write the per-layer metrics at this step (``layer_every``)."""
        return self.layer_detail != "none"

    @property
    def abs_stats(self) -> bool:
        """Whether max |g| and mean |g| were computed (on the steps ``layer_every`` makes
        per-layer: they cost two more passes over every gradient); NaN in ``stats`` if not."""
        return self.layer_detail == "all"

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
        finite = np.isfinite(norms).nonzero()[0]
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
    l2, l1, linf, nan, inf = tensor_stats.T
    present = np.bincount(tensor_layer, minlength=n) > 0
    rows = np.empty((n, len(STAT_COLUMNS)))
    norms = rows[:, 0] = root_sum_squares(l2, tensor_layer, n)
    max_abs = rows[:, 1]
    max_abs.fill(-np.inf)
    with np.errstate(invalid="ignore"):
        np.maximum.at(max_abs, tensor_layer, linf)
    numel = rows[:, 4] = np.bincount(tensor_layer, tensor_numel, minlength=n)
    safe_numel = np.maximum(numel, 1.0)  # an empty layer's gradient is all (no) zeros
    rows[:, 2] = np.bincount(tensor_layer, l1, minlength=n) / safe_numel
    rows[:, 3] = norms / np.sqrt(safe_numel)
    rows[:, 5] = np.bincount(tensor_layer, nan, minlength=n)
    rows[:, 6] = np.bincount(tensor_layer, inf, minlength=n)
    if not present.all():  # (usually every layer has a gradient: its rows as they are)
        rows, norms = rows[present], norms[present]
        layer_names = tuple(name for name, keep in zip(layer_names, present) if keep)
    total = root_sum_squares(norms, np.zeros(len(norms), np.int64), 1)
    return layer_names, rows, float(total[0]) if len(total) else 0.0


# Squares of norms between these bounds sum in fp64 with every digit kept (a sum of fewer
# than 10^8 of them stays finite): `root_sum_squares` needs no scaling.
_SQUARE_MAX = 1e300
_SQUARE_MIN = 1e-290


def root_sum_squares(values: np.ndarray, groups: np.ndarray, n: int) -> np.ndarray:
    """sqrt(sum of squares) per group, scaled by each group's largest value so that squares
    of norms near fp64's limits neither overflow nor underflow; NaN and Inf propagate.

    >>> root_sum_squares(np.array([3e200, 4e200, 1e-200]), np.array([0, 0, 1]), 2)
    array([5.e+200, 1.e-200])
    """
    with np.errstate(over="ignore", invalid="ignore"):
        squares = values * values
    # The common case, unscaled: no square overflows, or underflows to where fp64 loses
    # digits (a NaN or Inf anywhere takes the scaled pass, which keeps them).
    largest = squares.max(initial=0.0)
    smallest = squares.min(initial=1.0, where=values != 0.0)
    if largest < _SQUARE_MAX and smallest > _SQUARE_MIN:
        return np.sqrt(np.bincount(groups, squares, minlength=n))
    scale = np.zeros(n)
    np.fmax.at(scale, groups, values)  # fmax: a NaN does not hide the finite maximum
    usable = np.isfinite(scale) & (scale > 0)
    divisor = np.where(usable, scale, 1.0)
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = values / divisor[groups]
        return np.sqrt(np.bincount(groups, ratio * ratio, minlength=n)) * divisor
