"""gradtrack's files and tags in an MLflow run, and the readers that load them back.

Histograms are chunk files (`gradtrack.formats.histogram`) under
``gradtrack/histograms``, alert events one JSON line each in ``gradtrack/alerts.jsonl``, the
layer order a JSON list in ``gradtrack/layers.json``; tags are ``gradtrack.<name>``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from gradtrack.errors import require_module
from gradtrack.formats.event import AlertEvent
from gradtrack.formats.flight import FLIGHT_DIR, FlightWindow, is_window, read_window
from gradtrack.formats.histogram import read_chunks
from gradtrack.formats.metrics import safe_key

HISTOGRAM_DIR = "gradtrack/histograms"
ALERTS_DIR = "gradtrack"
ALERTS_FILE = "alerts.jsonl"
LAYERS_FILE = "gradtrack/layers.json"  # layer names in depth order, for readers
PICTURES_DIR = "gradtrack/pictures"  # PNGs and report.html the MLflow UI shows
DROPPED_KEY = "gradtrack/dropped"
# With ``model_name`` (several models in one run), every artifact and tag is the model's
# own: gradtrack/<model>/histograms, gradtrack/<model>/alerts.jsonl, gradtrack.<model>.*.


def artifact_path(path: str, model_name: str | None = None) -> str:
    """An artifact path of gradtrack's, within the model's own folder when it has a name.

    >>> artifact_path(HISTOGRAM_DIR), artifact_path(HISTOGRAM_DIR, "critic")
    ('gradtrack/histograms', 'gradtrack/critic/histograms')
    """
    if not model_name:
        return path
    return f"gradtrack/{safe_key(model_name)}" + path.removeprefix("gradtrack")


def tag_key(name: str, model_name: str | None = None) -> str:
    """``gradtrack.<name>``, or ``gradtrack.<model>.<name>``.

    >>> tag_key("alert.count", "critic")
    'gradtrack.critic.alert.count'
    """
    return f"gradtrack.{safe_key(model_name)}.{name}" if model_name else f"gradtrack.{name}"


def read_histograms(
    run_id: str, tracking_uri: str | None = None, model_name: str | None = None
) -> dict[str, list[tuple[int, Any]]]:
    """Load the histograms gradtrack stored in an MLflow run: ``{layer: [(step, Histogram)]}``.

    >>> read_histograms  # doctest: +ELLIPSIS
    <function read_histograms at ...>
    """
    require_module("mlflow", "mlflow")
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    client = MlflowClient(tracking_uri)
    folder = artifact_path(HISTOGRAM_DIR, model_name)
    parent = folder.rpartition("/")[0]
    if not any(f.path == folder for f in client.list_artifacts(run_id, parent)):
        return {}
    with tempfile.TemporaryDirectory() as directory:
        local = download_artifacts(
            run_id=run_id, artifact_path=folder, dst_path=directory, tracking_uri=tracking_uri
        )
        return read_chunks(Path(local).glob("hist-*.npz"))


def read_alerts(
    run_id: str, tracking_uri: str | None = None, model_name: str | None = None
) -> list[AlertEvent]:
    """The alert events gradtrack stored in an MLflow run's ``gradtrack/alerts.jsonl`` (and
    the ``alerts-<time>.jsonl`` of a delivery `gradtrack sync` resumed), in step order."""
    require_module("mlflow", "mlflow")
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    client = MlflowClient(tracking_uri)
    folder = artifact_path(ALERTS_DIR, model_name)
    names = sorted(
        f.path
        for f in client.list_artifacts(run_id, folder)
        if Path(f.path).name.startswith("alerts") and f.path.endswith(".jsonl")
    )
    events: list[AlertEvent] = []
    with tempfile.TemporaryDirectory() as directory:
        for name in names:
            local = download_artifacts(
                run_id=run_id, artifact_path=name, dst_path=directory, tracking_uri=tracking_uri
            )
            lines = Path(local).read_text().splitlines()
            # A resumed delivery may repeat the last alerts another file already holds.
            seen = {event.model_dump_json() for event in events}
            fresh = [AlertEvent.model_validate(json.loads(line)) for line in lines if line]
            events += [event for event in fresh if event.model_dump_json() not in seen]
    return sorted(events, key=lambda event: event.step)


def read_windows(
    run_id: str, tracking_uri: str | None = None, model_name: str | None = None
) -> list[FlightWindow]:
    """The flight recorder's windows stored in an MLflow run, by incident step."""
    require_module("mlflow", "mlflow")
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    folder = artifact_path(FLIGHT_DIR.as_posix(), model_name)
    client = MlflowClient(tracking_uri)
    paths = sorted(f.path for f in client.list_artifacts(run_id, folder) if is_window(f.path))
    windows = []
    with tempfile.TemporaryDirectory() as directory:
        for path in paths:
            local = download_artifacts(
                run_id=run_id, artifact_path=path, dst_path=directory, tracking_uri=tracking_uri
            )
            windows.append(read_window(Path(local).read_text(encoding="utf-8")))
    return windows


def read_layer_order(run_id: str, tracking_uri: str | None = None) -> list[str]:
    """The layer names, in depth order, an MLflow run's ``gradtrack/layers.json`` holds;
    empty if it has none."""
    require_module("mlflow", "mlflow")
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    client = MlflowClient(tracking_uri)
    listed = {f.path for f in client.list_artifacts(run_id, "gradtrack")}
    if LAYERS_FILE not in listed:
        return []
    with tempfile.TemporaryDirectory() as directory:
        local = download_artifacts(
            run_id=run_id,
            artifact_path=LAYERS_FILE,
            dst_path=directory,
            tracking_uri=client.tracking_uri,
        )
        return list(json.loads(Path(local).read_text()))
