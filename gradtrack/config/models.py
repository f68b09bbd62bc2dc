"""gradtrack's configuration models: `GradtrackConfig` and its option sections, and how
secrets stay out of what gradtrack writes (`redacted_config` for a config, `redact` for
credentials inside URIs and query strings: every warning and log line gradtrack writes about
a tracker passes through it).

Where their values come from (files, the environment, keyword arguments) is
`gradtrack.config.loading`'s business; these are plain pydantic models, built directly too.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    SecretStr,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import to_jsonable_python

from gradtrack.config.rules import AlertRules

# No timeout or interval is meant to be longer: an infinite one would hang close() forever.
_HOUR_S = 3600.0


class WandbOptions(BaseModel):
    """How the W&B sink finds or starts its run (an active ``wandb.run`` is always reused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    project: str | None = Field(None, description="Project of a run gradtrack starts.")
    entity: str | None = None
    name: str | None = Field(None, description="Name of a run gradtrack starts.")
    group: str | None = None
    tags: tuple[str, ...] = ()
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode of a run gradtrack starts (default: W&B's own)."
    )
    dir: str | None = Field(None, description="Where a run gradtrack starts writes its files.")
    profile_every: PositiveInt | None = Field(
        100, description="Log the per-layer gradient-flow profile every N-th step; None: never."
    )
    media_every_s: float | None = Field(
        0.5,
        ge=0,
        allow_inf_nan=False,
        description="Histograms and the profile go into the run's rows at most once per this "
        "many seconds (W&B's SDK spends 2-3 ms of your process on each); every histogram is "
        "in the step files. None: whenever due.",
    )
    pictures: bool = Field(
        True,
        description="At close, draw the run's gradient-flow pictures (total norm, flow by "
        "depth, layers x steps, histograms, alerts) into the run summary as images, "
        "grad_pictures/<name> (needs matplotlib: gradtrack[report]).",
    )
    pictures_every: PositiveInt | None = Field(
        None, description="Also redraw them every N steps (None: at close only)."
    )


class MlflowOptions(BaseModel):
    """Where the MLflow sink logs, and how it rides out an unreachable server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tracking_uri: SecretStr | None = Field(
        None,
        description="Default: MLFLOW_TRACKING_URI, else MLflow's (sqlite:///mlflow.db). A "
        "secret, as it may hold a login (https://user:password@host): shown as ********** "
        "in the config's repr and in the config a W&B run keeps; get_secret_value() reads it.",
    )
    experiment: str = Field("gradtrack", description="Experiment of a run gradtrack starts.")
    run_name: str | None = Field(None, description="Name of a run gradtrack starts.")
    share_run: bool = Field(
        True,
        description="With no active run, start gradtrack's run at watch() as MLflow's active "
        "run in that thread, so your own mlflow.log_metric/log_param land in it (one run). "
        "False: gradtrack's run is started by its worker and is gradtrack's alone.",
    )
    request_timeout_s: float = Field(
        10.0, gt=0, le=_HOUR_S, allow_inf_nan=False, description="Timeout of one request."
    )
    retry_max_s: float = Field(
        30.0, gt=0, le=_HOUR_S, allow_inf_nan=False, description="Longest wait between retries."
    )
    hist_chunk_steps: PositiveInt = Field(
        100, description="Histogram steps per stored file (also written at flush and close)."
    )
    hist_chunk_s: float = Field(
        60.0,
        gt=0,
        le=_HOUR_S,
        allow_inf_nan=False,
        description="Or whatever histograms wait after this long, as one file: histograms "
        "in the run stay at most this much behind the metrics.",
    )
    send_every_s: float = Field(
        5.0,
        ge=0,
        le=_HOUR_S,
        allow_inf_nan=False,
        description="While delivery keeps up, let steps gather this long before they go: "
        "a full batch, an alert (within a second), flush() and close() go at once, and a "
        "backlog goes as fast as MLflow takes it. MLflow's stores cost per request as well "
        "as per metric, so fewer, fuller requests cost less. 0: send as steps come.",
    )
    pictures: bool = Field(
        True,
        description="At close, draw the run's gradient-flow pictures (total norm, flow by "
        "depth, layers x steps, histograms, alerts) and log them as artifacts, "
        "gradtrack/pictures/*.png and report.html (needs matplotlib: gradtrack[report]).",
    )
    pictures_every: PositiveInt | None = Field(
        None, description="Also redraw them every N steps (None: at close only)."
    )


class TensorboardOptions(BaseModel):
    """Where the TensorBoard sink writes its event files (a ``SummaryWriter`` given as the
    backend keeps its own folder)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    log_dir: str | None = Field(
        None,
        description="Folder of the event files; default runs/<date>_<host>, as "
        "SummaryWriter's own default.",
    )
    pictures: bool = Field(
        True,
        description="At close, draw the run's gradient-flow pictures and write them as "
        "images, grad_pictures/<name> (needs matplotlib: gradtrack[report]).",
    )
    pictures_every: PositiveInt | None = Field(
        None, description="Also redraw them every N steps (None: at close only)."
    )


class FlightOptions(BaseModel):
    """The flight recorder (docs/flight.md): every layer's gradient norm at each of the last
    ``steps`` steps, kept on the training device and sent once when an incident fires."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        True, description="Keep the last steps' per-layer norms and send them at an incident."
    )
    steps: PositiveInt = Field(
        256,
        description="Steps the window holds before an incident (K; (K+1) x (1+layers) x 8 "
        "bytes on the device).",
    )
    series_max_values: PositiveInt = Field(
        200_000,
        description="MLflow: a window of more values (steps x layers) is sent as its artifact "
        "only, not also as grad_norm/<layer> series (MLflow stores each value as a row).",
    )


class NoiseScaleOptions(BaseModel):
    """The gradient noise scale (docs/noise_scale.md): the critical batch size, from the
    squared gradient norms at two batch sizes — data-parallel ranks' local gradients against
    the all-reduced one, or gradient accumulation's micro-batches against their sum."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Estimate it on logged steps where it can be.")
    batch_size: PositiveInt | None = Field(
        None,
        description="Examples in one rank's batch (data-parallel) or one micro-batch "
        "(accumulation). None: counted as the first dimension of the model's first tensor "
        "input at each forward pass.",
    )
    ema: float = Field(
        0.99,
        gt=0.0,
        lt=1.0,
        description="EMA decay per logged step of |G|^2 and tr(Sigma) (their ratio is the "
        "estimate: one step's is too noisy, and biased).",
    )
    per_layer: bool = Field(
        False, description="Also each layer's, as grad_noise_scale/<layer> (noisier still)."
    )


class DistributedOptions(BaseModel):
    """How gradtrack behaves under torch.distributed (detected; nothing to switch on)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        True,
        description="Coordinate the ranks of an initialised torch.distributed job (rank 0 "
        "writes). False: every rank watches on its own, writes to its own sinks and issues no "
        "collective (pipeline stages, a different model per rank); sharded gradients are then "
        "summarised per local shard.",
    )
    gather_ranks: bool = Field(
        False,
        description="Also write each rank's local gradient norm per layer, before the "
        "all-reduce (grad_norm_rank<r>/<layer>), from rank 0. Replicated (DDP) training only.",
    )


class SkipOptions(BaseModel):
    """What rules whose action is ``skip`` do beyond leaving the step out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_consecutive: PositiveInt = Field(
        5,
        description="Skipped steps in a row after which the next bad step raises "
        "GradientAlertError instead: skipping does not recover that run.",
    )
    journal: Path = Field(
        Path("skipped_steps.json"),
        description="The bad-step journal: a JSON list, one entry per skipped step (step, "
        "rule, layer, micro-batch indices), rewritten at each skip; read it with "
        "gradtrack.journal.read_journal to leave those batches out of a resumed run.",
    )


class HistogramOptions(BaseModel):
    """How often gradients are sampled for histograms, and how those are binned."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    every: PositiveInt | None = Field(
        100, description="Sample gradients for histograms every N-th step; None turns them off."
    )
    bins: int = Field(64, ge=2, le=4096, description="Bins per histogram.")
    sample_size: PositiveInt = Field(
        4096, description="Gradient elements sampled per layer for a histogram."
    )
    scale: Literal["linear", "log"] = Field(
        "linear", description="Bin gradient values, or log10 |g| for gradients spanning decades."
    )
    seed: int = Field(
        0, ge=0, lt=2**63, description="Seed of the generator that samples those elements."
    )


class DeliveryOptions(BaseModel):
    """How logged steps travel from the training loop to the sinks: the worker's queue, the
    batches it hands on, and what each sink may keep waiting in memory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queue_size: PositiveInt = Field(
        10_000,
        description="Steps waiting for the worker, at most: room for the worker to fall "
        "behind a fast loop for a while (a tracker's SDK loading, a busy machine).",
    )
    queue_mib: PositiveInt = Field(
        256,
        description="Memory the steps waiting for the worker may hold, at most (MiB): "
        "whichever of the two bounds is reached first applies.",
    )
    queue_full: Literal["drop_oldest", "block"] = Field(
        "drop_oldest", description="When the queue is full: drop the oldest step, or wait."
    )
    max_batch_steps: PositiveInt = Field(32, description="Steps handed to a sink in one write.")
    batch_wait_s: float = Field(
        0.05,
        ge=0,
        le=60,
        allow_inf_nan=False,
        description="How long the worker lets steps gather before handing them on: short, "
        "so that charts riding your rows stay close to training (the spool gathers batches "
        "for trackers itself, mlflow.send_every_s).",
    )
    sink_buffer_steps: PositiveInt = Field(
        10_000,
        description="Steps waiting in memory for one sink that has no spool (memory, "
        "console, W&B, your own); past it the oldest are dropped, counted and logged as "
        "gradtrack/dropped.",
    )
    process: bool = Field(
        True,
        description="Run the worker (records, rules, histograms, the spool, the trackers' "
        "clients) in a child process, where its Python cannot take the GIL your training "
        "thread needs, where every sink can be made there (MLflow); else it is a thread of "
        "the training process. False: always a thread.",
    )


class SpoolOptions(BaseModel):
    """The local spool tracker sinks deliver from. ``spool=False`` is short for
    ``spool={"enabled": False}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        True,
        description="Write every record and alert to a local spool before a tracker sink "
        "(W&B, MLflow) gets it; what a tracker has not confirmed stays there "
        "(`gradtrack sync PATH` delivers it later).",
    )
    dir: Path | None = Field(
        None,
        description="Where spools live; default $GRADTRACK_SPOOL_DIR, else "
        "~/.cache/gradtrack/spool. A delivered run leaves nothing there.",
    )
    mib: PositiveInt = Field(
        2048,
        description="Disk the undelivered items of one run may take (MiB); past it new "
        "steps are dropped, counted and logged as gradtrack/dropped.",
    )


class ConsoleOptions(BaseModel):
    """The console sink's options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    interval_s: float = Field(
        5.0,
        ge=0,
        le=_HOUR_S,
        allow_inf_nan=False,
        description="Print a table at most this often.",
    )


