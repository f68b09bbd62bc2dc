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

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradtrack.formats.record import root_sum_squares

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
    `gradtrack.capture.probes`).
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
    spike: Tensor | None = None
    latch: Tensor | None = None
    flight: Tensor | None = None
    micro_squares: Tensor | None = None

    def pieces(self) -> list[tuple[str, Tensor | None]]:
        """(name, tensor) in travelling order; a name repeats for each activation norm."""
        pieces: list[tuple[str, Tensor | None]] = [(name, getattr(self, name)) for name in SCALARS]
        pieces += [("activation_norms", norm) for norm in self.activation_norms]
        for name in ("rank_norms", "rank_flags", "spike", "latch", "flight", "micro_squares"):
            if getattr(self, name) is not None:
                pieces.append((name, getattr(self, name)))
        return pieces

    def layout(self) -> EvidenceLayout:
        """Where each field lies in the packed vector (an unknown one takes one NaN)."""
        return EvidenceLayout(
            tuple((name, 1 if t is None else t.numel()) for name, t in self.pieces())
        )

    def on_device(self, device: torch.device) -> Tensor:
        """The packed float64 vector on ``device``, for the step's host copy (no host read)."""
        nan = torch.full((1,), float("nan"), dtype=torch.float64, device=device)
        return torch.cat(
            [
                nan if t is None else t.reshape(-1).to(device, torch.float64, non_blocking=True)
                for _, t in self.pieces()
            ]
        )

    def on_host(self) -> np.ndarray:
        """The packed float64 vector read directly from CPU tensors."""
        return np.concatenate(
            [
                np.full(1, np.nan) if t is None else t.numpy().reshape(-1).astype(np.float64)
                for _, t in self.pieces()
            ]
        )


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
        return cls(**{f.name: np.zeros(0) for f in fields(cls)})

    def scalar(self, name: str) -> float | None:
        """A scalar field as a float; None where unknown."""
        value = getattr(self, name)
        return None if len(value) == 0 or np.isnan(value[0]) else float(value[0])


@dataclass(frozen=True)
class EvidenceLayout:
    """Where each field of a packed `StepEvidence` lies: (name, length) in order.

    >>> evidence = StepEvidence(torch.tensor(True), spike=torch.ones(3))
    >>> evidence = evidence.layout().read(evidence.on_host())
    >>> evidence.scalar("output_finite"), evidence.scalar("amp_scale"), evidence.spike.tolist()
    (1.0, None, [1.0, 1.0, 1.0])
    """

    fields: tuple[tuple[str, int], ...] = ()

    @property
    def size(self) -> int:
        return sum(length for _, length in self.fields)

    def read(self, values: np.ndarray) -> HostEvidence:
        pieces: dict[str, list[np.ndarray]] = {}
        start = 0
        for name, length in self.fields:
            pieces.setdefault(name, []).append(values[start : start + length])
            start += length
        evidence = HostEvidence.empty()
        for name, parts in pieces.items():
            setattr(evidence, name, np.concatenate(parts))
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
        """[ranks, tensors] local tensor norms → [ranks, layers] local layer norms."""
        n = len(self.layer_names)
        squares = [np.bincount(self.tensor_layer, row * row, minlength=n) for row in local_norms]
        return np.sqrt(np.stack(squares))

    def layer_update_norms(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per layer (every layer): ‖W‖ and ‖ΔW‖ from the per-tensor rows of `UpdateProbe.after`.

        >>> index = TensorIndex(("fc",), np.array([0, 0]), np.array([4, 4]))
        >>> index.layer_update_norms(np.array([[3.0, 0.3], [4.0, 0.4]]))
        (array([5.]), array([0.5]))
        """
        n_layers = len(self.layer_names)
        return (
            root_sum_squares(rows[:, 0], self.tensor_layer, n_layers),
            root_sum_squares(rows[:, 1], self.tensor_layer, n_layers),
        )


@dataclass
class HostPart:
    """What one device hands to the worker for one step.

    From an accelerator, ``buffer`` is the step's one host copy: the [rows, 5] float64
    statistics and the packed step evidence (float64, laid out as ``evidence_layout`` says)
    reinterpreted as float32, then the float32 gradient samples; ``ready`` is set once the
    copy has completed. On the CPU nothing needs copying: ``buffer`` is the float64 rows
    themselves, ``cpu_evidence`` the evidence and ``cpu_samples`` the samples. Only a
    device's first part carries the step's evidence.
    """

    tensor_index: np.ndarray
    sample_counts: np.ndarray | None
    buffer: Tensor
    ready: torch.cuda.Event | None = None
    evidence_layout: EvidenceLayout = field(default_factory=EvidenceLayout)
    cpu_evidence: np.ndarray | None = None
    cpu_samples: Tensor | None = None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    @property
    def _copied(self) -> bool:
        return self.buffer.dtype == torch.float32

    @property
    def _float64_words(self) -> int:
        """float32 words the float64 rows and evidence take at the head of a copied ``buffer``."""
        return (len(self.tensor_index) * TENSOR_COLUMNS + self.evidence_layout.size) * 2

    def _float64(self) -> np.ndarray:
        return self.buffer.numpy()[: self._float64_words].view(np.float64)

    def stats(self) -> np.ndarray:
        rows = len(self.tensor_index)
        if not self._copied:
            return self.buffer.numpy()
        return self._float64()[: rows * TENSOR_COLUMNS].reshape(rows, TENSOR_COLUMNS)

    def evidence(self) -> HostEvidence:
        """The step's evidence, by name (all empty in a part that carries none)."""
        if not self._copied:
            values = self.cpu_evidence if self.cpu_evidence is not None else np.zeros(0)
        else:
            values = self._float64()[len(self.tensor_index) * TENSOR_COLUMNS :]
        return self.evidence_layout.read(values)

    def samples(self) -> np.ndarray:
        if not self._copied:
            return np.zeros(0, np.float32) if self.cpu_samples is None else self.cpu_samples.numpy()
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
        bad = np.flatnonzero((flags == 0).any(axis=1)).tolist()
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
