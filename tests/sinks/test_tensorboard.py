"""The TensorBoard sink with the real ``tensorboard`` package: what TensorBoard's own event
reader (``EventAccumulator``) reads back from the log dir."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.sinks import MemorySink, TensorboardSink, registered_sinks
from tests.conftest import watch_without
from tests.sinks.wandb_records import run_python

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.util import tensor_util
from torch.utils.tensorboard import SummaryWriter

STEPS, NAN_STEP = 24, 9


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The skip rule's journal (skipped_steps.json) goes to the working directory."""
    monkeypatch.chdir(tmp_path)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
    )


def train(backend: Any, steps: int = STEPS, **options: Any) -> gradtrack.Watcher:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    # The NaN step's update is skipped: the run goes on healthy, histograms and all.
    options = {"alerts": {"nonfinite": {"action": "skip"}}, **options}
    with gradtrack.watch(model, backend=backend, optimizer=optimizer, **options) as watcher:
        for step in range(steps):
            optimizer.zero_grad()
            model(torch.randn(16, 8, generator=generator)).pow(2).mean().backward()
            if step == NAN_STEP:
                model[2].weight.grad[0, 0] = float("nan")
            optimizer.step()
    return watcher


def events(log_dir: Path) -> Any:
    """TensorBoard's own reader, every event kept."""
    keep_all = {kind: 0 for kind in (ea.SCALARS, ea.HISTOGRAMS, ea.TENSORS, ea.IMAGES)}
    accumulator = ea.EventAccumulator(str(log_dir), size_guidance=keep_all)
    accumulator.Reload()
    return accumulator


