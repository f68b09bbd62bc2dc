"""`write_atomic`: the target is the old version or the new one whole, never a torn one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gradtrack import formats
from gradtrack.formats import write_atomic


def test_the_new_version_replaces_the_old_whole_and_no_partial_file_remains(
    tmp_path: Path,
) -> None:
    target = tmp_path / "deep" / "journal.json"  # the folder is made
    write_atomic(target, "old")
    assert write_atomic(target, "new" * 1000) == target
    assert target.read_text() == "new" * 1000
    write_atomic(target, b"\x00bytes", fsync=False)
    assert target.read_bytes() == b"\x00bytes"
    assert [p.name for p in target.parent.iterdir()] == ["journal.json"]


def test_a_crash_before_the_rename_leaves_the_previous_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "journal.json"
    write_atomic(target, "[1]")

    def crash(*_: object) -> None:
        raise KeyboardInterrupt  # (BaseException: a Ctrl-C mid-write cleans up too)

    monkeypatch.setattr(formats.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, "[1, 2]")
    assert target.read_text() == "[1]"
    assert [p.name for p in tmp_path.iterdir()] == ["journal.json"]


def test_a_failed_write_leaves_the_previous_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "report.html"
    write_atomic(target, "<p>old</p>")

    def disk_full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(formats.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        write_atomic(target, "<p>new</p>")
    assert target.read_text() == "<p>old</p>"
    assert os.listdir(tmp_path) == ["report.html"]
