"""Any device mesh: the full gradients' statistics from every rank's local shards.

A DTensor gradient lives on a device mesh; along each mesh dimension it is *sharded*
(``Shard``, ``_StridedShard``: the ranks along it hold disjoint pieces) or *replicated*
(``Replicate``: they hold copies). Summing every rank's local statistics counts each element
once only if, of the ranks holding the same piece, exactly one contributes — the piece's
*owner*, the lowest rank holding it. Owners are found once, when watching starts, from one
all-gather of each rank's piece per tensor; from then on one all-gather per logged step of
each rank's local rows, its output evidence and its histogram samples gives rank 0 the full
gradients' statistics. No gradient leaves its rank.

Plain (non-DTensor) parameters in such a model are taken as replicated on every rank (tensor
parallel leaves modules it does not parallelise as plain parameters): rank 0's copy counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor, nn

from gradtrack.capture.distributed import RankGroup, is_dtensor, local_tensor
from gradtrack.capture.stats import DeviceIndex
from gradtrack.errors import GradtrackError
from gradtrack.formats.histogram import split_in_proportion
from gradtrack.handoff.layout import L2, LINF, RANK_FLAGS, TENSOR_COLUMNS, MeshPlaces, StepEvidence

SUPPORTED = "Shard, _StridedShard (FSDP2 over tensor parallel) and Replicate"
# Told apart by name, so that importing gradtrack never imports torch.distributed.tensor.
_SHARDED = ("Shard", "_StridedShard")
# Per rank, the step evidence that travels with its rows: output finite, output grad finite.


@dataclass
class ShardStep:
    """One device's step as `MeshReduction` combines it across ranks: the [rows, 5]
    statistics of the tensors in ``tensor_index`` (see `stats.stat_rows`), their histogram
    samples and sample counts, and the step's evidence."""

    rows: Tensor
    tensor_index: np.ndarray
    samples: list[Tensor]
    sample_counts: np.ndarray | None
    evidence: StepEvidence


def check_placements(tensor: Tensor, layer: str, what: str = "gradient") -> None:
    """Refuse, naming them, placements whose local shards cannot be combined exactly."""
    placements = tensor.placements  # type: ignore[attr-defined]
    if not all(type(p).__name__ in (*_SHARDED, "Replicate") for p in placements):
        raise GradtrackError(
            f"gradtrack cannot combine the {what} of layer {layer!r} across ranks: its "
            f"placements {tuple(placements)} are not supported; supported: {SUPPORTED}, on "
            "any mesh. (A Partial gradient, e.g. SequenceParallel's norm weights, must be "
            "all-reduced first; distributed={'enabled': False} summarises each rank's local "
            "shards instead.)"
        )


def piece_key(param: Tensor, layer: str) -> int:
    """Which piece of ``param`` this rank holds: its coordinates along the sharded mesh
    dimensions, as one number (-1: none, this rank is not on the tensor's mesh). Ranks with
    equal keys hold equal pieces; a plain tensor is one piece, held by every rank."""
    if not is_dtensor(param):
        return 0
    check_placements(param, layer, "parameter")
    mesh = param.device_mesh  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return -1
    key = 0
    for dim, placement in enumerate(param.placements):  # type: ignore[attr-defined]
        if type(placement).__name__ in _SHARDED:
            key = key * mesh.size(dim) + coordinate[dim]
    return key


