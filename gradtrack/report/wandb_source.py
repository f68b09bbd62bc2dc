"""Reads a run gradtrack logged to W&B: an offline run directory, or the public API.

Every step is in the run's step files (`gradtrack.formats.wandb_steps`); the history rows
(a subset where the user logs to the run too) are read for runs written before those files.
The offline reader parses the run's ``.wandb`` transaction log itself: 32 KiB blocks of
chunks (crc32, length, type) after a 7-byte header, each record a ``wandb_internal_pb2``
protobuf.
"""

from __future__ import annotations

import json
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gradtrack.errors import GradtrackError
from gradtrack.extras import require_module
from gradtrack.formats.flight import is_window, read_windows_dir
from gradtrack.formats.histogram import Histogram
from gradtrack.formats.keys import FAMILIES
from gradtrack.formats.wandb import HIST_FAMILY, LAYERS_CONFIG_KEY
from gradtrack.formats.wandb_steps import HistogramSeries, Series, is_part, read_dir
from gradtrack.report.data import Progress, RunData, from_series, parse_alert_text

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def find_run_file(path: Path) -> Path:
    """The ``run-*.wandb`` file of an offline run directory (or the file itself)."""
    if path.is_file() and path.suffix == ".wandb":
        return path
    files = sorted(path.glob("run-*.wandb")) if path.is_dir() else []
    if len(files) != 1:
        found = sorted(p.name for p in path.iterdir())[:10] if path.is_dir() else "nothing"
        raise GradtrackError(
            f"{path} is not a W&B run directory (no single run-*.wandb file; found: {found})"
        )
    return files[0]


def iter_records(path: Path) -> Iterator[Any]:
    """Every protobuf record in a ``.wandb`` file, in order."""
    require_module("wandb", "wandb")
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise GradtrackError(f"{path} is not a W&B transaction log")
    pos, payload = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the rest of a block too small for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0:
            break
        payload += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(payload)
            payload = b""
            yield record


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


_SCALAR_FAMILIES = {*FAMILIES} - {"act_grad_norm"}


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