class GradtrackConfig(BaseModel):
    """Everything that decides what gradtrack watches, how often, and how it hands data on.

    The most common options sit at the top level; the others in sections (``histograms``,
    ``delivery``, ``spool``, ``console``, ``wandb``, ``mlflow``, ``tensorboard``,
    ``distributed``, ``skip``, ``alerts``), given as dicts: ``histograms={"every": 50}``.

    >>> GradtrackConfig(log_every=5, histograms={"bins": 32}).histograms.bins
    32
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    enabled: bool = Field(
        True,
        description="False (or GRADTRACK_DISABLED=1): watch() adds no hook, makes no sink and "
        "writes nothing, so a script keeps its watch line where gradtrack should stay off.",
    )
    log_every: PositiveInt = Field(10, description="Summarise every N-th step (step 0 included).")
    log_offset: NonNegativeInt = Field(
        0,
        description="Summarise (and sample) the steps s where (s + log_offset) is a multiple of "
        "log_every (and histograms.every). The Lightning callback sets 1: Lightning logs "
        "step s where (s + 1) % log_every_n_steps == 0, so both land on the same steps.",
    )
    granularity: Literal["layer", "parameter"] = Field(
        "layer", description="Summarise per module that owns parameters, or per parameter."
    )
    layer_keys: Literal["path", "depth"] = Field(
        "path",
        description="How layers are named in keys, records and events: 'path', the module path "
        "(a Sequential's 0, 2, … 10, which trackers sort as text: 0, 10, 2); 'depth', the "
        "path after its zero-padded position in model order (00_0, 01_2, … 11_22 for twelve "
        "layers), so trackers list layers by depth. The default keeps the keys runs "
        "already have.",
    )
    include: tuple[str, ...] = Field((), description="Glob patterns of layer names to watch.")
    exclude: tuple[str, ...] = Field((), description="Glob patterns of layer names to skip.")
    module_types: tuple[type[torch.nn.Module], ...] = Field(
        (), description="Watch only modules of these types (classes or torch.nn names)."
    )
    flush_timeout_s: float = Field(
        30.0,
        gt=0,
        le=_HOUR_S,
        allow_inf_nan=False,
        description="How long close() waits for the sinks without progress; while steps "
        "flow to a tracker it waits, with a progress line every 5 s.",
    )
    layer_metrics: tuple[Literal["norm", "max_abs", "mean_abs", "rms"], ...] = Field(
        ("norm", "max_abs", "mean_abs", "rms"),
        description="Per-layer statistics written as metrics (grad_norm/, grad_max/, "
        "grad_mean_abs/, grad_rms/); fewer keys per step for very deep models on slow stores "
        "(empty: only the grad/ totals). All are still computed for alerts and the console.",
    )
    layer_every: PositiveInt = Field(
        100,
        description="Write the per-layer metrics (layer_metrics, activation norms) on the "
        "first logged step of every N steps; the grad/ totals and per-layer NaN/Inf counts go "
        "out at every logged step, and the first step in each window with a non-finite "
        "gradient or an alert is written in full. Max and mean |g| are computed on the "
        "window's first steps only (two more passes over every gradient). 1: everything at "
        "every logged step. Alerts always see every logged step.",
    )
    layer_schedule: Literal["fixed", "dense_early"] = Field(
        "fixed",
        description="Which logged steps write per-layer metrics: 'fixed', the first of every "
        "layer_every steps; 'dense_early', every logged step at first, then ever sparser "
        "until one per layer_every (gradtrack.capture.verdict.DenseEarly: a short run gets enough "
        "points, a long one at most ~250 per-layer steps more than 'fixed').",
    )
    activations: bool = Field(
        False, description="Also log gradient norms w.r.t. every leaf module's output."
    )
    update_signals: bool | Literal["sampled"] = Field(
        "sampled",
        description="Each layer's weight norm and the norm of the update optimizer.step() "
        "applied, on logged steps (needs optimizer=): param_norm/, update_norm/, "
        "update_ratio/, and the learning_rate rule. 'sampled' (the default): ||W|| exact, "
        "||dW|| from a fixed sample of each tensor (gradtrack.capture.handover; a few KiB per "
        "tensor); True: ||dW|| exact from a copy of the trainable parameters, kept for the "
        "run; False: off. See docs/signals.md.",
    )
    model_name: str | None = Field(
        None,
        description="Name put after each metric family (grad_norm/<model_name>/<layer>) so "
        "several watched models can share one run.",
    )
    alerts: AlertRules = Field(default_factory=AlertRules, description="Alert rules.")
    skip: SkipOptions = Field(
        default_factory=SkipOptions, description="Options of the rules whose action is skip."
    )
    histograms: HistogramOptions = Field(
        default_factory=HistogramOptions, description="Gradient histograms (False: none)."
    )
    delivery: DeliveryOptions = Field(
        default_factory=DeliveryOptions, description="The worker's queue and batches."
    )
    spool: SpoolOptions = Field(
        default_factory=SpoolOptions, description="The local spool (False: none)."
    )
    console: ConsoleOptions = Field(
        default_factory=ConsoleOptions, description="Console sink options."
    )
    wandb: WandbOptions = Field(default_factory=WandbOptions, description="W&B sink options.")
    mlflow: MlflowOptions = Field(default_factory=MlflowOptions, description="MLflow options.")
    tensorboard: TensorboardOptions = Field(
        default_factory=TensorboardOptions, description="TensorBoard sink options."
    )
    distributed: DistributedOptions = Field(
        default_factory=DistributedOptions, description="torch.distributed options."
    )
    flight: FlightOptions = Field(
        default_factory=FlightOptions, description="Flight recorder options (False: none)."
    )
    noise_scale: NoiseScaleOptions = Field(
        default_factory=NoiseScaleOptions,
        description="Gradient noise scale options (False: none).",
    )

    @model_validator(mode="before")
    @classmethod
    def _switched_sections(cls, data: Any) -> Any:
        """A section given as an on/off value (``spool=False``) is that section's mapping."""
        return expanded(data) if isinstance(data, Mapping) else data

    @field_validator("include", "exclude", "layer_metrics", mode="before")
    @classmethod
    def _one_pattern_is_a_list(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_serializer("module_types")
    def _module_type_names(self, value: tuple[type, ...]) -> list[str]:
        return [f"{cls.__module__}.{cls.__qualname__}" for cls in value]

    @field_validator("module_types", mode="before")
    @classmethod
    def _resolve_module_types(cls, value: Any) -> Any:
        if isinstance(value, (str, type)):
            value = (value,)
        return tuple(_resolve_module_type(v) if isinstance(v, str) else v for v in value)


FIELDS: tuple[str, ...] = tuple(GradtrackConfig.model_fields)

# Sections a plain on/off value stands for: spool=False, histograms=False (see expand_switch).
SWITCHED = ("spool", "histograms", "noise_scale", "flight")


def expand_switch(section: str, value: Any) -> Any:
    """A section given as an on/off value: ``spool=False`` is ``spool={"enabled": False}``
    (``noise_scale`` and ``flight`` alike), ``histograms=False`` is
    ``histograms={"every": None}`` (True: the defaults).

    >>> expand_switch("histograms", False), expand_switch("histograms", True)
    ({'every': None}, {})
    >>> expand_switch("spool", False)
    {'enabled': False}
    >>> expand_switch("noise_scale", False), expand_switch("noise_scale", True)
    ({'enabled': False}, {'enabled': True})
    """
    if section not in SWITCHED or isinstance(value, (Mapping, BaseModel)):
        return value
    if section != "histograms":
        return {"enabled": value}
    if not isinstance(value, (bool, type(None))):
        return value  # refused by validation: histograms takes a mapping or a bool
    return {} if value else {"every": None}


def expanded(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (nested dicts copied) with each section given as an on/off value expanded.

    >>> expanded({"spool": False, "histograms": {"bins": 8}})
    {'spool': {'enabled': False}, 'histograms': {'bins': 8}}
    """
    copied = _copied(values)
    for name in SWITCHED:
        if name in copied:
            copied[name] = expand_switch(name, copied[name])
    return copied


def _copied(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copied(v) if isinstance(v, Mapping) else v for k, v in values.items()}


def _resolve_module_type(name: str) -> type:
    if "." not in name:
        found = getattr(torch.nn, name, None)
        if isinstance(found, type):
            return found
        close = difflib.get_close_matches(name, [n for n in dir(torch.nn) if n[:1].isupper()], 3)
        raise ValueError(f"torch.nn has no module type {name!r}; close names: {close}")
    module_name, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import module type {name!r}: {exc}") from exc


def redacted_config(config: GradtrackConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The config as JSON-ready data with no credential in it, for trackers and logs.

    Secrets are told by their type, not their name: a ``SecretStr`` that is a URI
    (``mlflow.tracking_uri``) keeps its scheme, host and path with its login and query secrets
    masked (``http://***@host``: the run still says which server), any other ``SecretStr`` is
    ``**********`` (ten stars whatever its length); every other string goes through
    `redact` too, in case it holds a URI with a login.
    ``layer_keys`` is kept as it is.

    >>> data = redacted_config(GradtrackConfig(mlflow={"tracking_uri": "http://a:pw@host"}))
    >>> data["mlflow"]["tracking_uri"], data["layer_keys"]
    ('http://***@host', 'path')
    """
    data = config.model_dump(mode="python") if isinstance(config, BaseModel) else config
    redacted = to_jsonable_python(_redact(data))
    assert isinstance(redacted, dict)
    return redacted


def _redact(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _redact(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(item) for item in value]
    if isinstance(value, SecretStr):
        secret = value.get_secret_value()
        return redact(secret) if "://" in secret else str(value)
    if isinstance(value, str):
        return redact(value)
    return value


# scheme://user:password@host → scheme://***@host (any userinfo, a token alone included)
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/@\s'\"]+@")
# ?token=…&password=… and the like
_SECRET_PARAMETER = re.compile(
    r"(?P<name>[?&;](?:[\w.\-]*(?:token|password|passwd|secret|key|auth)[\w.\-]*))=[^&;\s'\"]+",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with URI credentials and secret query parameters replaced by ``***``.

    >>> redact("cannot reach http://alice:s3cr3t@mlflow.example:5000/api (timeout)")
    'cannot reach http://***@mlflow.example:5000/api (timeout)'
    >>> redact("postgresql://mlflow:pw@db/mlflow?sslmode=require&password=pw2")
    'postgresql://***@db/mlflow?sslmode=require&password=***'
    >>> redact("sqlite:///mlflow.db")
    'sqlite:///mlflow.db'
    """
    return _SECRET_PARAMETER.sub(r"\g<name>=***", _USERINFO.sub(r"\g<scheme>***@", text))
