"""The layout both threads agree on: the watched tensors (`TensorIndex`, which also sums
per-tensor norms into its layers), the columns of the per-tensor statistics, a device's host
copy of one step (`HostPart`), how the rows the training thread packs on the device — a
latched bad step, a spike vector — read on the host, and what a step knows beyond its
gradients' statistics, by name: `StepEvidence` on the device, `HostEvidence` once the step's
one host copy has arrived.

The training thread gathers evidence as device tensors (never a host read); they ride in the
step's copy as one float64 vector whose `EvidenceLayout` says where each field lies, so the
worker reads them back by name.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradtrack.formats.record import root_sum_squares

# A vector read on the host as Python floats (a CPU model's spike vector, its flight rows).
HostValues = list[float]


def _length(piece: Tensor | HostValues | None) -> int:
    """A piece's elements in the packed vector (an unknown one takes one NaN)."""
    if piece is None:
        return 1
    return len(piece) if isinstance(piece, list) else piece.numel()


# The output's scalars, which the worker may fill in from a small step's copy.
_OUTPUT_SCALARS = ("output_finite", "output_grad_finite", "output_grad_norm")
# The scalar fields, in the order they travel.
SCALARS = (
    "output_finite",
    "output_grad_finite",
    "output_grad_norm",
    "amp_found_inf",
    "amp_scale",
    "amp_scale_after",
)


