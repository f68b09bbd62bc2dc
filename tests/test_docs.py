"""Every code block in the README and in docs/ runs, as a reader would run it.

A ```python block runs in a fresh interpreter, in an empty working directory, with W&B offline
and no MLflow or gradtrack variables set. README blocks must stand alone (a newcomer pastes
them as they are); a block in docs/ or benchmarks/ may use ``torch``, ``nn``, ``gradtrack``, a
small ``model`` and its ``optimizer``. A block that cannot run here says why in its info
string: ```python skip="…". ```bash blocks always say so (a package index, Docker, run ids
that stand for yours); ```text and ```json blocks show output, not code.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/README.md"]
DOCS_PRELUDE = """\
import torch
from torch import nn

import gradtrack

model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
"""
OUTPUT_LANGUAGES = ("text", "json")
FENCE = re.compile(r"^```(\S*)(.*?)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    options: dict[str, str]
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        options = dict(part.split("=", 1) for part in shlex.split(match.group(2)))
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, match.group(1), options, match.group(3)))
    return found


ALL = [block for page in PAGES for block in blocks(page)]
RUNNABLE = [b for b in ALL if b.language == "python" and "skip" not in b.options]


def test_every_block_runs_or_says_why_not() -> None:
    assert len(ALL) >= 15 and len(RUNNABLE) >= 7  # the parser found the blocks
    for block in ALL:
        assert block.language in ("python", "bash", *OUTPUT_LANGUAGES), block.name
        assert set(block.options) <= {"skip"}, block.name
        if block.language == "bash":
            assert len(block.options.get("skip", "")) > 20, f"{block.name}: say why it is not run"


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda block: block.name)
@pytest.mark.slow
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    prelude = "" if block.page.name == "README.md" and block.page.parent == ROOT else DOCS_PRELUDE
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "GRADTRACK_"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", prelude + block.code], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"{block.name}:\n{done.stderr[-3000:]}"


def test_readme_is_short_and_starts_with_install_quickstart_and_picture() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 15_000
    first = [b for b in ALL if b.page.name == "README.md" and b.page.parent == ROOT][:2]
    assert first[0].language == "bash" and first[0].code.startswith("pip install")
    assert first[1].language == "python" and len(first[1].code.splitlines()) <= 11
    assert readme.index("![") < readme.index("## Set up and run")
    assert (ROOT / "docs/report.png").stat().st_size > 10_000
    assert "bash scripts/demo.sh" in readme and "bash scripts/test.sh" in readme


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_links_between_pages_lead_to_files_and_headings(page: Path) -> None:
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.MULTILINE)
            assert anchor in {_anchor(h) for h in headings}, f"{page.name}: {target}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_api_md_names_every_option_backend_and_record_field() -> None:
    """docs/api.md is the reference: every config field (a section's as ``section.field`` or
    in its section's row; the alert rules in docs/alerts.md), every registered backend name
    and every `StepRecord` field appear in it, so a new one cannot go undocumented."""
    import dataclasses

    from pydantic import BaseModel

    from gradtrack.config import GradtrackConfig
    from gradtrack.formats.record import StepRecord

    api = (ROOT / "docs" / "api.md").read_text()
    alerts = (ROOT / "docs" / "alerts.md").read_text()
    rows = {  # each name in a table row's first cell -> that row
        name: line
        for line in api.splitlines()
        if line.startswith("| `")
        for name in re.findall(r"`([^`]+)`", line.split("|")[1])
    }
    missing = []
    for name, field in GradtrackConfig.model_fields.items():
        if name not in rows:
            missing.append(name)
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            continue
        for sub in section.model_fields:
            if name == "alerts":
                if sub != "layers" and f"`{sub}`" not in alerts:
                    missing.append(f"alerts.{sub} (docs/alerts.md)")
            elif f"`{name}.{sub}`" not in api and f"`{sub}`" not in rows.get(name, ""):
                missing.append(f"{name}.{sub}")
    # The backends gradtrack registers itself (a fresh interpreter: tests register their own).
    code = "import gradtrack.api, gradtrack.sinks.base as b; print(*b.registered_sinks())"
    builtin = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert builtin.returncode == 0 and builtin.stdout.split(), builtin.stderr
    missing += [f'backend "{b}"' for b in builtin.stdout.split() if f'"{b}"' not in api]
    missing += [
        f"StepRecord.{f.name}" for f in dataclasses.fields(StepRecord) if f"`{f.name}`" not in api
    ]
    assert missing == []
