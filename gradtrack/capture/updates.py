"""The update signals around the optimizer step: ‖W‖ and ‖ΔW‖, measured in one of two ways.

Exact (``update_signals=True``, `UpdateProbe`): each parameter's norm and the norm of the
update the optimizer actually applied (weight decay, momentum and Adam's preconditioning
included). ΔW is measured, not derived from the optimizer's state: on a logged step the
parameters are copied, before ``optimizer.step()``, into buffers made once and reused (one copy
of the trainable parameters, for the run), and subtracted from after it. Unlogged steps pay
nothing.

The default (`SampledUpdateProbe`), at ~zero memory: ‖W‖ exact, ‖ΔW‖ estimated from a fixed
sample of each tensor, taken just before ``optimizer.step()`` and compared just after it. The
sample is a lattice: ``SAMPLE_SIZE`` elements ``p`` apart in the flattened tensor, from a fixed
random offset, with ``p`` the largest prime at most numel / ``SAMPLE_SIZE``. A prime stride
shares no factor with a row's or a kernel's length (unless it equals it), so the sample walks
across rows and columns alike instead of reading one column. ‖ΔW‖ ≈ ‖ΔW_sample‖ · √(numel /
sample): exact for tensors of at most 2 × ``SAMPLE_SIZE`` elements (all taken), unbiased for
the others (an update spread over the whole tensor — momentum, Adam — reads within a few
percent; one that touches a few rows only, as SGD without momentum on an embedding, reads
noisier). Memory: at most ``SAMPLE_SIZE`` elements per tensor, kept for the run; time: one norm
pass over the weights and two strided copies per logged step.

A small model on the CPU (`WholeUpdateProbe`, whichever of the two is asked for): its weights
copied end to end before and after the step, and both norms computed exactly by the worker
(`gradtrack.handoff.layout.FlatUpdate`) — two copies where the probes above take a dozen small
reductions on the training thread.

`Handover` (`gradtrack.capture.handover`) takes the "after" half once the optimizer stepped.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from gradtrack.capture.stats import (
    PACK_MIN_TENSORS,
    DeviceIndex,
    ShapeGroups,
    accumulation_dtype,
    copy_to_host,
    pack_offsets,
    packed_squares,
    start_offsets,
)
from gradtrack.handoff.layout import FlatUpdate

if TYPE_CHECKING:
    from gradtrack.capture.collect import WholeCopies

OnError = Callable[[int, Exception], None]


class UpdateProbe:
    """`before` and `after` one optimizer step: per tensor, (‖W before‖, ‖W after − W before‖)
    as a float64 ``[tensors, 2]`` tensor on the first device, copied to the host without a
    wait (`stats.copy_to_host`)."""

    def __init__(
        self, params: Sequence[nn.Parameter], packs: Callable[[], bool] = lambda: True
    ) -> None:
        self._params = list(params)
        self._groups, self._inverse = device_groups(self._params)
        # (a snapshot is laid out as its weights: the same packing serves both; ``packs``
        # False: the accelerator's kernel path, as tests take it on a CPU)
        self._packs = packs
        self._packing = [pack_offsets([self._params[i] for i in g]) for g in self._groups]
        self._index = DeviceIndex()
        self._snapshots: list[list[Tensor]] | None = None
        self._param_norms: list[Tensor] = []

    def before(self) -> None:
        """Copy the weights (into the reused buffers) and take their norms."""
        with torch.no_grad():
            # (no detach: under no_grad a parameter is read as it is, one op fewer a tensor)
            weights: list[list[Tensor]] = [
                [self._params[i] for i in group] for group in self._groups
            ]
            if self._snapshots is None:
                self._snapshots = [[torch.empty_like(w) for w in ws] for ws in weights]
            self._param_norms = []
            packing = self._packing if self._packs() else [None] * len(weights)
            for snapshot, ws, packed in zip(self._snapshots, weights, packing):
                torch._foreach_copy_(snapshot, ws)
                self._param_norms.append(weight_norms(ws, packed))

    def after(self) -> tuple[Tensor, torch.cuda.Event | None]:
        """The step's rows, in the order of ``params``, and the event its host copy sets."""
        assert self._snapshots is not None, "after() without before()"
        with torch.no_grad():
            updates = []
            packing = self._packing if self._packs() else [None] * len(self._groups)
            for group, snapshot, packed in zip(self._groups, self._snapshots, packing):
                torch._foreach_sub_(snapshot, [self._params[i] for i in group])
                updates.append(weight_norms(snapshot, packed))
            return update_rows(self._param_norms, updates, self._index, self._inverse)


