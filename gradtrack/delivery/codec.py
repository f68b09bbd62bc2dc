"""How a spooled item is written: JSON for its fields, raw bytes for its arrays — a format
that runs nothing when read.

One item is ``<u32 header length><JSON header><array bytes …>``. The header names the kind
(``"record"`` or ``"alert"``) and the fields; an array is ``{"@array": i}``, the i-th entry
of the header's ``arrays`` list (dtype, shape, byte length), its bytes following in order.
Reading checks every field's name against the dataclass and every dtype against a short
list of plain numeric ones: a crafted or corrupted item raises `CodecError`, it never
builds anything else.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from typing import Any

import numpy as np

from gradtrack.formats.event import AlertEvent
from gradtrack.formats.flight import FlightWindow
from gradtrack.formats.histogram import Histogram
from gradtrack.formats.record import StepRecord

_HEADER = struct.Struct("<I")
_DTYPES = frozenset({"<f8", "<f4", "<f2", "<i8", "<i4", "<u1", "|b1", "|u1"})
_RECORD_FIELDS = frozenset(field.name for field in dataclasses.fields(StepRecord))
_HISTOGRAM_FIELDS = frozenset(field.name for field in dataclasses.fields(Histogram))
_WINDOW_FIELDS = frozenset(field.name for field in dataclasses.fields(FlightWindow))


class CodecError(ValueError):
    """An item that is not one gradtrack wrote."""


Payload = StepRecord | AlertEvent


def encode(payload: Payload) -> bytes:
    """One item's bytes (`decode` reads them back equal)."""
    arrays: list[np.ndarray] = []
    if isinstance(payload, AlertEvent):
        header: dict[str, Any] = {"kind": "alert", "event": payload.model_dump(mode="json")}
    else:
        fields = {
            field.name: getattr(payload, field.name) for field in dataclasses.fields(StepRecord)
        }
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
