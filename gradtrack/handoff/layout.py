"""The layout both threads agree on: the watched tensors (`TensorIndex`, which also sums
per-tensor norms into its layers), the columns of
the per-tensor statistics, a device's host copy of one step (`HostPart`), and how the rows
the training thread packs on the device — a latched bad step, a spike vector — read on the
host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradtrack.formats.record import root_sum_squares
from gradtrack.handoff.evidence import EvidenceLayout, HostEvidence

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