def device_groups(params: Sequence[Tensor]) -> tuple[list[list[int]], np.ndarray]:
    """The tensors' indices grouped by (device, dtype), for one foreach pass per group, and
    the permutation that puts the groups' concatenated results back in tensor order."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, param in enumerate(params):
        groups[(param.device, param.dtype)].append(i)
    ordered = list(groups.values())
    return ordered, np.argsort(np.concatenate([np.asarray(g) for g in ordered]))


def weight_norms(tensors: list[Tensor], packed: np.ndarray | None = None) -> Tensor:
    """L2 norms, in fp32 for fp16/bf16/fp32 weights (fp32 accumulation), fp64 for fp64.
    ``packed`` (`pack_offsets`: many small fp32 CPU tensors): summed in one packed pass,
    in fp64, instead of a kernel per tensor."""
    if packed is not None:
        return torch.from_numpy(np.sqrt(packed_squares(tensors, packed)).astype(np.float32))
    accumulate = accumulation_dtype(tensors[0].dtype)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=accumulate))


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of `weight_norms` for weights of ``dtype``."""
    return torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32


def update_rows(
    param_norms: list[Tensor], updates: list[Tensor], index: DeviceIndex, inverse: np.ndarray
) -> tuple[Tensor, torch.cuda.Event | None]:
    """Each group's (‖W‖, ‖ΔW‖) as float64 ``[tensors, 2]`` rows in the parameters' order on
    the first group's device, and their host copy's event (`stats.copy_to_host`). One group
    (one device and dtype, the usual case) is in that order already: two operations."""
    if len(param_norms) == 1:
        return copy_to_host(torch.stack([param_norms[0], updates[0]], dim=1).double())
    device = param_norms[0].device
    rows = torch.stack(
        [
            torch.cat([n.to(device, torch.float64) for n in param_norms]),
            torch.cat([n.to(device, torch.float64) for n in updates]),
        ],
        dim=1,
    )
    return copy_to_host(rows[index(inverse, device)])


SAMPLE_SIZE = 1024  # elements of each tensor compared before and after the step


