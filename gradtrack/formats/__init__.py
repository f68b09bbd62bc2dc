"""What gradtrack writes into a tracker, named in one place: its sinks write it, its readers
(`gradtrack.report`) read it back; and `write_atomic`, how gradtrack replaces any whole file.

`metrics` names metrics and turns a step into them, `record` is a step, `event` an alert,
`histogram` the histograms and their files, `flight` the flight recorder's window file;
`wandb`, `mlflow` and `tensorboard` hold each tracker's own names (and their readers).
Nothing here imports a sink or the report package.

`write_atomic` is the one place gradtrack replaces a file: a journal, a report or a staged
artifact is the old version or the new, never half of either — to a reader or after a crash.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PARTIAL_SUFFIX = ".partial"


def write_atomic(
    path: str | os.PathLike[str], data: str | bytes, *, fsync: bool = True, encoding: str = "utf-8"
) -> Path:
    """Write ``data`` to ``path`` through ``<path>.partial`` and ``os.replace``: a reader sees
    the previous file or this one whole, and a crash mid-write leaves the previous one.

    ``fsync`` (the default) puts the data on disk before the rename, and the rename in its
    folder after it, so a power loss too leaves one whole version; without it a file is only
    atomic against other processes and crashes of this one. The folder is created if missing.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     target = write_atomic(Path(folder) / "journal.json", "[1]")
    ...     _ = write_atomic(target, b"[1, 2]", fsync=False)
    ...     print(target.read_text(), sorted(p.name for p in Path(folder).iterdir()))
    [1, 2] ['journal.json']
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + PARTIAL_SUFFIX)
    payload = data.encode(encoding) if isinstance(data, str) else data
    try:
        with open(partial, "wb") as file:
            file.write(payload)
            if fsync:
                file.flush()
                os.fsync(file.fileno())
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
    if fsync:
        _fsync_folder(target.parent)
    return target


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; Windows cannot open a folder, nor needs to)."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass  # some file systems refuse to sync a folder; the rename is still atomic
    finally:
        os.close(handle)