@dataclass
class KeptOutputs:
    """A logged step's small CPU model output and the gradients that reached it, kept as they
    are (`gradtrack.capture.probes.OutputProbe`): checked by the worker from the step's one
    copy (`FlatGrads`) where the step is copied whole, else here by `StepEvidence` before it
    is packed — the same checks either way."""

    outputs: list[Tensor]
    grads: list[Tensor]

    def copied_whole(self) -> bool:
        """Whether they can ride in a float32 copy of the gradients (`FlatGrads`)."""
        return all(
            t.dtype == torch.float32 and t.layout == torch.strided
            for t in (*self.outputs, *self.grads)
        )

    def sizes(self) -> tuple[int, int, bool]:
        """The elements of the outputs and of their gradients, and whether any gradient came."""
        return (
            sum(t.numel() for t in self.outputs),
            sum(t.numel() for t in self.grads),
            bool(self.grads),
        )

    def checked(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Here: the outputs all finite, their gradients all finite, and those gradients'
        L2 norm (None: no gradient came), as tensors."""
        with torch.no_grad():
            finite = _all_finite(self.outputs)
            if not self.grads:
                return finite, None, None
            norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in self.grads]
            norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
            return finite, _all_finite(self.grads), norm


def _all_finite(tensors: list[Tensor]) -> Tensor:
    flags = [torch.isfinite(t).all() for t in tensors]  # (one output: no stack)
    return flags[0] if len(flags) == 1 else torch.stack(flags).all()


def output_checks(
    outputs: np.ndarray, grads: np.ndarray, grads_came: bool
) -> tuple[float, float, float]:
    """`KeptOutputs.checked` in numpy, on their values laid end to end: 1.0/0.0 flags and the
    gradients' L2 norm (squares summed in fp64); NaN where no gradient came.

    >>> output_checks(np.array([1.0, np.inf], np.float32), np.array([3.0, 4.0], np.float32), True)
    (0.0, 1.0, 5.0)
    """
    finite = float(np.isfinite(outputs).all())
    if not grads_came:
        return finite, math.nan, math.nan
    wide = grads.astype(np.float64)
    return finite, float(np.isfinite(wide).all()), math.sqrt(float(np.dot(wide, wide)))


@dataclass
class StepEvidence:
    """One step's evidence as device tensors; None where it is unknown.

    Scalars: is the model output finite, is the gradient reaching it finite, and its norm
    (`OutputProbe`);
    the GradScaler's found-inf count, scale and next scale (`ScalerTap`). Vectors: the
    activation-gradient norms (one per watched module, None where none arrived), every
    replicated rank's local tensor norms (``rank_norms``), every sharded rank's output flags
    (``rank_flags``, see `gradtrack.capture.mesh`), the step's spike vector
    (`gradtrack.capture.spike`),
    the latched bad step (`gradtrack.capture.verdict`), the flight recorder's rows since the last
    hand-off (``flight``, `gradtrack.capture.flight_ring`) and, under gradient accumulation, each
    tensor's squared micro-batch gradients summed (``micro_squares``,
    `gradtrack.capture.probes`). ``kept_outputs``: a small CPU output not yet checked, which
    the output scalars take in before the evidence is packed (where the step is not copied
    whole with it). The spike vector and the flight rows of a CPU model judged on the host
    may come as Python floats (`HostValues`): never made into tensors, they are packed as
    they are.
    """

    output_finite: Tensor | None = None
    output_grad_finite: Tensor | None = None
    output_grad_norm: Tensor | None = None
    amp_found_inf: Tensor | None = None
    amp_scale: Tensor | None = None
    amp_scale_after: Tensor | None = None
    activation_norms: list[Tensor | None] = field(default_factory=list)
    rank_norms: Tensor | None = None
    rank_flags: Tensor | None = None
    spike: Tensor | HostValues | None = None
    latch: Tensor | None = None
    flight: Tensor | HostValues | None = None
    micro_squares: Tensor | None = None
    kept_outputs: KeptOutputs | None = None

    def pieces(self) -> list[tuple[str, Tensor | HostValues | None]]:
        """(name, tensor) in travelling order; a name repeats for each activation norm."""
        self.check_kept()
        pieces: list[tuple[str, Tensor | HostValues | None]] = [
            (name, getattr(self, name)) for name in SCALARS
        ]
        pieces += [("activation_norms", norm) for norm in self.activation_norms]
        for name in ("rank_norms", "rank_flags", "spike", "latch", "flight", "micro_squares"):
            if getattr(self, name) is not None:
                pieces.append((name, getattr(self, name)))
        return pieces

    def check_kept(self) -> None:
        """The kept outputs checked here, and taken into the output scalars (before these
        are read)."""
        kept, self.kept_outputs = self.kept_outputs, None
        if kept is None:
            return
        finite, grads_finite, norm = kept.checked()
        self.output_finite = _and(self.output_finite, finite)
        if grads_finite is not None and norm is not None:
            self.output_grad_finite = _and(self.output_grad_finite, grads_finite)
            previous = self.output_grad_norm
            self.output_grad_norm = norm if previous is None else torch.hypot(previous, norm)

    def layout(self) -> EvidenceLayout:
        """Where each field lies in the packed vector (an unknown one takes one NaN)."""
        return EvidenceLayout(tuple((name, _length(t)) for name, t in self.pieces()))

    def on_device(self, device: torch.device) -> Tensor:
        """The packed float64 vector on ``device``, for the step's host copy (no host read)."""
        nan = torch.full((1,), float("nan"), dtype=torch.float64, device=device)
        pieces = []
        for _, t in self.pieces():
            if t is None:
                pieces.append(nan)
            elif isinstance(t, list):
                pieces.append(torch.tensor(t, dtype=torch.float64, device=device))
            else:
                pieces.append(t.reshape(-1).to(device, torch.float64, non_blocking=True))
        return torch.cat(pieces)

    def on_host(self) -> tuple[EvidenceLayout, np.ndarray]:
        """Its layout and the packed float64 vector, read directly from CPU tensors in one
        pass (numpy's concatenation casts each piece to float64). Unknown fields and host
        values run into one Python list: a small model's logged step, whose pieces are all
        such, makes one array of it (1 µs, where a tensor a piece cost 5)."""
        fields: list[tuple[str, int]] = []
        arrays: list[np.ndarray | list[float]] = []
        floats: list[float] = []  # (the run of unknown fields and host values being read)
        for name, t in self.pieces():
            if t is None:
                floats.append(math.nan)
                fields.append((name, 1))
            elif isinstance(t, list):
                floats += t
                fields.append((name, len(t)))
            else:
                if floats:
                    arrays.append(floats)
                    floats = []
                value = t.numpy().reshape(-1)
                fields.append((name, len(value)))
                arrays.append(value)
        if not arrays:
            return EvidenceLayout(tuple(fields)), np.array(floats, dtype=np.float64)
        if floats:
            arrays.append(floats)
        return EvidenceLayout(tuple(fields)), np.concatenate(arrays, dtype=np.float64)