class Lattice:
    """Where one tensor is sampled: ``count`` elements ``stride`` apart from ``offset`` (all
    of it, stride 1, when it is small or ``whole``: not contiguous), and √(numel / count)."""

    def __init__(self, numel: int, sample: int, rng: np.random.Generator, whole: bool) -> None:
        self.whole = whole or numel <= 2 * sample
        if self.whole:
            self.offset, self.stride, self.count = 0, 1, numel
        else:
            self.stride = largest_prime_at_most(numel // sample)
            self.count = sample
            span = (sample - 1) * self.stride + 1
            self.offset = int(rng.integers(0, numel - span + 1))
        self.scale = math.sqrt(numel / max(self.count, 1))

    def view(self, param: Tensor) -> Tensor:
        """The sampled elements of ``param``, a view (no copy)."""
        if self.whole:
            return param.detach()
        flat = param.detach().view(-1)
        end = self.offset + (self.count - 1) * self.stride + 1
        return flat[self.offset : end : self.stride]


def largest_prime_at_most(n: int) -> int:
    """
    >>> largest_prime_at_most(10), largest_prime_at_most(2), largest_prime_at_most(1)
    (7, 2, 1)
    """
    for candidate in range(n, 1, -1):
        if all(candidate % d for d in range(2, math.isqrt(candidate) + 1)):
            return candidate
    return 1


class SampledUpdateProbe:
    """`before` and `after` one optimizer step: per tensor, (‖W before‖ exact, ‖ΔW‖ estimated
    from its lattice) as a float64 ``[tensors, 2]`` tensor on the first device, copied to the
    host without a wait — the rows `gradtrack.capture.handover.UpdateProbe` makes, from a sample."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        sample: int = SAMPLE_SIZE,
        seed: int = 0,
        packs: Callable[[], bool] = lambda: True,
    ) -> None:
        self._params = list(params)
        self._packs = packs  # (as `UpdateProbe`'s)
        rng = np.random.default_rng(seed)
        self._lattices = [
            Lattice(p.numel(), sample, rng, whole=not p.is_contiguous()) for p in self._params
        ]
        self._groups, self._inverse = device_groups(self._params)
        self._packing = [pack_offsets([self._params[i] for i in g]) for g in self._groups]
        self._index = DeviceIndex()
        self._param_norms: list[Tensor] = []
        # Each group's sample views, made at watch time (a view is metadata: no op per tensor
        # at a step), and the storages they view: remade when a parameter's .data is replaced.
        self._views: list[list[Tensor]] = []
        self._viewed: list[int] = []
        with torch.no_grad():
            self._samples = [[torch.empty_like(v) for v in vs] for vs in self._sample_views()]
        self._sample_packing = [pack_offsets(samples) for samples in self._samples]
        self._scales = [
            torch.tensor(  # (in the norms' dtype: the product needs no conversion)
                [self._lattices[i].scale for i in group],
                dtype=_norm_dtype(self._params[group[0]].dtype),
                device=self._params[group[0]].device,
            )
            for group in self._groups
        ]

    @property
    def sample_bytes(self) -> int:
        """Memory the samples hold for the run."""
        return sum(lat.count * p.element_size() for lat, p in zip(self._lattices, self._params))

    def _sample_views(self) -> list[list[Tensor]]:
        storages = [p.data_ptr() for p in self._params]
        if storages != self._viewed:
            self._views = [
                [self._lattices[i].view(self._params[i]) for i in group] for group in self._groups
            ]
            self._viewed = storages
        return self._views

    def before(self) -> None:
        """Copy each tensor's sample (into buffers made once) and take the weights' norms."""
        with torch.no_grad():
            views = self._sample_views()
            self._param_norms = []
            packing = self._packing if self._packs() else [None] * len(self._groups)
            for samples, group, sampled, packed in zip(self._samples, self._groups, views, packing):
                torch._foreach_copy_(samples, sampled)
                weights: list[Tensor] = [self._params[i] for i in group]
                self._param_norms.append(weight_norms(weights, packed))

    def after(self) -> tuple[Tensor, torch.cuda.Event | None]:
        """The step's rows, in the order of ``params``, and the event its host copy sets."""
        assert self._param_norms, "after() without before()"
        with torch.no_grad():
            updates = []
            views = self._sample_views()
            packing = self._sample_packing if self._packs() else [None] * len(self._groups)
            for samples, scales, sampled, packed in zip(
                self._samples, self._scales, views, packing
            ):
                torch._foreach_sub_(samples, sampled)
                updates.append(weight_norms(samples, packed) * scales)
            return update_rows(self._param_norms, updates, self._index, self._inverse)


class WholeUpdateProbe:
    """`before` and `after` one optimizer step of a small model on the CPU
    (`gradtrack.capture.collect.WholeCopies`):
    its weights copied end to end each time (one C++ call), for the worker to reduce to the
    rows the other probes make, exactly (`FlatUpdate.rows`). Memory: two copies of the
    weights, held from a logged step until the worker took it."""

    def __init__(self, params: Sequence[nn.Parameter], copies: WholeCopies) -> None:
        self._params = list(params)
        self._copies = copies  # (laid where the worker reads them)
        self._numel = sum(p.numel() for p in self._params)
        self._offsets = start_offsets([p.numel() for p in self._params])
        self._before: Tensor | None = None
        # Each weight as a flat view, made once and remade when a parameter's storage is
        # replaced: one ``cat`` into the copy (a third of flattening the weights anew and
        # copying the result). None while a weight is not contiguous (no view of it flat).
        self._flat: list[Tensor] | None = None
        self._viewed: list[int] = []
        # Many small weights of few shapes: stacked by shape into the copy instead (one call
        # per shape, where a ``cat`` of views reads every weight: 600 of them ~3x faster).
        many = len(self._params) >= PACK_MIN_TENSORS  # (none empty: `WholeCopies.fit`)
        self._shapes = ShapeGroups.of(self._params) if many else None

    def before(self) -> None:
        self._before = self._copy()

    def after(self) -> FlatUpdate:
        assert self._before is not None, "after() without before()"
        return FlatUpdate(self._before, self._copy(), self._offsets)

    def _copy(self) -> Tensor:
        if self._shapes is not None:
            with torch.no_grad():
                return self._copies.copy_by_shape(self._shapes, self._params, self._numel)
        storages = [p.data_ptr() for p in self._params]
        if storages != self._viewed:
            self._viewed = storages
            contiguous = all(p.is_contiguous() for p in self._params)
            self._flat = [p.detach().view(-1) for p in self._params] if contiguous else None
        if self._flat is not None:  # (detached views: no graph to keep out of)
            return self._copies.copy_flat(self._flat, self._numel)
        with torch.no_grad():
            return self._copies.copy(self._params, self._numel)