def scalars(acc: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def texts(acc: Any, tag: str) -> list[tuple[int, str]]:
    return [
        (e.step, tensor_util.make_ndarray(e.tensor_proto).reshape(-1)[0].decode())
        for e in acc.Tensors(f"{tag}/text_summary")
    ]


@pytest.mark.parametrize("scale", ["linear", "log"])
def test_every_key_at_every_step_and_histograms_are_gradtracks_bins(
    tmp_path: Path, scale: str, in_tmp: None
) -> None:
    memory = MemorySink()
    train(
        ["tensorboard", memory], log_every=2, layer_every=4, spool=False,
        histograms={"every": 4, "scale": scale, "bins": 16},
        tensorboard={"log_dir": str(tmp_path / "tb"), "pictures": False},
    )  # fmt: skip
    acc = events(tmp_path / "tb")

    expected = memory.scalars()
    assert len(expected) > 20  # totals, per-layer families, update signals
    found = {tag for tag in acc.Tags()["tensors"] if not tag.endswith("/text_summary")}
    assert found == set(expected)
    for key, series in expected.items():
        read = scalars(acc, key)
        assert [s for s, _ in read] == [s for s, _ in series], key
        np.testing.assert_array_equal([v for _, v in read], [v for _, v in series])  # doubles
    assert any(np.isnan(v) for _, v in scalars(acc, "grad/total_norm"))  # the NaN step
    assert [v for s, v in scalars(acc, "grad_nan/2") if s == NAN_STEP] == [1.0]

    histograms = memory.histograms()
    assert sorted(acc.Tags()["histograms"]) == sorted(f"grad_hist/{k}" for k in histograms)
    for layer, series in histograms.items():
        read = acc.Histograms(f"grad_hist/{layer}")
        assert [e.step for e in read] == [s for s, _ in series] == list(range(0, STEPS, 4))
        for event, (_, histogram) in zip(read, series):
            value = event.histogram_value
            assert list(value.bucket) == histogram.counts.tolist()
            assert [value.min, *value.bucket_limit] == histogram.edges.tolist()
            assert value.max == histogram.edges[-1] and value.num == histogram.counts.sum()


@pytest.mark.slow
def test_alerts_are_text_summaries_and_pictures_are_images(tmp_path: Path, in_tmp: None) -> None:
    pytest.importorskip("matplotlib")
    memory = MemorySink()
    train(["tensorboard", memory], log_every=1, tensorboard={"log_dir": str(tmp_path)})
    acc = events(tmp_path)

    alerts = texts(acc, "gradtrack/alerts")
    assert [e.step for e in memory.events] == [s for s, _ in alerts]
    nonfinite = [text for step, text in alerts if step == NAN_STEP]
    assert nonfinite and nonfinite[0].startswith(f"error · nonfinite · step {NAN_STEP}: ")
    assert texts(acc, "gradtrack/layers")[-1][1] == '["0", "2", "4"]'
    images = acc.Tags()["images"]
    assert {"grad_pictures/total_norm", "grad_pictures/flow_profile"} <= set(images)
    (picture,) = acc.Images("grad_pictures/total_norm")
    assert picture.step == STEPS - 1 and picture.width > 300 and picture.height > 200
    assert picture.encoded_image_string.startswith(b"\x89PNG")


def test_a_summary_writer_passed_as_backend_is_written_through_and_left_open(
    tmp_path: Path, in_tmp: None
) -> None:
    writer = SummaryWriter(log_dir=str(tmp_path))
    watcher = train(writer, log_every=3, tensorboard={"pictures": False})
    (sink,) = watcher.sinks
    assert isinstance(sink, TensorboardSink) and sink.writer is writer
    writer.add_scalar("user/after_close", 1.0, 100)  # still the user's, still open
    writer.close()
    acc = events(tmp_path)
    assert [s for s, _ in scalars(acc, "grad/total_norm")] == list(range(0, STEPS, 3))
    assert [e.step for e in acc.Scalars("user/after_close")] == [100]


@pytest.mark.slow
def test_default_log_dir_is_summary_writers_and_model_name_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    watcher = train("tensorboard", log_every=4, model_name="critic", histograms={"every": 8})
    (log_dir,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"[A-Z][a-z]{2}\d\d_\d\d-\d\d-\d\d_.+", log_dir.name)
    assert watcher.sinks[0].log_dir == Path("runs", log_dir.name)  # type: ignore[attr-defined]
    tags = events(log_dir).Tags()
    assert "grad/critic/total_norm" in tags["tensors"] and "grad_norm/critic/0" in tags["tensors"]
    assert "grad_hist/critic/0" in tags["histograms"]


@pytest.mark.slow
def test_without_the_extra_the_error_names_it() -> None:
    assert "pip install gradtrack[tensorboard]" in watch_without("tensorboard")


CHILD = """
    import torch, gradtrack
    from gradtrack.sinks import MemorySink
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    memory = MemorySink()
    watcher = gradtrack.watch(model, backend=["tensorboard", memory], optimizer=optimizer,
                              log_every=1, histograms={{"every": 5}},
                              tensorboard={{"log_dir": {log_dir!r}, "pictures": False}})
    {before}
    for step in range({steps}):
        optimizer.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        optimizer.step()
    print("trained", {steps})
    # no close(): the open watcher is closed at exit
    import atexit
    atexit.register(lambda: print("memory", len(memory.records)))
"""


@pytest.mark.slow
def test_exit_without_close_loses_nothing(tmp_path: Path) -> None:
    code = CHILD.format(log_dir=str(tmp_path / "tb"), steps=400, before="")
    result = run_python(textwrap.dedent(code), tmp_path, timeout_s=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 400" in result.stdout
    acc = events(tmp_path / "tb")
    assert [s for s, _ in scalars(acc, "grad/total_norm")] == list(range(400))
    assert [e.step for e in acc.Histograms("grad_hist/0")] == list(range(0, 400, 5))


@pytest.mark.slow
def test_a_full_disk_is_reported_once_and_training_goes_on(tmp_path: Path) -> None:
    """The event file may grow to 64 KiB only (RLIMIT_FSIZE: the write fails with EFBIG, as
    a full disk fails it with ENOSPC): one warning, training ends normally, the other sink
    gets every step."""
    before = (
        "import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))"
    )
    code = CHILD.format(log_dir=str(tmp_path / "tb"), steps=400, before=before)
    result = run_python(textwrap.dedent(code), tmp_path, timeout_s=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 400" in result.stdout and "memory 400" in result.stdout
    # Once, in gradtrack's log: not repeated as a warning, nor as the traceback of
    # TensorBoard's writer thread, which the same error ended.
    assert result.stderr.count("gradtrack sink TensorboardSink.write failed") == 1, result.stderr
    assert result.stderr.count("cannot write TensorBoard events") == 1
    assert result.stderr.count("File too large") == 1, result.stderr
    assert "RuntimeWarning" not in result.stderr and "Traceback" not in result.stderr
    (events_file,) = (tmp_path / "tb").glob("*tfevents*")
    assert events_file.stat().st_size <= 64 * 1024


def test_the_tensorboard_section_comes_from_the_environment_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_tmp: None
) -> None:
    monkeypatch.setenv("GRADTRACK_TENSORBOARD__LOG_DIR", str(tmp_path / "from-env"))
    assert "tensorboard" in registered_sinks()
    train("tensorboard", log_every=4, tensorboard={"pictures": False}, histograms=False)
    acc = events(tmp_path / "from-env")
    assert [s for s, _ in scalars(acc, "grad/total_norm")] == [0, 4, 8, NAN_STEP, 12, 16, 20]
