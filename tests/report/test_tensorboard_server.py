"""TensorBoard's own server on loopback shows gradtrack's histograms: its histogram data holds
exactly gradtrack's bins (edges as float32), and in headless Chromium its histogram dashboard
draws one chart per gradtrack histogram tag, one outline per logged step."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.sinks import MemorySink
from tests.report.cdp import Chromium
from tests.sinks.mlflow_server import free_port

pytest.importorskip("tensorboard")
STEPS, HIST_EVERY = 12, 4
START_TIMEOUT_S = 90.0

# Every vz-histogram-timeseries chart in the page (shadow roots included): the tag its loader
# shows, and how many outlines (one per step) it drew.
CHARTS = """(() => {
  const deep = (root, found = []) => {
    for (const el of root.querySelectorAll('*')) {
      found.push(el);
      if (el.shadowRoot) deep(el.shadowRoot, found);
    }
    return found;
  };
  return deep(document)
    .filter(el => el.tagName.toLowerCase() === 'vz-histogram-timeseries')
    .map(chart => {
      const loader = chart.getRootNode().host;
      const outlines = deep(chart.shadowRoot || chart)
        .filter(el => el.tagName.toLowerCase() === 'path'
                      && (el.getAttribute('class') || '').includes('outline'));
      return {tag: loader ? loader.tag : null, outlines: outlines.length};
    });
})()"""


@pytest.fixture
def tensorboard_server(tmp_path: Path) -> Iterator[tuple[str, Path, MemorySink]]:
    """A run logged to TensorBoard, and TensorBoard serving it on 127.0.0.1 (stopped after)."""
    log_dir, memory = tmp_path / "runs" / "mlp", MemorySink()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradtrack.watch(
        model, backend=["tensorboard", memory], optimizer=optimizer, log_every=1,
        histograms={"every": HIST_EVERY, "bins": 24},
        tensorboard={"log_dir": str(log_dir), "pictures": False},
    ):  # fmt: skip
        for _ in range(STEPS):
            optimizer.zero_grad()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            optimizer.step()
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir.parent),
         "--host", "127.0.0.1", "--port", str(port), "--load_fast", "false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "grad_hist/0" not in json.dumps(_get(url, "/data/plugin/histograms/tags")):
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline, "TensorBoard did not serve the run in time"
            time.sleep(0.5)
        yield url, log_dir, memory
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=15)
        if server.stderr is not None:
            server.stderr.close()


def _get(url: str, path: str) -> Any:
    try:
        with urllib.request.urlopen(url + path, timeout=10) as response:
            return json.load(response)
    except (OSError, ValueError):
        return None


@pytest.mark.slow
def test_tensorboards_dashboard_shows_gradtracks_histograms(
    tensorboard_server: tuple[str, Path, MemorySink], tmp_path: Path
) -> None:
    url, _, memory = tensorboard_server
    histograms = memory.histograms()
    assert sorted(histograms) == ["0", "2"]
    logged_steps = list(range(0, STEPS, HIST_EVERY))
    # What the dashboard draws: TensorBoard's histogram data, bucket by bucket.
    for layer, series in histograms.items():
        query = urllib.parse.urlencode({"run": "mlp", "tag": f"grad_hist/{layer}"})
        served = _get(url, f"/data/plugin/histograms/histograms?{query}")
        assert [step for _, step, _ in served] == [s for s, _ in series] == logged_steps
        for (_, _, buckets), (_, histogram) in zip(served, series):
            assert [count for _, _, count in buckets] == histogram.counts.tolist()
            edges = [buckets[0][0], *(right for _, right, _ in buckets)]
            # TensorBoard serves a histogram's edges as float32 (data_compat): gradtrack's, rounded.
            assert edges == histogram.edges.astype(np.float32).tolist()

    browser = Chromium(f"{url}/#histograms", tmp_path / "profile")
    try:
        charts = browser.wait_for(
            f"(() => {{ const c = {CHARTS}; return c.length >= 2 && "
            f"c.every(x => x.outlines >= {len(logged_steps)}) ? c : null; }})()",
            timeout_s=60,
        )
        if charts is None:
            charts = browser.evaluate(CHARTS)
    finally:
        browser.close()
    assert sorted((c["tag"], c["outlines"]) for c in charts) == [
        ("grad_hist/0", len(logged_steps)), ("grad_hist/2", len(logged_steps)),
    ], charts  # fmt: skip
