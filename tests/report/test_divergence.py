"""First divergence and first non-finite step of real runs, from MLflow and from W&B."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from gradtrack.cli import read_run
from gradtrack.report.compare import first_divergence, rank_layers, summarise, to_json
from gradtrack.report.data import RunData
from tests.report.conftest import NAN_LAYER, NAN_STEP, NUDGE_STEP, NUDGED_LAYER, ThreeRuns


def compare_json(runs: ThreeRuns, *more: str) -> tuple[int, dict[str, Any], str]:
    ids = [runs.ids[name] for name in ("base", "nudged", "nan")]
    command = [sys.executable, "-m", "gradtrack.cli", "compare", *ids, "--json",
               "--tracking-uri", runs.uri, *more]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout), result.stderr


@pytest.mark.slow
def test_compare_json_names_the_nudged_step_and_layer_and_the_nan_step(
    three_runs: ThreeRuns,
) -> None:
    code, summary, stderr = compare_json(three_runs)
    assert code == 0
    # No download progress bars; off a terminal, at most a line every 5 s of a long read
    # (there are some only on a machine so busy that reading takes that long).
    assert all(line.startswith("gradtrack: reading ") for line in stderr.splitlines()), stderr
    base, nudged, nan = summary["runs"]
    assert [r["name"] for r in summary["runs"]] == ["base", "nudged", "nan"]
    assert [r["id"] for r in summary["runs"]] == list(three_runs.ids.values())
    assert base["first_nonfinite"] is None and nudged["first_nonfinite"] is None
    assert nan["first_nonfinite"] == NAN_STEP
    assert nan["first_nonfinite_layer"] == NAN_LAYER
    assert nan["alerts"]["by_rule"]["nonfinite"] >= 1 and base["alerts"]["total"] == 0
    assert base["steps"] == {"logged": 20, "first": 0, "last": 38, "per_layer": 4}
    assert all(r["source"].startswith("MLflow run ") and r["layers"] == 4 for r in summary["runs"])

    pairs = {(p["a"]["name"], p["b"]["name"]): p for p in summary["pairs"]}
    assert list(pairs) == [("base", "nudged"), ("base", "nan"), ("nudged", "nan")]
    parted = pairs["base", "nudged"]["first_divergence"]
    assert parted["step"] == NUDGE_STEP and parted["layer"] == NUDGED_LAYER
    # Only the nudged layer parts at that step: every other gradient was still bit-identical.
    assert parted["layers"] == [NUDGED_LAYER] and parted["layer_step"] == NUDGE_STEP
    assert parted["identical_until"] == NUDGE_STEP - 2 and parted["kind"] == "value"
    a, b = parted["values"]
    assert b == pytest.approx(1.5 * a, rel=1e-6)
    assert parted["statistic"] == "grad_norm"  # every statistic moved ×1.5: the norm is named
    text = pairs["base", "nudged"]["text"]
    assert "identical up to step 28, then part at step 30 in layer 2" in text

    broken = pairs["base", "nan"]["first_divergence"]
    assert broken["step"] == NAN_STEP and broken["kind"] == "nonfinite"
    assert broken["layer"] == NAN_LAYER and broken["values"][1] == "NaN"
    assert broken["decades"] == "Infinity"  # strict JSON: non-finite numbers as strings

    ranking = summary["ranking"]
    # NaN counts as the strongest difference, never as 0.00: the layer where it appeared
    # leads; the others went NaN after the update, by the next per-layer step (30).
    assert all(entry["kind"] == "nonfinite" for entry in ranking)
    assert (ranking[0]["layer"], ranking[0]["first_step"]) == (NAN_LAYER, NAN_STEP)
    assert [e["first_step"] for e in ranking[1:]] == [30, 30, 30]


@pytest.mark.slow
def test_parity_is_exact_and_fails_only_when_runs_part(three_runs: ThreeRuns) -> None:
    code, summary, _ = compare_json(three_runs, "--parity")
    assert code == 1 and summary["rtol"] == 0.0
    assert summary["pairs"][0]["first_divergence"]["step"] == NUDGE_STEP
    base = three_runs.ids["base"]
    same = [sys.executable, "-m", "gradtrack.cli", "compare", base, base, "--parity", "--json",
            "--tracking-uri", three_runs.uri]  # fmt: skip
    result = subprocess.run(same, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (pair,) = json.loads(result.stdout)["pairs"]
    assert pair["first_divergence"] is None and "never part" in pair["text"]


@pytest.mark.slow
def test_wandb_runs_give_the_same_findings(three_runs: ThreeRuns) -> None:
    from_mlflow = [read_run(three_runs.ids[n], three_runs.uri) for n in ("base", "nudged", "nan")]
    from_wandb = [read_run(str(three_runs.dirs[n]), None) for n in ("base", "nudged", "nan")]
    assert [r.name for r in from_wandb] == ["base", "nudged", "nan"]
    assert from_wandb[0].run_id == three_runs.dirs["base"].name.rpartition("-")[2]
    for runs in (from_mlflow, from_wandb):
        divergence = first_divergence(runs[0], runs[1])
        assert divergence is not None
        assert (divergence.step, divergence.layer) == (NUDGE_STEP, NUDGED_LAYER)
        found = runs[2].first_nonfinite()
        assert found is not None and found[:2] == (NAN_STEP, NAN_LAYER)
        assert runs[0].first_nonfinite() is None
    json_mlflow, json_wandb = to_json(summarise(from_mlflow)), to_json(summarise(from_wandb))
    assert json_mlflow["pairs"][0]["first_divergence"] == json_wandb["pairs"][0]["first_divergence"]
    assert json_mlflow["ranking"] == json_wandb["ranking"]
    # NaN read back as NaN, not as "not logged", from both trackers.
    for run in (from_mlflow[2], from_wandb[2]):
        row = int(np.searchsorted(run.steps, NAN_STEP + 10))
        assert run.logged_mask()[row].all() and np.isnan(run.norms[row]).all()


def runs_with(norms: list[list[float]], logged: list[list[bool]] | None = None) -> RunData:
    table = np.array(norms, dtype=float)
    steps = np.arange(len(norms)) * 10
    mask = np.ones(table.shape, dtype=bool) if logged is None else np.array(logged)
    return RunData(
        "r", "", steps, [f"l{j}" for j in range(table.shape[1])], {"grad_norm": table},
        np.ones(len(norms)), logged={"grad_norm": mask},
    )  # fmt: skip


def test_tolerance_decides_what_parts() -> None:
    base = runs_with([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    close = runs_with([[1.0, 1.0], [1.0, 1.0 + 1e-6], [1.0, 1.5]])
    assert first_divergence(base, close, rtol=0.0).step == 10  # exact: any bit counts
    assert first_divergence(base, close).step == 20  # default 1e-4 ignores reduction noise
    assert first_divergence(base, close, rtol=1.0) is None


def test_zero_and_nan_are_differences_and_not_logged_is_none() -> None:
    base = runs_with([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    dead = runs_with([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    found = first_divergence(base, dead)
    assert (found.step, found.layer, found.kind) == (10, "l1", "zero")
    # A value that was never logged is no evidence either way.
    logged = [[True, True], [True, False], [True, True]]
    gap = runs_with([[1.0, 1.0], [1.0, np.nan], [1.0, 1.0]], logged)
    assert first_divergence(base, gap) is None
    broken = runs_with([[1.0, 1.0], [1.0, np.nan], [1.0, 1.0]])  # NaN logged: a NaN gradient
    assert first_divergence(base, broken).kind == "nonfinite"
    ranked = rank_layers([base, dead])
    found_ranks = [(d.layer, d.kind, d.first_step) for d in ranked]
    assert found_ranks == [("l1", "zero", 10), ("l0", None, None)]
