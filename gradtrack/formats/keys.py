"""Metric keys: the families a step's metrics use, and how a key is built from a name.

Every sink names metrics this way (through `gradtrack.formats.metrics.scalar_metrics`), and
every reader looks them up the same way, so runs line up across backends.
"""

from __future__ import annotations

import re

TOTAL_NORM_KEY = "grad/total_norm"
# Every family a step's metrics use (the first key segment: a W&B panel section).
FAMILIES = (
    "grad", "grad_norm", "grad_max", "grad_mean_abs", "grad_rms", "grad_nan", "grad_inf",
    "act_grad_norm", "param_norm", "update_norm", "update_ratio", "grad_noise_scale",
)  # fmt: skip
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
