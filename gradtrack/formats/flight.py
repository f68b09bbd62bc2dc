"""A flight recorder's window (`FlightWindow`): every layer's gradient norm at each step
before an incident, and the file trackers keep it in (written by sinks, read by report).

The file is one JSON object, ``flight/window-<incident step>.json`` among a run's artifacts
(MLflow) or files (W&B): ``{"incident": ..., "incident_step": ..., "layers": [...],
"steps": [...], "norms": [[per layer] per step], "first_mover": ..., ...}``; NaN and ±Inf
are JSON's ``NaN``/``Infinity`` extensions, which Python's ``json`` reads back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

FLIGHT_DIR = PurePosixPath("gradtrack", "flight")
WINDOW_PREFIX = "window-"
WINDOW_SUFFIX = ".json"


@dataclass(frozen=True)
class FlightWindow:
    """The recorded steps before (and at) one incident.

    ``norms`` is float32 ``[steps, layers]`` (NaN where a layer had no gradient);
    ``logged`` says at which steps the per-layer norms already reached the trackers (they
    are not sent twice as series). ``incident``: the rule that fired (``nonfinite``,
    ``spike``, ``exploding``, a skip rule's name) or how training ended (``FAILED``,
    ``KILLED``). ``first_mover``: the layer whose norm left its own running range first,
    at ``first_mover_step`` (`gradtrack.worker.flight_log`), None if none did before it.
    """

    incident: str
    incident_step: int
    layers: tuple[str, ...]
    steps: np.ndarray  # int64 [steps]
    norms: np.ndarray  # float32 [steps, layers]
    logged: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    first_mover: str | None = None
    first_mover_step: int | None = None
    first_mover_direction: str | None = None  # "rising" or "falling"
    message: str = ""

    @property
    def nbytes(self) -> int:
        return int(self.norms.nbytes)


def window_name(window: FlightWindow) -> str:
    """The window's file name: sorted by name is sorted by incident step.

    >>> window_name(FlightWindow("nonfinite", 517, (), np.zeros(0), np.zeros((0, 0))))
    'window-000000517.json'
    """
    return f"{WINDOW_PREFIX}{window.incident_step:09d}{WINDOW_SUFFIX}"


def is_window(path: str | PurePosixPath) -> bool:
    """A window file of gradtrack's, given its path inside a run's files or artifacts.

    >>> is_window("gradtrack/flight/window-000000517.json"), is_window("gradtrack/a.json")
    (True, False)
    """
    posix = PurePosixPath(str(path).replace("\\", "/"))
    return (
        FLIGHT_DIR.name in posix.parts
        and posix.name.startswith(WINDOW_PREFIX)
        and posix.name.endswith(WINDOW_SUFFIX)
    )


def window_text(window: FlightWindow) -> str:
    """The window as its file's JSON text (`read_window` reads it back equal)."""
    body: dict[str, Any] = {
        "incident": window.incident,
        "incident_step": window.incident_step,
        "layers": list(window.layers),
        "steps": window.steps.astype(np.int64).tolist(),
        "norms": window.norms.astype(np.float64).tolist(),
        "logged": window.logged.astype(bool).tolist(),
        "first_mover": window.first_mover,
        "first_mover_step": window.first_mover_step,
        "first_mover_direction": window.first_mover_direction,
        "message": window.message,
    }
    return json.dumps(body, separators=(",", ":"))


def read_window(text: str) -> FlightWindow:
    """A window from its file's text.

    >>> window = FlightWindow("spike", 9, ("fc",), np.array([8, 9]), np.ones((2, 1), np.float32))
    >>> read_window(window_text(window)).steps.tolist()
    [8, 9]
    """
    body = json.loads(text)
    layers = tuple(body["layers"])
    norms = np.asarray(body["norms"], dtype=np.float32).reshape(-1, len(layers))
    return FlightWindow(
        incident=str(body["incident"]),
        incident_step=int(body["incident_step"]),
        layers=layers,
        steps=np.asarray(body["steps"], dtype=np.int64),
        norms=norms,
        logged=np.asarray(body.get("logged", []), dtype=bool),
        first_mover=body.get("first_mover"),
        first_mover_step=body.get("first_mover_step"),
        first_mover_direction=body.get("first_mover_direction"),
        message=str(body.get("message", "")),
    )


def read_windows_dir(files_dir: Path) -> list[FlightWindow]:
    """Every window file under a run's files (or downloaded artifacts) folder, by step."""
    paths = sorted((files_dir / FLIGHT_DIR).rglob(f"{WINDOW_PREFIX}*{WINDOW_SUFFIX}"))
    return [read_window(path.read_text(encoding="utf-8")) for path in paths]