def _and(previous: Tensor | None, current: Tensor) -> Tensor:
    return current if previous is None else torch.logical_and(previous, current)


_NONE = np.zeros(0)  # (a field the step carried none of; empty, so nothing writes into it)


@dataclass
class HostEvidence:
    """A step's evidence read on the host: float64 arrays, empty where the step carried none
    (NaN inside one: unknown)."""

    output_finite: np.ndarray
    output_grad_finite: np.ndarray
    output_grad_norm: np.ndarray
    amp_found_inf: np.ndarray
    amp_scale: np.ndarray
    amp_scale_after: np.ndarray
    activation_norms: np.ndarray
    rank_norms: np.ndarray
    rank_flags: np.ndarray
    spike: np.ndarray
    latch: np.ndarray
    flight: np.ndarray
    micro_squares: np.ndarray

    @classmethod
    def empty(cls) -> HostEvidence:
        return cls(*(_NONE,) * len(fields(cls)))

    def scalar(self, name: str) -> float | None:
        """A scalar field as a float; None where unknown."""
        value = getattr(self, name)
        return None if len(value) == 0 or np.isnan(value[0]) else float(value[0])


@dataclass(frozen=True)
class EvidenceLayout:
    """Where each field of a packed `StepEvidence` lies: (name, length) in order.

    >>> layout, values = StepEvidence(torch.tensor(True), spike=torch.ones(3)).on_host()
    >>> evidence = layout.read(values)
    >>> evidence.scalar("output_finite"), evidence.scalar("amp_scale"), evidence.spike.tolist()
    (1.0, None, [1.0, 1.0, 1.0])
    """

    fields: tuple[tuple[str, int], ...] = ()

    @property
    def size(self) -> int:
        return sum(length for _, length in self.fields)

    def add_outputs(self, values: np.ndarray, checks: tuple[float, float, float]) -> None:
        """Take the worker's `output_checks` into packed ``values``, as `StepEvidence` would
        have before packing: flags and'ed, norms combined, NaN (unknown) giving way."""
        start = 0
        for name, length in self.fields:
            if name in _OUTPUT_SCALARS:
                value = checks[_OUTPUT_SCALARS.index(name)]
                held = values[start]
                if math.isnan(value):
                    pass
                elif math.isnan(held):
                    values[start] = value
                elif name == "output_grad_norm":
                    values[start] = math.hypot(held, value)
                else:
                    values[start] = float(bool(held) and bool(value))
            start += length

    def read(self, values: np.ndarray) -> HostEvidence:
        """The fields of ``values``, each a copy (a field kept does not hold the step's whole
        host copy); a repeated one joined."""
        evidence = HostEvidence.empty()
        start = 0
        for name, length in self.fields:
            piece = values[start : start + length].copy()
            start += length
            held = getattr(evidence, name)
            setattr(evidence, name, piece if held is _NONE else np.concatenate([held, piece]))
        return evidence


# Columns of the per-tensor array computed on the device.
L2, L1, LINF, NAN, INF = range(5)
TENSOR_COLUMNS = 5