def mesh_of(params: Sequence[Tensor]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The largest mesh among ``params``: its dimension names and this rank's coordinates
    (what an alert names a rank by)."""
    meshes = [p.device_mesh for p in params if is_dtensor(p)]  # type: ignore[attr-defined]
    mesh = max(meshes, key=lambda m: m.ndim)
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    return tuple(names), tuple(mesh.get_coordinate() or (-1,) * mesh.ndim)


@dataclass
class MeshReduction:
    """The one collective per logged step that turns local shard rows into full rows."""

    ranks: RankGroup
    owner: Tensor  # bool [world, tensors]: whether a rank's piece of a tensor counts
    shares: np.ndarray  # int64 [world, tensors]: histogram samples each rank draws
    mesh_dims: tuple[str, ...]
    coordinates: np.ndarray  # int64 [world, mesh dims]: each rank's place on the mesh
    _index: DeviceIndex = field(default_factory=DeviceIndex, repr=False)
    _slots: dict[bytes, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls, ranks: RankGroup, layers: Sequence[tuple[str, nn.Parameter]], sample_counts: np.ndarray
    ) -> MeshReduction:
        """Find every tensor's owners, and split its histogram sample over them in
        proportion to their shard sizes: one all-gather, when watching starts."""
        params = [param for _, param in layers]
        keys = [piece_key(param, name) for name, param in layers]
        local = [local_tensor(p) for p in params]
        mesh_dims, coordinate = mesh_of(params)
        numel = [t.numel() for t in local]
        return cls._of_pieces(
            ranks, keys, numel, mesh_dims, coordinate, sample_counts, local[0].device
        )

    @classmethod
    def for_partitions(
        cls,
        ranks: RankGroup,
        local_numel: Sequence[int],
        sample_counts: np.ndarray,
        device: torch.device,
    ) -> MeshReduction:
        """Every rank holding a disjoint piece of each tensor (``local_numel`` elements of it
        here, maybe none): DeepSpeed ZeRO's partitions, on a one-dimensional ``dp`` mesh."""
        keys = [ranks.rank if n > 0 else -1 for n in local_numel]
        return cls._of_pieces(
            ranks, keys, list(local_numel), ("dp",), (ranks.rank,), sample_counts, device
        )

    @classmethod
    def _of_pieces(
        cls,
        ranks: RankGroup,
        keys: list[int],
        numel: list[int],
        mesh_dims: tuple[str, ...],
        coordinate: tuple[int, ...],
        sample_counts: np.ndarray,
        device: torch.device,
    ) -> MeshReduction:
        """The owners of each piece (the lowest rank holding it), from one all-gather of every
        rank's piece keys, sizes and mesh coordinates."""
        mine = torch.tensor([*keys, *numel, *coordinate], dtype=torch.float64, device=device)
        world = ranks.all_gather(mine).cpu().numpy().astype(np.int64)
        n = len(keys)
        key, numel_of = world[:, :n], world[:, n : 2 * n]
        owner = np.zeros_like(key, dtype=bool)
        for tensor in range(n):
            column = key[:, tensor]
            for piece in set(column.tolist()) - {-1}:
                owner[np.flatnonzero(column == piece)[0], tensor] = True
        owned = np.where(owner, numel_of, 0)
        return cls(
            ranks,
            torch.as_tensor(owner, device=device),
            _proportional_shares(owned, sample_counts),
            mesh_dims,
            world[:, 2 * n :],
        )

    @property
    def local_sample_counts(self) -> np.ndarray:
        return self.shares[self.ranks.rank]

    @property
    def places(self) -> MeshPlaces:
        """Each rank's place on the mesh, for the worker to name bad ranks by."""
        return MeshPlaces(self.mesh_dims, self.coordinates, len(RANK_FLAGS))

    def __call__(self, local: ShardStep) -> ShardStep:
        """Every rank's rows, evidence and samples in one all-gather; rank 0 combines them
        (the other ranks' results are not used)."""
        rows, index, n = local.rows, local.tensor_index, self.owner.shape[1]
        device = rows.device
        on_device = self._index(index, device)
        full = rows.new_zeros(n, TENSOR_COLUMNS)  # (a tensor without a gradient: zeros)
        full[on_device] = rows
        flags = rows.new_full((len(RANK_FLAGS),), float("nan"))
        local.evidence.check_kept()
        for i, name in enumerate(RANK_FLAGS):
            flag = getattr(local.evidence, name)
            if flag is not None:
                flags[i] = flag.to(device, torch.float64).reshape(())
        samples = rows.new_full((0,), float("nan"))  # only on histogram steps (every rank's)
        if local.sample_counts is not None:
            mine, _ = self._sample_slots(index)
            samples = rows.new_full((int(self.shares.sum(axis=1).max()),), float("nan"))
            if local.samples:
                samples[self._index(mine, device)] = torch.cat(local.samples).double()
        # The first bad step each rank latched since the last logged step (-1: none), with
        # its local pieces' norms: rank 0 combines them (`_combined_latch`).
        latch = rows.new_full((1 + n,), -1.0)
        if local.evidence.latch is not None:
            latch.copy_(local.evidence.latch[: 1 + n].to(device, torch.float64))
        gathered = self.ranks.all_gather(torch.cat([full.reshape(-1), flags, latch, samples]))
        if self.ranks.rank != 0:
            return local
        return self._combine(gathered, local)

    def _combine(self, gathered: Tensor, local: ShardStep) -> ShardStep:
        world, n, width = self.ranks.world_size, self.owner.shape[1], TENSOR_COLUMNS
        index = local.tensor_index
        rows = gathered[:, : n * width].reshape(world, n, width)
        owned = torch.where(self.owner.to(rows.device)[:, :, None], rows, 0.0)
        squares = owned.clone()
        squares[:, :, L2] = squares[:, :, L2].square()
        combined = squares.sum(dim=0)
        combined[:, L2] = combined[:, L2].sqrt()
        combined[:, LINF] = owned[:, :, LINF].amax(dim=0)  # NaN anywhere stays NaN
        n_flags = len(RANK_FLAGS)
        rank_flags = gathered[:, n * width : n * width + n_flags].reshape(-1)
        latch_at = n * width + n_flags
        latches = gathered[:, latch_at : latch_at + 1 + n]
        samples, sample_counts = local.samples, local.sample_counts
        if sample_counts is not None:
            _, take = self._sample_slots(index)
            drawn = gathered[:, latch_at + 1 + n :].reshape(-1)
            samples = [drawn[self._index(take, rows.device)].float()]
            sample_counts = self.shares.sum(axis=0)[index]
        on_device = self._index(index, rows.device)
        evidence = replace(local.evidence, rank_flags=rank_flags)
        if local.evidence.latch is not None:
            tail = local.evidence.latch[1 + n :].to(rows.device, torch.float64)
            evidence.latch = torch.cat([self._combined_latch(latches), tail])
        return ShardStep(combined[on_device], index, samples, sample_counts, evidence)

    def _combined_latch(self, latches: Tensor) -> Tensor:
        """[1 + tensors]: the first step any rank latched, and each tensor's norm at it where
        every rank owning a piece of it latched that step too (-1 where that is not known:
        a rank whose pieces were finite then latched nothing), or where a latching rank's piece
        was non-finite (NaN or Inf anywhere is the tensor's). On the device, no host read."""
        steps, norms = latches[:, 0], latches[:, 1:]
        owner = self.owner.to(latches.device)
        first = torch.where(steps >= 0, steps, torch.inf).amin()
        at = (steps == first)[:, None]  # [world, 1]: the ranks that latched the first step
        counted = owner & at & (norms != -1.0)
        squares = torch.where(counted, norms.square(), 0.0).sum(dim=0)
        complete = ~(owner & ~at).any(dim=0)
        known = counted.any(dim=0) & (complete | ~torch.isfinite(squares))
        step = torch.where(torch.isfinite(first), first, -1.0).reshape(1)
        return torch.cat([step, torch.where(known, squares.sqrt(), -1.0)])

    def _sample_slots(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where the samples of the tensors in ``index`` travel: this rank's, in ``index``
        order, go to these positions of its part of the gather; rank 0 takes each tensor's
        samples, from every rank in turn, from those positions of the gathered buffer."""
        key = index.tobytes()
        if key not in self._slots:
            if len(self._slots) >= 8:
                self._slots.clear()
            shares = self.shares
            width = int(shares.sum(axis=1).max())
            start = np.cumsum(shares, axis=1) - shares  # [world, tensors]

            def positions(ranks: list[int]) -> np.ndarray:
                spans = [
                    r * width + np.arange(start[r, i], start[r, i] + shares[r, i])
                    for i in index.tolist()
                    for r in ranks
                ]
                return np.concatenate(spans).astype(np.int64) if spans else np.zeros(0, np.int64)

            mine = positions([self.ranks.rank]) - self.ranks.rank * width
            self._slots[key] = (mine, positions(list(range(len(shares)))))
        return self._slots[key]


def _proportional_shares(owned: np.ndarray, sample_counts: np.ndarray) -> np.ndarray:
    """[world, tensors]: each tensor's sample count split over the ranks in proportion to the
    elements they own, so the sample is uniform over the full tensor.

    >>> _proportional_shares(np.array([[4, 0], [3, 6]]), np.array([3, 2]))
    array([[2, 0],
           [1, 2]])
    """
    shares = np.zeros_like(owned)
    for tensor, count in enumerate(sample_counts.tolist()):
        shares[:, tensor] = split_in_proportion(count, owned[:, tensor])
    return shares
