"""A run's durable spool: every record and alert on local disk before any tracker sees it.

The worker appends each item (a `StepRecord` or an `AlertEvent`) the moment it is built; one
courier per tracker sink reads them back in order and moves that sink's cursor once the
tracker really has them. A frozen, killed or late server, a locked database or a process
that dies therefore loses nothing: what a sink has not confirmed stays on disk, and
``gradtrack sync PATH`` delivers it later, from the cursor on.

On disk, one folder per run::

    spool.json          the sinks it was meant for (backend and how to reach the run again)
    seg-<seq>.log       items in frames: seq, length, CRC32, then a restricted pickle
    <sink>.cursor       the last seq that sink's tracker confirmed

Segments every sink has passed are deleted; a run whose sinks confirmed everything leaves
nothing behind. Past ``max_bytes`` of undelivered items new items are dropped and counted:
the only way the spool loses anything.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import pickle
import re
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_FRAME = struct.Struct("<QII")  # seq, payload length, CRC32 of the payload
_META = "spool.json"
_SERIAL = itertools.count()  # several runs of one process never share a folder
SEGMENT_BYTES = 8 << 20


def default_root() -> Path:
    """``$GRADTRACK_SPOOL_DIR``, else ``$XDG_CACHE_HOME/gradtrack/spool`` (``~/.cache/…``)."""
    explicit = os.environ.get("GRADTRACK_SPOOL_DIR")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "gradtrack" / "spool"


@dataclass(frozen=True)
class Item:
    seq: int
    payload: Any  # a StepRecord or an AlertEvent


class SpoolError(Exception):
    """A spool folder that cannot be read (not a spool, or written by a newer gradtrack)."""


class Spool:
    """One run's append-only log and its sinks' cursors. Appends come from one thread (the
    worker); each cursor is read and moved by one courier."""

    def __init__(self, path: Path, max_bytes: int, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.dropped = 0
        self._lock = threading.Lock()
        self._segments: list[tuple[int, Path]] = []  # (first seq, file), oldest first
        self._cursors: dict[str, int] = {}
        self._bytes = 0
        self._next_seq = 1
        self._writer: io.BufferedWriter | None = None
        self._lock_file = _hold_lock(path)
        self._load()

    # -- creating and opening --------------------------------------------------------------
    @classmethod
    def create(
        cls, root: Path, name: str, sinks: dict[str, dict[str, Any]], max_bytes: int
    ) -> Spool:
        """A new spool folder under ``root`` for the ``sinks`` (id → how to reach the run)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
        path = root / f"{stamp}-{name}-{os.getpid()}-{next(_SERIAL)}"
        path.mkdir(parents=True, exist_ok=False)
        (path / _META).write_text(json.dumps({"version": 1, "sinks": sinks}, indent=1))
        spool = cls(path, max_bytes)
        for sink_id in sinks:
            spool.confirm(sink_id, 0)
        return spool

    @staticmethod
    def meta_of(path: Path) -> dict[str, Any]:
        """``spool.json``: the sinks this spool was meant for (id → how to reach the run)
        and, once known, how training ended (``outcome``)."""
        try:
            meta = json.loads((path / _META).read_text())
        except (OSError, ValueError) as exc:
            raise SpoolError(f"{path} is not a gradtrack spool ({exc})") from exc
        if not isinstance(meta, dict) or meta.get("version") != 1:
            raise SpoolError(f"{path} was not written by this version of gradtrack")
        return meta

    def _load(self) -> None:
        for file in sorted(self.path.glob("seg-*.log")):
            self._segments.append((int(file.stem.removeprefix("seg-")), file))
            self._bytes += file.stat().st_size
        for file in self.path.glob("*.cursor"):
            self._cursors[file.stem] = int(file.read_text() or 0)
        last = max((item.seq for item in self._read_segment(-1)), default=0)
        self._next_seq = max(last, self._segments[-1][0] - 1 if self._segments else 0) + 1

    # -- the worker's side -----------------------------------------------------------------
    def append(self, payload: Any) -> int | None:
        """Write one item; its seq, or None if the spool is full (the item is dropped)."""
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._bytes + len(data) > self.max_bytes and self._bytes > 0:
                self.dropped += 1
                return None
            seq = self._next_seq
            writer = self._writer_for(seq)
            writer.write(_FRAME.pack(seq, len(data), zlib.crc32(data)))
            writer.write(data)
            writer.flush()  # into the OS: a crash of this process loses nothing after here
            self._bytes += _FRAME.size + len(data)
            self._next_seq += 1
            return seq

    def _writer_for(self, seq: int) -> io.BufferedWriter:
        if self._writer is not None and self._writer.tell() < self.segment_bytes:
            return self._writer
        if self._writer is not None:
            self._writer.close()
        file = self.path / f"seg-{seq:020d}.log"
        self._segments.append((seq, file))
        self._writer = open(file, "ab")
        return self._writer

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._next_seq - 1

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if self._lock_file is not None:
                self._lock_file.close()  # releases the lock
                self._lock_file = None

    # -- a courier's side ------------------------------------------------------------------
    def reader(self, after: int) -> Reader:
        """Reads the items after seq ``after`` in order, picking up where it stopped."""
        return Reader(self, after)

    def segments_from(self, seq: int) -> list[tuple[int, Path]]:
        """The segments that may hold ``seq`` and later items, oldest first."""
        with self._lock:
            segments = list(self._segments)
        keep = [i for i, (first, _) in enumerate(segments) if first <= seq]
        return segments[keep[-1] if keep else 0 :]

    def cursor(self, sink_id: str) -> int:
        with self._lock:
            return self._cursors.get(sink_id, 0)

    def confirm(self, sink_id: str, seq: int) -> None:
        """The sink's tracker has every item through ``seq``: persist it, and delete the
        segments every sink has passed."""
        file = self.path / f"{sink_id}.cursor"
        partial = file.with_suffix(".partial")
        partial.write_text(str(seq))
        os.replace(partial, file)
        with self._lock:
            self._cursors[sink_id] = seq
            done = min(self._cursors.values())
            while len(self._segments) > 1 and self._segments[1][0] <= done + 1:
                _, old = self._segments.pop(0)
                self._bytes -= old.stat().st_size
                old.unlink()

    def describe(self, sink_id: str, target: dict[str, Any]) -> None:
        """Record how ``gradtrack sync`` reaches this sink's run (e.g. once its id is known)."""
        self._update_meta(lambda meta: meta["sinks"].__setitem__(sink_id, target))

    def note_outcome(self, outcome: str) -> None:
        """How training ended: a run gradtrack started is ended so once delivered."""
        self._update_meta(lambda meta: meta.__setitem__("outcome", outcome))

    def _update_meta(self, change: Any) -> None:
        with self._lock:
            meta = json.loads((self.path / _META).read_text())
            change(meta)
            partial = self.path / (_META + ".partial")
            partial.write_text(json.dumps(meta, indent=1))
            os.replace(partial, self.path / _META)

    def undelivered(self) -> int:
        """Items some sink has not confirmed."""
        with self._lock:
            return self._next_seq - 1 - min(self._cursors.values(), default=self._next_seq - 1)

    def remove(self) -> None:
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)

    def _read_segment(self, index: int) -> Iterator[Item]:
        if not self._segments:
            return iter(())
        return Reader(self, 0, self._segments[index:]).items()