@dataclass(frozen=True)
class TensorIndex:
    """The watched tensors, flattened in layer order: each one's layer and element count
    (this rank's shard of a DTensor summarised on its own). Fixed once watching starts; the
    worker reads it while the training thread goes on."""

    layer_names: tuple[str, ...]
    tensor_layer: np.ndarray  # int64 [tensors]: the layer of each tensor
    tensor_numel: np.ndarray  # int64 [tensors]

    @property
    def n_tensors(self) -> int:
        return len(self.tensor_layer)

    def rank_layer_norms(self, local_norms: np.ndarray) -> np.ndarray:
        """[ranks, tensors] local tensor norms → [ranks, layers] local layer norms, combined
        as the record's own (`root_sum_squares`: fp64 norms whose squares would overflow
        stay finite).

        >>> index = TensorIndex(("fc",), np.array([0, 0]), np.array([4, 4]))
        >>> index.rank_layer_norms(np.array([[3.0, 4.0], [3e200, 4e200]]))
        array([[5.e+000],
               [5.e+200]])
        """
        n = len(self.layer_names)
        return np.stack([root_sum_squares(row, self.tensor_layer, n) for row in local_norms])

    def layer_update_norms(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per layer (every layer): ‖W‖ and ‖ΔW‖ from the per-tensor rows of `UpdateProbe.after`.

        >>> index = TensorIndex(("fc",), np.array([0, 0]), np.array([4, 4]))
        >>> index.layer_update_norms(np.array([[3.0, 0.3], [4.0, 0.4]]))
        (array([5.]), array([0.5]))
        """
        n = len(self.layer_names)
        both = root_sum_squares(rows.T.reshape(-1), self._both_columns, 2 * n)  # (one pass)
        return both[:n], both[n:]

    @functools.cached_property
    def _both_columns(self) -> np.ndarray:
        """The layer of each element of a [tensors, 2] array's two columns end to end, the
        second column's layers numbered after the first's."""
        return np.concatenate([self.tensor_layer, self.tensor_layer + len(self.layer_names)])


def flat_stat_rows(values: np.ndarray, offsets: np.ndarray, full: bool) -> np.ndarray:
    """A step's [tensors, 5] rows (L2, L1, max, NaN, Inf counts), as the training thread's
    reductions give them (`gradtrack.capture.stats`), from CPU gradients laid end to end
    (``values``, float32; ``offsets``: each tensor's first element, none empty), in numpy:
    where the worker reduces a small step's gradients from their one copy (`FlatGrads`).
    Squares and |g| are summed in fp64, which no fp32 value over- or underflows; NaN
    anywhere makes a tensor's norms NaN, ±Inf without NaN Inf; L1 and max are NaN without
    ``full``; NaN and Inf are counted where a norm is not finite.

    >>> flat_stat_rows(np.array([3.0, -4.0, np.nan, np.inf], np.float32), np.array([0, 2]), True)
    array([[ 5.,  7.,  4.,  0.,  0.],
           [nan, nan, nan,  1.,  1.]])
    """
    rows = np.zeros((len(offsets), TENSOR_COLUMNS))
    wide = values.astype(np.float64)
    absolute = np.abs(wide, out=wide)
    if full:
        rows[:, L1] = np.add.reduceat(absolute, offsets)
        rows[:, LINF] = np.maximum.reduceat(absolute, offsets)
    else:
        rows[:, L1 : LINF + 1] = math.nan
    rows[:, L2] = np.sqrt(np.add.reduceat(np.square(absolute, out=absolute), offsets))
    bad = (~np.isfinite(rows[:, L2])).nonzero()[0]
    if len(bad):  # (a non-finite step: count per tensor)
        nan = np.isnan(values)
        rows[bad, NAN] = np.add.reduceat(nan, offsets)[bad]
        rows[bad, INF] = np.add.reduceat(np.isinf(values), offsets)[bad]
    return rows


@dataclass
class FlatGrads:
    """A small CPU step's gradients, copied end to end (float32), for the worker to reduce:
    its statistics then cost the training thread one copy instead of a dozen reductions
    (`gradtrack.capture.collect.DEFER_BELOW_ELEMENTS`). ``offsets``: each tensor's first
    element; ``full``: L1 and max are asked for too. ``outputs``: the step's kept model
    output and its gradients ride after the gradients (`KeptOutputs.sizes`), checked here."""

    values: Tensor
    offsets: np.ndarray
    full: bool
    outputs: tuple[int, int, bool] | None = None

    def reduce(self) -> tuple[np.ndarray, tuple[float, float, float] | None]:
        """The step's rows, and the output's `output_checks` where it rode along."""
        values = self.values.numpy()
        if self.outputs is None:
            return flat_stat_rows(values, self.offsets, self.full), None
        n_out, n_grads, came = self.outputs
        end = len(values) - n_out - n_grads
        rows = flat_stat_rows(values[:end], self.offsets, self.full)
        return rows, output_checks(values[end : end + n_out], values[end + n_out :], came)


@dataclass
class FlatUpdate:
    """A small CPU model's weights copied end to end (float32) just before and just after
    one optimizer step (`gradtrack.capture.updates.WholeUpdateProbe`), for the worker to
    reduce: two copies on the training thread instead of a dozen reductions. ``offsets``:
    each tensor's first element."""

    before: Tensor
    after: Tensor
    offsets: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.before.nbytes + self.after.nbytes

    def rows(self) -> np.ndarray:
        """Per tensor, (‖W‖ before the step, ‖W after − W before‖), float64 ``[tensors, 2]``,
        both exact (squares summed in fp64).

        >>> update = FlatUpdate(torch.tensor([3.0, 4.0, 1.0]), torch.tensor([3.0, 4.5, 0.0]),
        ...                     np.array([0, 2]))
        >>> update.rows().tolist()
        [[5.0, 0.5], [1.0, 1.0]]
        """
        before = self.before.numpy().astype(np.float64)
        delta = self.after.numpy() - before
        rows = np.empty((len(self.offsets), 2))
        rows[:, 0] = np.add.reduceat(np.square(before, out=before), self.offsets)
        rows[:, 1] = np.add.reduceat(np.square(delta, out=delta), self.offsets)
        return np.sqrt(rows, out=rows)


@dataclass
class HostPart:
    """What one device hands to the worker for one step.

    From an accelerator, ``buffer`` is the step's one host copy: the [rows, 5] float64
    statistics and the packed step evidence (float64, laid out as ``evidence_layout`` says)
    reinterpreted as float32, then the float32 gradient samples; ``ready`` is set once the
    copy has completed. On the CPU nothing needs copying: ``buffer`` is the float64 rows
    themselves, or, for a small step, ``flat`` the gradients the worker reduces (their rows
    computed once, when first read); ``cpu_evidence`` the evidence and ``cpu_samples`` the
    samples. Only a device's first part carries the step's evidence.

    A CPU part comes with its evidence unpacked (``unpacked``: tensors and values made for
    this step alone, nothing the training loop changes later), packed into ``cpu_evidence``
    where the part is first read: by the worker, not the training thread, whose logged step
    it cost ~18 µs (`gradtrack.worker.process`: in the worker process, off the GIL).
    """

    tensor_index: np.ndarray
    sample_counts: np.ndarray | None
    buffer: Tensor | None
    ready: torch.cuda.Event | None = None
    evidence_layout: EvidenceLayout = field(default_factory=EvidenceLayout)
    cpu_evidence: np.ndarray | None = None
    cpu_samples: Tensor | None = None
    flat: FlatGrads | None = None
    unpacked: StepEvidence | None = None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    @property
    def nbytes(self) -> int:
        """The memory the part holds (its copy, rows, gradients and samples)."""
        held = [self.buffer, self.cpu_samples, None if self.flat is None else self.flat.values]
        return sum(tensor.nbytes for tensor in held if tensor is not None)

    @property
    def _copied(self) -> bool:
        return self.buffer is not None and self.buffer.dtype == torch.float32

    @property
    def _float64_words(self) -> int:
        """float32 words the float64 rows and evidence take at the head of a copied ``buffer``."""
        return (len(self.tensor_index) * TENSOR_COLUMNS + self.evidence_layout.size) * 2

    def _float64(self) -> np.ndarray:
        assert self.buffer is not None  # (`_copied`)
        return self.buffer.numpy()[: self._float64_words].view(np.float64)

    def _reduce_flat(self) -> None:
        """The part made ready to read, once: its evidence packed (`_pack`) and, for a small
        step, its copy reduced to its rows, its output's checks taken into its evidence."""
        self._pack()
        if self.flat is None:
            return
        rows, checks = self.flat.reduce()
        self.buffer = torch.from_numpy(rows)
        self.flat = None  # (the gradients' copy is no longer needed)
        if checks is not None and self.cpu_evidence is not None:
            self.evidence_layout.add_outputs(self.cpu_evidence, checks)

    def _pack(self) -> None:
        if self.unpacked is not None:
            self.evidence_layout, self.cpu_evidence = self.unpacked.on_host()
            self.unpacked = None

    def stats(self) -> np.ndarray:
        rows = len(self.tensor_index)
        self._reduce_flat()
        assert self.buffer is not None  # (its rows, or its copy)
        if not self._copied:
            return self.buffer.numpy()
        return self._float64()[: rows * TENSOR_COLUMNS].reshape(rows, TENSOR_COLUMNS)

    def evidence(self) -> HostEvidence:
        """The step's evidence, by name (all empty in a part that carries none)."""
        self._reduce_flat()
        if not self._copied:
            values = self.cpu_evidence if self.cpu_evidence is not None else np.zeros(0)
        else:
            values = self._float64()[len(self.tensor_index) * TENSOR_COLUMNS :]
        return self.evidence_layout.read(values)

    def samples(self) -> np.ndarray:
        if not self._copied:
            return np.zeros(0, np.float32) if self.cpu_samples is None else self.cpu_samples.numpy()
        assert self.buffer is not None  # (`_copied`)
        return self.buffer.numpy()[self._float64_words :]


def latched_step(flags: np.ndarray, n_tensors: int) -> tuple[int, np.ndarray, np.ndarray] | None:
    """(step, per-tensor norms, -1 where absent, the spike vector) from a latch read on the
    host; None if no step was bad.

    >>> latched_step(np.array([-1.0, -1.0, -1.0]), 2)
    >>> latched_step(np.array([7.0, 1.5, np.nan]), 2)
    (7, array([1.5, nan]), array([], dtype=float64))
    """
    if len(flags) == 0 or flags[0] < 0:
        return None
    return int(flags[0]), flags[1 : 1 + n_tensors], flags[1 + n_tensors :]


def spike_fields(vector: np.ndarray) -> dict[str, Any]:
    """`StepRecord` fields from a `NormWindow.update` vector read on the host.

    >>> fields = spike_fields(np.array([1.0, 9.0, 2.0, 3.0, 0.0, 1.0]))
    >>> fields["spike_z"].tolist(), fields["spiking"].tolist()
    ([1.0, 9.0], [False, True])
    """
    n = len(vector) // 3  # (slices: np.split costs ~5 µs, and the guard reads this per step)
    z, typical, spiking = vector[:n], vector[n : 2 * n], vector[2 * n :]
    return {"spike_z": z, "spike_typical": typical, "spiking": spiking > 0}


class FirstInWindow:
    """True for the first step it is asked about in each window of ``every`` steps.

    >>> first = FirstInWindow(10)
    >>> [step for step in (0, 3, 12, 15, 27) if first(step)]
    [0, 12, 27]
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self._last_window = -1

    def __call__(self, step: int) -> bool:
        window = step // self.every
        if window == self._last_window:
            return False
        self._last_window = window
        return True


# The per-rank evidence a mesh's ranks gather on logged steps, in this order.
RANK_FLAGS = ("output_finite", "output_grad_finite")
# Layer kinds whose gradients are sparse by nature: the layer-comparing rules leave them out.
SPARSE_KINDS = frozenset({"Embedding", "EmbeddingBag"})


@dataclass(frozen=True)
class MeshPlaces:
    """Each rank's place on a device mesh, from `gradtrack.capture.mesh.MeshReduction`."""

    mesh_dims: tuple[str, ...]
    coordinates: np.ndarray  # int64 [world, mesh dims]
    n_flags: int

    def nonfinite_fields(self, rank_flags: np.ndarray) -> dict[str, Any]:
        """A record's ``nonfinite_ranks``: the ranks whose own model output, or the gradient
        reaching it, was non-finite — where a NaN arose, before a collective mixed the ranks'
        gradients — and their places on the mesh."""
        if len(rank_flags) == 0:
            return {}
        flags = rank_flags.reshape(len(self.coordinates), self.n_flags)
        bad = (flags == 0).any(axis=1).nonzero()[0].tolist()
        if not bad:
            return {}
        places = tuple(self.rank_label(rank) for rank in bad)
        return {"nonfinite_ranks": tuple(bad), "nonfinite_rank_places": places}

    def rank_label(self, rank: int) -> str:
        """``"3 (dp=1, tp=1)"``: a rank and its mesh coordinates."""
        place = ", ".join(
            f"{dim}={c}" for dim, c in zip(self.mesh_dims, self.coordinates[rank].tolist())
        )
        return f"{rank} ({place})"
