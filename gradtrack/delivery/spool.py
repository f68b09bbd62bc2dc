"""A run's durable spool: every record and alert on local disk before any tracker sees it.

The worker appends each item (a `StepRecord` or an `AlertEvent`) the moment it is built; one
courier per tracker sink reads them back in order and moves that sink's cursors once the
tracker really has them. A frozen, killed or late server, a locked database or a process
that dies therefore loses nothing: what a sink has not confirmed stays on disk, and
``gradtrack sync PATH`` delivers it later, from the cursors on. The spool is the only backlog
delivery has.

On disk, one folder per run::

    spool.db     SQLite (WAL): items (seq, kind, has_histograms, body), cursors
                 (name → last confirmed seq), meta (version, sinks, outcome)
    spool.lock   held while a process uses the spool

An item's body is JSON for its fields and raw bytes for its arrays (`encode`, `decode`): a
format that runs nothing when read. One body is ``<u32 header length><JSON header><array
bytes …>``. The header names the kind (``"record"`` or ``"alert"``) and the fields; an array
is ``{"@array": i}``, the i-th entry of the header's ``arrays`` list (dtype, shape, byte
length), its bytes following in order. Reading checks every field's name against the
dataclass and every dtype against a short list of plain numeric ones: a crafted or corrupted
item raises `CodecError`, it never builds anything else.

Items every cursor has passed are deleted; a run whose sinks confirmed everything leaves
nothing behind. Past ``max_bytes`` of undelivered items new items are dropped and
counted: the only way the spool loses anything.

A spool may also live in memory (``path=None``): the same backlog and delivery for a run
whose spool is off or could not be made, lost with the process.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import os
import re
import shutil
import sqlite3
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradtrack.formats.event import AlertEvent
from gradtrack.formats.flight import FlightWindow
from gradtrack.formats.histogram import Histogram
from gradtrack.formats.record import StepRecord

FORMAT_VERSION = 2
DB_FILE = "spool.db"
_SERIAL = itertools.count()  # several runs of one process never share a folder
_SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, has_histograms INTEGER NOT NULL,
    body BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS alerts ON items(seq) WHERE kind = 'alert';
CREATE INDEX IF NOT EXISTS histograms ON items(seq) WHERE has_histograms = 1;
CREATE TABLE IF NOT EXISTS cursors (name TEXT PRIMARY KEY, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def default_root() -> Path:
    """``$GRADTRACK_SPOOL_DIR``, else ``$XDG_CACHE_HOME/gradtrack/spool`` (``~/.cache/…``)."""
    explicit = os.environ.get("GRADTRACK_SPOOL_DIR")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "gradtrack" / "spool"


def is_spool(path: Path) -> bool:
    """A spool folder: it holds the spool's database."""
    return (path / DB_FILE).exists()


_HEADER = struct.Struct("<I")
_DTYPES = frozenset({"<f8", "<f4", "<f2", "<i8", "<i4", "<u1", "|b1", "|u1"})
_RECORD_NAMES = tuple(field.name for field in dataclasses.fields(StepRecord))
_RECORD_FIELDS = frozenset(_RECORD_NAMES)
_HISTOGRAM_FIELDS = frozenset(field.name for field in dataclasses.fields(Histogram))
_WINDOW_FIELDS = frozenset(field.name for field in dataclasses.fields(FlightWindow))


_AS_THEY_ARE = frozenset({str, int, bool})  # JSON holds these as they are


class CodecError(ValueError):
    """An item that is not one gradtrack wrote."""


Payload = StepRecord | AlertEvent


@dataclass(frozen=True)
class Item:
    seq: int
    payload: Payload


class SpoolError(Exception):
    """A spool that cannot be read: not a spool, another format, corrupted, or in use."""