class Reader:
    """One courier's position in a spool: segment and byte offset of the next frame."""

    def __init__(
        self, spool: Spool, after: int, segments: list[tuple[int, Path]] | None = None
    ) -> None:
        self._spool = spool
        self._after = after
        self._segments = segments
        self._file: Path | None = None
        self._offset = 0

    @property
    def position(self) -> int:
        """The seq of the last item read (or skipped as already delivered)."""
        return self._after

    def items(self, limit: int | None = None, through: int | None = None) -> Iterator[Item]:
        """Up to ``limit`` items not yet read, up to seq ``through``. A frame not yet whole
        (being appended, or torn by a killed process) ends the read; the next call tries it
        again."""
        count = 0
        while (limit is None or count < limit) and (through is None or self._after < through):
            frame = self._next_frame()
            if frame is None:
                return
            if frame.seq > self._after:
                self._after = frame.seq
                count += 1
                yield frame

    def _next_frame(self) -> Item | None:
        while True:
            if self._file is None and not self._open_next():
                return None
            assert self._file is not None
            try:
                with self._file.open("rb") as handle:
                    handle.seek(self._offset)
                    header = handle.read(_FRAME.size)
                    if len(header) == _FRAME.size:
                        seq, length, crc = _FRAME.unpack(header)
                        payload = handle.read(length)
                        if len(payload) == length and zlib.crc32(payload) == crc:
                            self._offset += _FRAME.size + length
                            return Item(seq, _SafeUnpickler(io.BytesIO(payload)).load())
            except FileNotFoundError:  # deleted: every sink had passed it
                pass
            if not self._open_next():  # the end of this segment, if a later one exists
                return None

    def _open_next(self) -> bool:
        """Move to the segment after the current one (or the first that may hold the next
        item); False if there is none yet."""
        segments = (
            self._segments
            if self._segments is not None
            else self._spool.segments_from(self._after + 1)
        )
        if self._file is None:
            if not segments:
                return False
            self._file, self._offset = segments[0][1], 0
            return True
        later = [file for first, file in segments if file > self._file]
        if not later:
            return False
        self._file, self._offset = later[0], 0
        return True


def _hold_lock(path: Path) -> io.TextIOWrapper | None:
    """Hold ``path/spool.lock`` while this process uses the spool: a `gradtrack sync` of a
    spool that a live run still writes would deliver its items twice."""
    try:
        import fcntl
    except ImportError:  # not on POSIX: no guard
        return None
    handle = open(path / "spool.lock", "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise SpoolError(f"{path} is in use by another process (a run still delivering)") from None
    return handle


class _SafeUnpickler(pickle.Unpickler):
    """Only the classes a spool holds: a spool file never runs arbitrary code."""

    _ALLOWED_MODULES = ("gradtrack.", "numpy", "pydantic", "collections", "copyreg", "datetime")
    _ALLOWED_BUILTINS = frozenset({"set", "frozenset", "tuple", "list", "dict", "complex"})

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in self._ALLOWED_BUILTINS:
            return super().find_class(module, name)
        if (module.startswith(self._ALLOWED_MODULES) and not name.startswith("_")) or (
            module.startswith("numpy") and name in ("_reconstruct", "_frombuffer")
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a gradtrack spool cannot hold {module}.{name}")
