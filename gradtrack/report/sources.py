"""Reads a run gradtrack logged to a tracker into `RunData`: an MLflow run, a W&B run (an
offline run directory, or the public API), or a TensorBoard log dir.

What each tracker holds, and the readers of its files, are `gradtrack.formats`' (`mlflow`,
`wandb`, `tensorboard`); here the run is found and what it holds becomes `RunData`. In a W&B
run every step is in the run's step files; the history rows (a subset where the user logs to
the run too) are read for runs written before those files.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from gradtrack.errors import GradtrackError, require_module
from gradtrack.formats.flight import is_window, read_windows_dir
from gradtrack.formats.histogram import Histogram
from gradtrack.formats.metrics import FAMILIES
from gradtrack.formats.mlflow import read_alerts, read_histograms, read_layer_order, read_windows
from gradtrack.formats.tensorboard import (
    ALERTS_TAG,
    histogram_series,
    is_log_dir,
    layer_order,
    load_events,
    parse_alert_line,
    scalar_series,
    texts,
)
from gradtrack.formats.wandb import (
    HIST_FAMILY,
    LAYERS_CONFIG_KEY,
    HistogramSeries,
    Series,
    find_run_file,
    is_part,
    iter_records,
    read_dir,
)
from gradtrack.report.data import (
    LAYER_FAMILIES,
    Alert,
    Progress,
    RunData,
    from_series,
    parse_alert_text,
)

_SCALAR_FAMILIES = {*FAMILIES} - {"act_grad_norm"}
_RUN_ID = re.compile(r"[0-9a-f]{32}")


# -- MLflow ---------------------------------------------------------------------------------
def read_mlflow_run(
    spec: str, tracking_uri: str | None = None, progress: Progress | None = None
) -> RunData:
    """``spec`` is a run id or ``experiment/run-name`` (the newest run of that name)."""
    require_module("mlflow", "mlflow")
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri)
    where = f"MLflow at {client.tracking_uri}"
    try:
        run = client.get_run(spec) if _RUN_ID.fullmatch(spec) else _by_name(client, spec, where)
    except MlflowException as exc:
        raise GradtrackError(
            f"no MLflow run {spec!r} at {client.tracking_uri}: {exc.message}"
        ) from None
    run_id = run.info.run_id
    keys = [k for k in run.data.metrics if k.partition("/")[0] in (*LAYER_FAMILIES, "grad")]
    series = {}
    for i, key in enumerate(keys):
        series[key] = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        if progress is not None:
            progress(f"reading {run.info.run_name}", i + 1, len(keys))
    if not keys:
        series = {k: [] for k in run.data.metrics}
    alerts = [
        Alert(e.step, e.rule, e.severity, e.message, e.layer, e.origin_layer, e.origin_stage)
        for e in read_alerts(run_id, tracking_uri)
    ]
    data = from_series(
        name=run.info.run_name or run_id,
        source=f"MLflow run {run_id} ({client.tracking_uri})",
        series=series,
        layer_order=read_layer_order(run_id, client.tracking_uri),
        histograms=read_histograms(run_id, tracking_uri),
        alerts=alerts,
        run_id=run_id,
    )
    data.windows = read_windows(run_id, tracking_uri)
    return data


def _by_name(client: Any, spec: str, where: str) -> Any:
    experiment_name, _, run_name = spec.rpartition("/")
    if not experiment_name:
        raise GradtrackError(f"{spec!r} is neither an MLflow run id nor experiment/run-name")
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        names = [e.name for e in client.search_experiments()]
        raise GradtrackError(f"no experiment {experiment_name!r} in {where}; experiments: {names}")
    runs = client.search_runs(
        [experiment.experiment_id],
        f"attributes.run_name = '{run_name}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs:
        raise GradtrackError(
            f"no run named {run_name!r} in experiment {experiment_name!r} ({where})"
        )
    return runs[0]


# -- W&B -------------------------------------------------------------------------------------
def read_wandb_offline(path: Path, progress: Progress | None = None) -> RunData:
    run_file = find_run_file(path)
    rows: list[dict[str, Any]] = []
    layer_order: list[str] = []
    alerts = []
    name = run_file.parent.name
    run_id = name.rpartition("-")[2]  # offline-run-<date>_<time>-<id>
    for record in iter_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "run" and record.run.display_name:
            name = record.run.display_name
            run_id = record.run.run_id or run_id
        elif kind in ("run", "config"):
            config = record.run.config if kind == "run" else record.config
            for item in config.update:
                if _key(item) == LAYERS_CONFIG_KEY:
                    layer_order = list(json.loads(item.value_json))
        elif kind == "alert":
            alerts.append(
                parse_alert_text(
                    record.alert.text,
                    record.alert.title.split(": ")[-1].split(" ")[0],
                    record.alert.level.lower().replace("warn", "warning"),
                )
            )
        if progress is not None and len(rows) % 500 == 1:
            progress(f"reading {run_file.name}", len(rows), 0)
    source = f"W&B offline run {run_file.parent}"
    files = read_dir(run_file.parent / "files")
    data = _to_run(name, source, rows, layer_order, alerts, run_id, files)
    data.windows = read_windows_dir(run_file.parent / "files")
    return data


def read_wandb_api(path: str, progress: Progress | None = None) -> RunData:
    """``entity/project/run_id`` through the W&B public API (needs network and a login)."""
    require_module("wandb", "wandb")
    import wandb

    try:
        run = wandb.Api().run(path)
    except Exception as exc:
        raise GradtrackError(f"no W&B run {path!r}: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="gradtrack-wandb-") as directory:
        for file in run.files():
            if is_part(file.name) or is_window(file.name):
                file.download(root=directory, replace=True)
        files = read_dir(Path(directory))
        windows = read_windows_dir(Path(directory))
    rows = [] if files is not None else list(run.scan_history())
    order = list(run.config.get(LAYERS_CONFIG_KEY, []))
    name = str(run.name or path)
    data = _to_run(name, f"W&B run {path}", rows, order, [], str(run.id), files)
    data.windows = windows
    return data


def _key(item: Any) -> str:
    return ".".join(item.nested_key) if item.nested_key else str(item.key)


def _to_run(
    name: str,
    source: str,
    rows: list[dict[str, Any]],
    order: list[str],
    alerts: list[Any],
    run_id: str,
    files: tuple[Series, HistogramSeries] | None = None,
) -> RunData:
    if files is not None:  # every step: the rows hold only some of them
        kept, by_layer = _histograms_by_layer(*files)
        return from_series(name, source, kept, order, by_layer, alerts, run_id)
    series: Series = {}
    histograms: dict[str, list[tuple[int, Histogram]]] = {}
    for row in rows:
        step_key = next((k for k in row if k.startswith("gradtrack/") and k.endswith("step")), None)
        if step_key is None:
            continue
        step = int(row[step_key])
        for key, value in row.items():
            if key.startswith(f"{HIST_FAMILY}/") and key.endswith(".values"):
                layer = key[len(HIST_FAMILY) + 1 : -len(".values")]
                edges = row.get(f"{HIST_FAMILY}/{layer}.bins")
                if edges is not None:
                    histograms.setdefault(layer, []).append(
                        (step, Histogram(np.asarray(edges, float), np.asarray(value, np.int64)))
                    )
            elif key.partition("/")[0] in _SCALAR_FAMILIES and _is_number(value):
                series.setdefault(key, []).append((step, _number(value)))
    if not series:
        series = {k: [] for row in rows for k in row if not k.startswith("_")}
    return from_series(name, source, series, order, histograms, alerts, run_id)


def _histograms_by_layer(series: Series, by_key: HistogramSeries) -> tuple[Series, HistogramSeries]:
    """The step files' series, limited to what the rows' reader keeps, and their histograms
    by layer (``grad_hist/<layer>`` keys, as in the rows)."""
    kept = {
        key: values for key, values in series.items() if key.partition("/")[0] in _SCALAR_FAMILIES
    }
    prefix = f"{HIST_FAMILY}/"
    layers = {key.removeprefix(prefix): entries for key, entries in by_key.items()}
    return kept, layers


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) or value in ("NaN", "Infinity", "-Infinity")


def _number(value: Any) -> float:
    return float(value) if not isinstance(value, str) else float(value.replace("Infinity", "inf"))


# -- TensorBoard ----------------------------------------------------------------------------
def read_tensorboard_dir(path: Path, progress: Progress | None = None) -> RunData:
    if not is_log_dir(path):
        raise GradtrackError(f"{path} is not a TensorBoard log dir (no event files in it)")
    events = load_events(path)
    tags = events.Tags()
    series: dict[str, list[tuple[int, float]]] = {}
    scalar_tags = [t for t in (*tags["scalars"], *tags["tensors"]) if _is_metric(t)]
    for i, tag in enumerate(scalar_tags):
        series[tag] = scalar_series(events, tag)
        if progress is not None:
            progress(f"reading {path.name}", i + 1, len(scalar_tags))
    histograms = {
        tag.removeprefix(f"{HIST_FAMILY}/"): histogram_series(events, tag)
        for tag in tags["histograms"]
        if tag.startswith(f"{HIST_FAMILY}/")
    }
    return from_series(
        name=path.name,
        source=f"TensorBoard log dir {path}",
        series=series,
        layer_order=layer_order(events),
        histograms=histograms,
        alerts=_alerts(events),
        run_id=str(path),
    )


def _is_metric(tag: str) -> bool:
    family = tag.partition("/")[0]
    return family in _SCALAR_FAMILIES or tag == "gradtrack/dropped"


def _alerts(events: Any) -> list[Alert]:
    alerts = []
    for _step, text in texts(events, ALERTS_TAG):
        parsed = parse_alert_line(text)
        if parsed is not None:
            severity, rule, rest = parsed
            alerts.append(parse_alert_text(rest, rule, severity))
    return alerts
