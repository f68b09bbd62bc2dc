"""Shared helpers: an independent reference for every statistic, computed from ``p.grad``."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from gradtrack.formats.record import ABS_STATS, STAT_COLUMNS, StepRecord
from tests.sinks.mlflow_server import MlflowServer


def reference_stats(grads: Iterable[torch.Tensor]) -> dict[str, float]:
    """Straightforward fp64 statistics of the concatenated dense gradients."""
    flat = torch.cat([g.to_dense().double().reshape(-1) for g in grads])
    if flat.numel() == 0:
        return dict.fromkeys(STAT_COLUMNS, 0.0)
    abs_ = flat.abs()
    return {
        "norm": math.sqrt(float((flat * flat).sum())),
        "max_abs": float(abs_.max()),
        "mean_abs": float(abs_.mean()),
        "rms": math.sqrt(float((flat * flat).mean())),
        "numel": float(flat.numel()),
        "nan": float(flat.isnan().sum()),
        "inf": float(flat.isinf().sum()),
    }


def assert_record_matches(
    record: StepRecord, expected: dict[str, dict[str, float]], rtol: float = 1e-6
) -> None:
    """Every statistic as expected; max and mean |g| NaN where the record did not compute
    them (steps that are not per-layer steps, see ``layer_every``)."""
    assert record.layers == tuple(expected)
    for row, (layer, stats) in zip(record.stats, expected.items()):
        got = dict(zip(STAT_COLUMNS, row.tolist()))
        if not record.abs_stats:
            stats = {**stats, **dict.fromkeys(ABS_STATS, math.nan)}
        for name in STAT_COLUMNS:
            np.testing.assert_allclose(
                got[name], stats[name], rtol=rtol, atol=0, equal_nan=True,
                err_msg=f"{layer}.{name}",
            )  # fmt: skip


class SmallCNN(nn.Sequential):
    """The quickstart CNN."""

    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
        )  # fmt: skip


@pytest.fixture
def cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN()


def cnn_batch(batch_size: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, 32, 32, generator=generator)
    return images, torch.randint(10, (batch_size,), generator=generator)


class NoUpdate(torch.optim.Optimizer):
    """A real optimizer whose step changes nothing: injected NaN never reaches the weights."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        super().__init__(params, defaults={})

    def step(self, closure: object = None) -> None:
        return None


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models train on one thread: on a shared machine competing threads slow them
    many times over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One real `mlflow server` (sqlite store, local artifacts) for the whole test session."""
    pytest.importorskip("mlflow")
    root: Path = tmp_path_factory.mktemp("mlflow-server")
    server = MlflowServer(f"sqlite:///{root / 'mlflow.db'}", root).start()
    yield server
    server.stop()


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B in offline mode writing under ``tmp_path`` (also the working directory); the run
    left open by the test is finished and W&B's service torn down afterwards."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()


def watch_without(module: str) -> str:
    """What ``gradtrack.watch(backend=module)`` says in a fresh process where ``module`` is not
    importable (a real interpreter, with the package hidden from the import system)."""
    return run_without(
        [module],
        f"""
        import torch, gradtrack
        try:
            gradtrack.watch(torch.nn.Linear(2, 2), backend={module!r})
        except gradtrack.GradtrackError as error:
            print(error)
        """,
    )


def run_without(modules: list[str], code: str) -> str:
    """The output of ``code`` run in a fresh interpreter where ``modules`` are hidden from the
    import system (not installed, as far as the code can tell)."""
    hide = textwrap.dedent(
        f"""
        import importlib.util, sys
        real = importlib.util.find_spec
        hidden = {modules!r}
        importlib.util.find_spec = lambda n, p=None: None if n in hidden else real(n, p)
        for name in hidden:
            sys.modules[name] = None
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", hide + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


# Spools of session-wide fixtures (set up before any test's own folder exists) go here.
os.environ["GRADTRACK_SPOOL_DIR"] = tempfile.mkdtemp(prefix="gradtrack-test-spool-")


@pytest.fixture(autouse=True)
def spool_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's spools in its own folder, never in the user's ~/.cache."""
    root = tmp_path / "spool"
    monkeypatch.setenv("GRADTRACK_SPOOL_DIR", str(root))
    return root


@pytest.fixture(autouse=True)
def mlflow_globals_reset() -> Iterator[None]:
    """MLflow's fluent API keeps process-wide state — the active run (per thread), the
    tracking URI and experiment set by ``set_tracking_uri``/``set_experiment`` (Hugging Face's
    MLflowCallback sets both). A test must not hand any of it to the next test's watcher."""
    yield
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return
    from mlflow.tracking import fluent

    while mlflow.active_run() is not None:
        try:
            mlflow.end_run()
        except Exception:  # its store is gone with the test's folder
            fluent._active_run_stack.get().clear()
    fluent._active_experiment_id = None
    mlflow.set_tracking_uri(None)


class Told:
    """The faults gradtrack reported (WARNING and above of its logger), each as its text:
    `gradtrack.log.report` tells a fault once, as a log record, not also as a warning."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self._caplog = caplog
        caplog.set_level(logging.WARNING, logger="gradtrack")

    @property
    def messages(self) -> list[str]:
        return [
            r.getMessage()
            for r in self._caplog.records
            if r.name == "gradtrack" and r.levelno >= logging.WARNING
        ]

    def count(self, text: str) -> int:
        return sum(text in m for m in self.messages)


@pytest.fixture
def told(caplog: pytest.LogCaptureFixture) -> Told:
    return Told(caplog)


@contextlib.contextmanager
def reported() -> Iterator[list[str]]:
    """The faults gradtrack reports while inside (WARNING and above of its logger), as texts:
    for helpers and the workers of multi-process tests, where `told` does not reach."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("gradtrack")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