class Spool:
    """One run's append-only log and its sinks' cursors. Appends come from one thread (the
    worker); each cursor is read and moved by one courier. One connection, one lock: every
    operation is a short statement."""

    def __init__(self, path: Path | None, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.dropped = 0
        self._lock = threading.Lock()
        self._lock_file: io.TextIOWrapper | None = None
        if path is not None:
            if not (path / DB_FILE).exists():
                raise SpoolError(f"{path} is not a gradtrack spool (no {DB_FILE})")
            self._lock_file = _hold_lock(path)
        try:
            self._db = sqlite3.connect(
                ":memory:" if path is None else str(path / DB_FILE),
                check_same_thread=False,
                isolation_level=None,  # autocommit; transactions are explicit
                timeout=30.0,
            )
            if path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")  # a process crash loses nothing
            self._db.executescript(_SCHEMA)
            self._check_version()
            self._bytes = self._scalar("SELECT COALESCE(SUM(LENGTH(body)), 0) FROM items")
            self._last_seq = self._scalar("SELECT COALESCE(MAX(seq), 0) FROM items")
            confirmed = self._scalar("SELECT COALESCE(MAX(seq), 0) FROM cursors")
            self._last_seq = max(self._last_seq, confirmed)
        except sqlite3.DatabaseError as exc:
            self._release_lock()
            raise SpoolError(f"{path} is not a readable gradtrack spool ({exc})") from None

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
        _initialise(path / DB_FILE, sinks)
        return cls(path, max_bytes)

    @classmethod
    def in_memory(cls, sinks: dict[str, dict[str, Any]], max_bytes: int) -> Spool:
        """A spool that lives in this process only."""
        spool = cls(None, max_bytes)
        with spool._lock:
            spool._write_meta(spool._db, {"version": FORMAT_VERSION, "sinks": sinks})
        return spool

    def _check_version(self) -> None:
        version = self._db.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()
        if self.path is not None and (version is None or json.loads(version[0]) != FORMAT_VERSION):
            found = None if version is None else version[0]
            raise SpoolError(
                f"{self.path} is a spool of format {found}; this gradtrack reads format "
                f"{FORMAT_VERSION}"
            )

    # -- the worker's side -----------------------------------------------------------------
    def append(self, payloads: Iterable[Payload]) -> list[int | None]:
        """Write the items in one transaction; each one's seq, or None where the spool was
        full (that item is dropped and counted)."""
        encoded = [(payload, encode(payload)) for payload in payloads]
        seqs: list[int | None] = []
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for payload, body in encoded:
                    if self._bytes + len(body) > self.max_bytes and self._bytes > 0:
                        self.dropped += 1
                        seqs.append(None)
                        continue
                    seq = self._last_seq + 1
                    kind = "alert" if not isinstance(payload, StepRecord) else "record"
                    histograms = int(isinstance(payload, StepRecord) and bool(payload.histograms))
                    self._db.execute(
                        "INSERT INTO items VALUES (?, ?, ?, ?)", (seq, kind, histograms, body)
                    )
                    self._last_seq = seq
                    self._bytes += len(body)
                    seqs.append(seq)
                self._db.execute("COMMIT")  # in the OS: a crash of this process loses nothing
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return seqs

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._last_seq

    # -- a courier's side ------------------------------------------------------------------
    def read(
        self, after: int, limit: int, through: int | None = None, histograms_only: bool = False
    ) -> list[Item]:
        """Up to ``limit`` items after seq ``after`` (through ``through``), oldest first;
        ``histograms_only``: only the records that carry histograms."""
        through = self.last_seq if through is None else through
        query = "SELECT seq, body FROM items WHERE seq > ? AND seq <= ?"
        if histograms_only:
            query += " AND has_histograms = 1"
        with self._lock:
            cursor = self._db.execute(query + " ORDER BY seq LIMIT ?", (after, through, limit))
            rows = cursor.fetchall()
        items = []
        for seq, body in rows:
            try:
                items.append(Item(seq, decode(body)))
            except CodecError as exc:
                raise SpoolError(f"item {seq} of the spool at {self.path}: {exc}") from None
        return items

    def waiting(self, after: int, through: int, histograms_only: bool = False) -> tuple[int, int]:
        """How many items (and how many alerts among them) wait after seq ``after``
        through ``through``; ``histograms_only``: records carrying histograms.

        Asked at every look of a courier and of the progress it tells, so never by a scan
        of what waits (a spool far behind holds millions of items): the items are numbered
        without gaps from the oldest kept, and alerts and histogram records are indexed."""
        range_ = "seq > ? AND seq <= ?"
        with self._lock:
            if histograms_only:
                query = f"SELECT COUNT(*) FROM items WHERE has_histograms = 1 AND {range_}"
                return self._scalar(query, after, through), 0
            oldest = self._scalar("SELECT COALESCE(MIN(seq), ?) FROM items", through + 1)
            alerts = self._scalar(
                f"SELECT COUNT(*) FROM items WHERE kind = 'alert' AND {range_}", after, through
            )
        return max(0, min(through, self._last_seq) - max(after, oldest - 1)), alerts

    def cursor(self, name: str) -> int:
        with self._lock:
            row = self._db.execute("SELECT seq FROM cursors WHERE name = ?", (name,)).fetchone()
        return 0 if row is None else int(row[0])

    def cursors(self) -> dict[str, int]:
        with self._lock:
            return {name: int(seq) for name, seq in self._db.execute("SELECT * FROM cursors")}

    def add_cursor(self, name: str, seq: int = 0) -> None:
        """A cursor that starts at ``seq`` unless it exists already."""
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO cursors VALUES (?, ?)", (name, seq))

    def confirm(self, name: str, seq: int) -> None:
        """The tracker behind cursor ``name`` has every item through ``seq``: persist it, and
        delete the items every cursor has passed."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("UPDATE cursors SET seq = MAX(seq, ?) WHERE name = ?", (seq, name))
                done = self._scalar("SELECT COALESCE(MIN(seq), 0) FROM cursors")
                freed = self._scalar(
                    "SELECT COALESCE(SUM(LENGTH(body)), 0) FROM items WHERE seq <= ?", done
                )
                if freed:
                    self._db.execute("DELETE FROM items WHERE seq <= ?", (done,))
                    self._bytes -= freed
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def describe(self, sink_id: str, target: dict[str, Any]) -> None:
        """Record how ``gradtrack sync`` reaches this sink's run (e.g. once its id is known)."""
        with self._lock:
            sinks = json.loads(self._meta_value("sinks") or "{}")
            sinks[sink_id] = target
            self._write_meta(self._db, {"sinks": sinks})

    def note_outcome(self, outcome: str) -> None:
        """How training ended: a run gradtrack started is ended so once delivered."""
        with self._lock:
            self._write_meta(self._db, {"outcome": outcome})

    def meta(self) -> dict[str, Any]:
        with self._lock:
            rows = self._db.execute("SELECT key, value FROM meta").fetchall()
        return {key: json.loads(value) for key, value in rows}

    def undelivered(self) -> int:
        """Items some cursor has not passed."""
        with self._lock:
            done = self._scalar("SELECT COALESCE(MIN(seq), ?) FROM cursors", self._last_seq)
            return self._last_seq - done

    def close(self) -> None:
        with self._lock:
            try:
                self._db.close()
            finally:
                self._release_lock()

    def remove(self) -> None:
        self.close()
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------------------
    def _scalar(self, query: str, *args: Any) -> int:
        return int(self._db.execute(query, args).fetchone()[0])

    def _meta_value(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    @staticmethod
    def _write_meta(db: sqlite3.Connection, values: dict[str, Any]) -> None:
        db.executemany(
            "INSERT OR REPLACE INTO meta VALUES (?, ?)",
            [(key, json.dumps(value)) for key, value in values.items()],
        )

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # releases the lock
            self._lock_file = None


def _initialise(file: Path, sinks: dict[str, dict[str, Any]]) -> None:
    db = sqlite3.connect(str(file), isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(_SCHEMA)
        Spool._write_meta(db, {"version": FORMAT_VERSION, "sinks": sinks})
    finally:
        db.close()


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


# -- an item's body: JSON for its fields, raw bytes for its arrays -------------------------
def encode(payload: Payload) -> bytes:
    """One item's bytes (`decode` reads them back equal)."""
    arrays: list[np.ndarray] = []
    if isinstance(payload, AlertEvent):
        header: dict[str, Any] = {"kind": "alert", "event": payload.model_dump(mode="json")}
    else:
        fields = {name: getattr(payload, name) for name in _RECORD_NAMES}
        fields["histograms"] = {
            layer: {
                "edges": h.edges,
                "counts": h.counts,
                "scale": h.scale,
                "zeros": h.zeros,
            }
            for layer, h in payload.histograms.items()
        }
        if payload.flight is not None:
            fields["flight"] = {
                field.name: getattr(payload.flight, field.name)
                for field in dataclasses.fields(FlightWindow)
            }
        header = {"kind": "record", "fields": _to_json(fields, arrays)}
    header["arrays"] = [[a.dtype.str, list(a.shape), a.nbytes] for a in arrays]
    text = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    return b"".join([_HEADER.pack(len(text)), text, *(a.tobytes() for a in arrays)])


def decode(data: bytes) -> Payload:
    """The item ``data`` holds; `CodecError` for anything gradtrack did not write."""
    try:
        (length,) = _HEADER.unpack_from(data)
        header = json.loads(data[_HEADER.size : _HEADER.size + length])
        arrays = _read_arrays(header["arrays"], data, _HEADER.size + length)
        if header["kind"] == "alert":
            return AlertEvent.model_validate(header["event"])
        if header["kind"] != "record":
            raise CodecError(f"unknown item kind {header['kind']!r}")
        fields = _from_json(header["fields"], arrays)
        unknown = set(fields) - _RECORD_FIELDS
        if unknown:
            raise CodecError(f"unknown record fields {sorted(unknown)}")
        fields["histograms"] = {
            layer: _histogram(value) for layer, value in fields.get("histograms", {}).items()
        }
        if fields.get("flight") is not None:
            fields["flight"] = _window(fields["flight"])
        for name in ("layers", "layer_metrics", "nonfinite_ranks", "nonfinite_rank_places"):
            if isinstance(fields.get(name), list):
                fields[name] = tuple(fields[name])
        if isinstance(fields.get("nonfinite_weights"), list):
            fields["nonfinite_weights"] = tuple(fields["nonfinite_weights"])
        return StepRecord(**fields)
    except CodecError:
        raise
    except Exception as exc:  # truncated, not JSON, wrong types: all the same to a reader
        raise CodecError(f"not an item gradtrack wrote ({type(exc).__name__}: {exc})") from None


def _histogram(value: Any) -> Histogram:
    if not isinstance(value, dict) or set(value) - _HISTOGRAM_FIELDS:
        raise CodecError("a histogram with unknown fields")
    return Histogram(**value)


def _window(value: Any) -> FlightWindow:
    if not isinstance(value, dict) or set(value) - _WINDOW_FIELDS:
        raise CodecError("a flight window with unknown fields")
    return FlightWindow(**{**value, "layers": tuple(value["layers"])})


def _to_json(value: Any, arrays: list[np.ndarray]) -> Any:
    kind = type(value)
    if kind is float:  # (most values: a record's norms; NaN fails both tests)
        return value if -math.inf < value < math.inf else {"@float": repr(value)}
    if value is None or kind in _AS_THEY_ARE:  # (layer names, flags)
        return value
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        if array.dtype.str not in _DTYPES:
            array = array.astype(np.float64)
        arrays.append(array)
        return {"@array": len(arrays) - 1}
    if isinstance(value, dict):
        return {str(key): _to_json(item, arrays) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(item, arrays) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return {"@float": repr(value)}  # JSON has no NaN/Inf: keep them exact
    return value


def _from_json(value: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"@array"}:
            return arrays[int(value["@array"])]
        if set(value) == {"@float"}:
            text = value["@float"]
            if text not in ("nan", "inf", "-inf"):
                raise CodecError(f"not a float: {text!r}")
            return float(text)
        return {key: _from_json(item, arrays) for key, item in value.items()}
    if isinstance(value, list):
        return [_from_json(item, arrays) for item in value]
    return value


def _read_arrays(specs: Any, data: bytes, offset: int) -> list[np.ndarray]:
    arrays = []
    for dtype, shape, nbytes in specs:
        if dtype not in _DTYPES:
            raise CodecError(f"an array of dtype {dtype!r}")
        chunk = data[offset : offset + int(nbytes)]
        if len(chunk) != nbytes:
            raise CodecError("an array cut short")
        arrays.append(np.frombuffer(chunk, dtype=dtype).reshape(shape).copy())
        offset += int(nbytes)
    if offset != len(data):
        raise CodecError("bytes after the last array")
    return arrays
