"""The gradient noise scale on the worker: the critical batch size from squared gradient norms
at two batch sizes (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
appendix A).

With ``small`` the mean squared norm of gradients over ``b_small`` examples each and ``big``
the squared norm of their mean over ``b_big`` examples, both unbiased:

    |G|^2 ~ (b_big * big - b_small * small) / (b_big - b_small)
    tr(S) ~ (small - big) / (1 / b_small - 1 / b_big)

and the simple noise scale B_simple = tr(S) / |G|^2 is the ratio of their EMAs (one step's
ratio is noisy and biased). The two sizes come from data-parallel ranks (each rank's local
gradient against the all-reduced one) or from gradient accumulation (each micro-batch's
contribution against their sum): `gradtrack.capture.probes`.

>>> scale = NoiseScale(ema=0.5)
>>> estimate = scale.update(np.array([2.0]), np.array([1.5]), b_small=8, b_big=16)
>>> [round(float(v[0]), 6) for v in (estimate.g2, estimate.trace, estimate.noise_scale)]
[1.0, 8.0, 8.0]
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import numpy as np

from gradtrack.config import NoiseScaleOptions
from gradtrack.handoff.layout import HostEvidence, TensorIndex
from gradtrack.log import logger


class NoiseEstimate(NamedTuple):
    """The debiased EMAs, one value per column (the total first, then each layer's)."""

    g2: np.ndarray  # |G|^2
    trace: np.ndarray  # tr(Sigma), the per-example gradient's total variance
    noise_scale: np.ndarray  # B_simple = trace / g2; NaN where g2 is not yet positive


class NoiseScale:
    """EMAs of the |G|^2 and tr(Sigma) estimates, column by column. A column whose step
    estimate is not finite (a non-finite gradient) leaves that column's EMAs as they were."""

    def __init__(self, ema: float) -> None:
        self.ema = ema
        self._g2: np.ndarray | None = None
        self._trace: np.ndarray | None = None
        self._weight: np.ndarray | None = None  # 1 - ema**n per column: the debiasing

    def update(
        self, small: np.ndarray, big: np.ndarray, b_small: float, b_big: float
    ) -> NoiseEstimate:
        """One logged step: ``small`` and ``big`` squared norms per column."""
        if not 0 < b_small < b_big:
            raise ValueError(f"need 0 < b_small < b_big, got {b_small} and {b_big}")
        g2 = (b_big * big - b_small * small) / (b_big - b_small)
        trace = (small - big) / (1.0 / b_small - 1.0 / b_big)
        if self._g2 is None or self._g2.shape != g2.shape:
            self._g2, self._trace = np.zeros_like(g2), np.zeros_like(g2)
            self._weight = np.zeros_like(g2)
        assert self._trace is not None and self._weight is not None
        ok = np.isfinite(g2) & np.isfinite(trace)
        a = self.ema
        self._g2[ok] = a * self._g2[ok] + (1 - a) * g2[ok]
        self._trace[ok] = a * self._trace[ok] + (1 - a) * trace[ok]
        self._weight[ok] = a * self._weight[ok] + (1 - a)
        with np.errstate(divide="ignore", invalid="ignore"):
            g2_now, trace_now = self._g2 / self._weight, self._trace / self._weight
            scale = np.where(g2_now > 0, trace_now / g2_now, np.nan)
        return NoiseEstimate(g2_now, trace_now, scale)


class StepNoise:
    """A logged step's noise-scale fields (`StepRecord.noise_scale` …), from what the step
    carried: the replicated ranks' local tensor norms, or the micro-batches' squared norms,
    and the step's examples and backward passes. Without two batch sizes it says once why
    there is no estimate."""

    def __init__(self, options: NoiseScaleOptions, index: TensorIndex, world_size: int) -> None:
        self.options = options
        self._position = {name: i for i, name in enumerate(index.layer_names)}
        self._index = index
        self._tensor_layer = index.tensor_layer
        self._world_size = world_size
        self._scale = NoiseScale(options.ema)
        self.why_none: str | None = None  # said once

    def fields(
        self,
        layers: tuple[str, ...],
        layer_norms: np.ndarray,
        total_norm: float,
        evidence: HostEvidence,
        batch: tuple[int, int],
    ) -> dict[str, Any]:
        """``batch``: the step's examples counted (0: not counted) and backward passes."""
        if not self.options.enabled:
            return {}
        found = self._small_squares(evidence, batch)
        if isinstance(found, str):
            if found and self.why_none is None:
                self.why_none = found
                # Said where the user asked for it (any noise_scale option set); the
                # default estimates it where it can, silently where it cannot.
                asked = bool(self.options.model_fields_set)
                level = logging.INFO if asked else logging.DEBUG
                logger.log(level, "no gradient noise scale: %s", found)
            return {}
        small, b_small, b_big = found
        scale = evidence.scalar("amp_scale")  # the probes saw the GradScaler's scaled gradients
        if scale:
            small = small / scale**2
        big = np.full(len(small), np.nan)
        big[0] = total_norm**2
        big[[1 + self._position[name] for name in layers]] = layer_norms**2
        estimate = self._scale.update(small, big, b_small, b_big)
        fields: dict[str, Any] = {
            "noise_scale": float(estimate.noise_scale[0]),
            "noise_scale_trace": float(estimate.trace[0]),
            "noise_scale_g2": float(estimate.g2[0]),
        }
        if self.options.per_layer:
            rows = [1 + self._position[name] for name in layers]
            fields["layer_noise_scales"] = estimate.noise_scale[rows]
        return fields

    def _small_squares(
        self, evidence: HostEvidence, batch: tuple[int, int]
    ) -> tuple[np.ndarray, float, float] | str:
        """The small batches' mean squared norm per column (total, then each layer), and the
        two batch sizes; or why there are none ("": not yet)."""
        examples, backwards = batch
        n_layers = len(self._position)
        if self._world_size > 1 and len(evidence.rank_norms):
            local = evidence.rank_norms.reshape(self._world_size, -1)
            per_layer = self._index.rank_layer_norms(local) ** 2
            total = (local**2).sum(axis=1).mean()
            small = np.concatenate([[total], per_layer.mean(axis=0)])
            b_small: float = self.options.batch_size or examples
            b_big = b_small * self._world_size
        elif len(evidence.micro_squares) and backwards > 1:
            squares = evidence.micro_squares * backwards  # k·Σ|c_i|²: the mean of |k·c_i|²
            per_layer = np.bincount(self._tensor_layer, squares, minlength=n_layers)
            small = np.concatenate([[squares.sum()], per_layer])
            b_small = self.options.batch_size or examples / backwards
            b_big = b_small * backwards
        elif self._world_size > 1 or backwards > 1:
            return ""  # its first steps are being measured: not said, a next step has it
        else:
            return (
                "it needs two batch sizes: data-parallel ranks, or gradient accumulation "
                "(several backward passes per step)"
            )
        if not b_small:
            return (
                "no batch size: the model's first input had no tensor to count examples in "
                "(or a compiled graph ran no forward hook); pass noise_scale={'batch_size': N}"
            )
        return small, float(b_small), float(b_big)
