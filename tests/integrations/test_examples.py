"""The integration examples run as a user runs them (few steps); without their framework the
integrations say what to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_without

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("script", "layer", "logged"),
    [
        # Lightning logs step s where (s + 1) % log_every_n_steps (10) == 0: so does gradtrack.
        ("lightning_callback.py", "net.2", 9),
        # The Trainer numbers its steps from 1: global_step 10 is gradtrack's step 10.
        ("hf_trainer.py", "transformer.h.1.attn.c_attn", 10),
    ],
)
@pytest.mark.slow
def test_example_runs(script: str, layer: str, logged: int, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--steps", "12"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"gradtrack step {logged}:" in result.stdout and layer in result.stdout


@pytest.mark.parametrize(
    ("module", "hidden", "extra"),
    [
        ("lightning", ["lightning", "pytorch_lightning"], "gradtrack[lightning]"),
        ("transformers", ["transformers"], "gradtrack[transformers]"),
    ],
)
@pytest.mark.slow
def test_a_missing_framework_names_the_extra_to_install(
    module: str, hidden: list[str], extra: str
) -> None:
    said = run_without(
        hidden,
        f"""
        import gradtrack
        try:
            import gradtrack.integrations.{module}
        except gradtrack.GradtrackError as error:
            print(error)
        """,
    )
    assert f"pip install {extra}" in said
