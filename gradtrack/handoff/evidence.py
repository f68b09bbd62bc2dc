"""What a step knows beyond its gradients' statistics, by name: `StepEvidence` on the device,
`HostEvidence` once its step's one host copy has arrived.

The training thread gathers evidence as device tensors (never a host read); they ride in the
step's copy as one float64 vector whose `EvidenceLayout` says where each field lies, so the
worker reads them back by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch
from torch import Tensor

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
