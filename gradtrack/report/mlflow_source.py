"""Reads a run gradtrack logged to MLflow: metric histories, histogram files, alerts."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

from gradtrack.errors import GradtrackError
from gradtrack.extras import require_module
from gradtrack.formats.mlflow import LAYERS_FILE, read_alerts, read_histograms, read_windows
from gradtrack.report.data import LAYER_FAMILIES, Alert, Progress, RunData, from_series

_RUN_ID = re.compile(r"[0-9a-f]{32}")


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
        layer_order=_layer_order(client, run_id),
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
        [experiment.experiment_id], f"attributes.run_name = '{run_name}'",
        order_by=["attributes.start_time DESC"], max_results=1,
    )  # fmt: skip
    if not runs:
        raise GradtrackError(
            f"no run named {run_name!r} in experiment {experiment_name!r} ({where})"
        )
    return runs[0]


def _layer_order(client: Any, run_id: str) -> list[str]:
    from mlflow.artifacts import download_artifacts

    listed = {f.path for f in client.list_artifacts(run_id, "gradtrack")}
    if LAYERS_FILE not in listed:
        return []
    with tempfile.TemporaryDirectory() as directory:
        local = download_artifacts(
            run_id=run_id, artifact_path=LAYERS_FILE, dst_path=directory,
            tracking_uri=client.tracking_uri,
        )  # fmt: skip
        return list(json.loads(Path(local).read_text()))
