"""Batched on-device gradient reductions: a few foreach kernels per (device, dtype) group.

No I/O and no host synchronisation, except in `copy_to_host` (one copy per device and
step) and `fill_nonfinite_counts` (CPU tensors only, and only on non-finite steps).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradtrack.handoff.layout import L2, NAN

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def flatten(grads: Sequence[Tensor]) -> Tensor:
    """The tensors' elements end to end, in one new tensor (one tensor alone: a view of it).

    One C++ call flattens and concatenates, the helper DDP's bucketing uses: the public
    ``torch.cat([g.reshape(-1) for g in grads])`` pays a Python ``reshape`` per tensor, ~2.5x
    the time on 600 small tensors (0.86 ms against 0.34 ms), and the guard packs them at
    every step."""
    return torch._utils._flatten_dense_tensors(grads)


def flat_copy(tensors: Sequence[Tensor]) -> Tensor:
    """`flatten`, always into a new tensor: a copy that keeps its values when the tensors
    change (one tensor alone flattens to a view of itself, which would not).

    >>> weight = torch.ones(2, 2)
    >>> copy = flat_copy([weight])
    >>> _ = weight.mul_(3)
    >>> copy.tolist()
    [1.0, 1.0, 1.0, 1.0]
    """
    values = flatten(tensors)
    return values.clone() if len(tensors) == 1 else values


def stored_values(grad: Tensor) -> Tensor:
    """The elements a gradient stores: a sparse one's values (coalesced, so that each index
    counts once), a dense one as it is.

    >>> sparse = torch.sparse_coo_tensor([[0, 0, 2]], [1.0, 2.0, 4.0], (3,), check_invariants=True)
    >>> stored_values(sparse).tolist()
    [3.0, 4.0]
    """
    return grad.coalesce().values() if grad.is_sparse else grad


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a reduction over ``dtype`` accumulates in: fp32 for fp16/bf16 (whose own
    range overflows on a long sum of squares), else the tensor's own (None).

    >>> accumulation_dtype(torch.bfloat16), accumulation_dtype(torch.float32)
    (torch.float32, None)
    """
    return torch.float32 if dtype in _LOW_PRECISION else None


# On CPU, tensors smaller than this are reduced packed together (see `abs_norms`): the
# packed path costs per element, the foreach path per tensor. Measured over the benchmark
# models, 2^12 was best or equal (quickstart CNN: 169 -> 120 us per step against 2^16).
PACK_BELOW_ELEMENTS = 1 << 12
# ... and packed only where there are this many: below it the per-tensor kernels cost less.
PACK_MIN_TENSORS = 32
# Temporaries of the on-device NaN/Inf count are made this many elements at a time, at most.
_COUNT_CHUNK_ELEMENTS = 1 << 25


class DeviceIndex:
    """Row indices kept on their device across steps: a host→device copy every step would
    wait for the device (pageable memory), and the set of tensors with gradients rarely
    changes, so a few layouts are remembered.

    >>> DeviceIndex()(np.array([2, 0]), torch.device("cpu"))
    tensor([2, 0])
    """

    def __init__(self, layouts: int = 8) -> None:
        self._layouts = layouts
        self._on_device: dict[tuple[torch.device, bytes], Tensor] = {}

    def __call__(self, index: np.ndarray, device: torch.device) -> Tensor:
        key = (device, index.tobytes())
        if key not in self._on_device:
            if len(self._on_device) >= self._layouts:
                self._on_device.clear()
            self._on_device[key] = torch.as_tensor(index, device=device)
        return self._on_device[key]


def l2_norms(
    grads: list[Tensor], on_host: bool, exact: bool = True, packed: np.ndarray | None = None
) -> Tensor:
    """float64 [len(grads)]: each gradient's exact L2 norm (the guard's one pass).

    ``grads`` share one device and dtype, and none is empty. On accelerators (``on_host``
    False) one foreach kernel accumulates in fp64. On the CPU, whose fp64 reductions copy
    the tensor first (~12x slower), fp32 partial sums are exact enough in chunks
    (`_cpu_norms`) and the rare norms fp32 cannot hold (overflow, underflow) are redone in
    fp64 (`_repair`), so a finite gradient always has a finite, non-zero-if-non-zero norm.
    NaN anywhere makes the norm NaN; ±Inf without NaN makes it Inf. Without ``exact`` the
    CPU takes one plain fp32 pass (the floor's cost; ~1e-4 relative at millions of
    elements) and redoes only overflowed norms, so the finite verdict stays right. Many
    small fp32 tensors (``packed``: their offsets in one concatenation, `pack_offsets`) are
    summed in one packed pass instead, exact or not: their squares in fp64, which no fp32
    value overflows or underflows, summed in fp64 (`packed_l2_norms`).

    >>> l2_norms([torch.tensor([3.0, -4.0]), torch.full((10_000,), 1e18)], on_host=True)
    tensor([5.0000e+00, 1.0000e+20], dtype=torch.float64)
    >>> l2_norms([torch.full((10_000,), 1e-24)], on_host=True)
    tensor([1.0000e-22], dtype=torch.float64)
    """
    if not on_host:
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))
    if packed is not None:  # (fp64 squares of fp32 values, summed in fp64: exact as it is)
        return packed_l2_norms(grads, packed)
    if exact:
        norms = _cpu_norms(grads, 2)
        _repair(norms, grads, 2)
        return norms
    accumulate = accumulation_dtype(grads[0].dtype)
    plain = torch.stack(torch._foreach_norm(grads, 2, dtype=accumulate)).numpy()
    norms = torch.from_numpy(plain.astype(np.float64))  # (numpy's cast: no kernel)
    if np.isinf(plain).any():
        overflowed = np.flatnonzero(np.isinf(plain))
        norms[overflowed] = exact_norms([grads[i] for i in overflowed], 2)
    return norms


def abs_norms(grads: list[Tensor], on_host: bool) -> tuple[Tensor, Tensor]:
    """float64 (L1 norm, max |g|) per gradient: the two extra passes of a per-layer step.

    On the CPU, tensors below `PACK_BELOW_ELEMENTS` are reduced packed together in fp64
    (`packed_abs_norms`), longer ones by a cascaded sum and one min/max pass each.

    >>> abs_norms([torch.tensor([3.0, -4.0])], on_host=True)
    (tensor([7.], dtype=torch.float64), tensor([4.], dtype=torch.float64))
    >>> abs_norms([torch.tensor([3.0, -4.0])], on_host=False)
    (tensor([7.], dtype=torch.float64), tensor([4.], dtype=torch.float64))
    """
    if not on_host:
        l1 = torch.stack(torch._foreach_norm(grads, 1, dtype=torch.float64))
        return l1, torch.stack(torch._foreach_norm(grads, math.inf)).double()
    small = [i for i, g in enumerate(grads) if g.numel() < PACK_BELOW_ELEMENTS]
    large = [i for i, g in enumerate(grads) if g.numel() >= PACK_BELOW_ELEMENTS]
    l1 = torch.empty(len(grads), dtype=torch.float64)
    linf = torch.empty(len(grads), dtype=torch.float64)
    if small:
        l1[small], linf[small] = packed_abs_norms([grads[i] for i in small])
    if large:
        big = [grads[i] for i in large]
        l1[large] = _cpu_norms(big, 1)
        # NaN propagates through aminmax and maximum, as through the max-norm.
        low, high = zip(*(torch.aminmax(g) for g in big))
        linf[large] = torch.maximum(torch.stack(high), torch.stack(low).neg()).double()
    _repair(l1, grads, 1)
    return l1, linf


def packed_abs_norms(grads: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Many small tensors at once: per-tensor overheads (a stack costs ~2 µs per tensor)
    dominate them, so copy them into one fp64 buffer and reduce it by segments.

    >>> packed_abs_norms([torch.tensor([3.0, -4.0]), torch.tensor([[-2.0]])])
    (tensor([7., 2.], dtype=torch.float64), tensor([4., 2.], dtype=torch.float64))
    """
    # One C++ call flattens and concatenates (DDP's bucketing uses the same helper). It
    # returns a single tensor's own storage: copy, since the reduction below works in place.
    absolute = flatten(grads).to(torch.float64, copy=True).abs_()
    lengths = torch.tensor([g.numel() for g in grads], device=absolute.device)
    l1 = torch.segment_reduce(absolute, "sum", lengths=lengths, unsafe=True)
    return l1, torch.segment_reduce(absolute, "max", lengths=lengths, unsafe=True)


def pack_offsets(tensors: Sequence[Tensor]) -> np.ndarray | None:
    """Where ``tensors`` (one device and dtype) are many small fp32 ones on the CPU, each
    one's first element in their concatenation, for `packed_squares`: each tensor's norm
    kernel then costs more than its elements (600 tensors of 8-64 elements take ~0.9 ms one
    by one, ~0.3 ms packed). None otherwise."""
    if not tensors or tensors[0].device.type != "cpu" or tensors[0].dtype != torch.float32:
        return None
    numels = [t.numel() for t in tensors]
    if len(numels) < PACK_MIN_TENSORS or max(numels) >= PACK_BELOW_ELEMENTS or min(numels) == 0:
        return None
    return start_offsets(numels)


def start_offsets(numels: Sequence[int]) -> np.ndarray:
    """Each tensor's first element where tensors of these sizes lie end to end.

    >>> start_offsets([3, 1, 2]).tolist()
    [0, 3, 4]
    """
    return np.concatenate([[0], np.cumsum(numels[:-1])]).astype(np.int64)


def packed_l2_norms(grads: list[Tensor] | Tensor, offsets: np.ndarray) -> Tensor:
    """float64 L2 norms of many small fp32 CPU tensors in one pass: concatenated by one C++
    call, squared in fp64 (no fp32 value overflows or underflows there) and summed by
    segment (``offsets``: each tensor's first element in the concatenation, none empty).
    ``grads`` may be that concatenation already (`flatten`'s).

    >>> grads = [torch.tensor([3.0, -4.0]), torch.tensor([[1e-30]]), torch.tensor([1e30])]
    >>> packed_l2_norms(grads, np.array([0, 2, 3]))
    tensor([5.0000e+00, 1.0000e-30, 1.0000e+30], dtype=torch.float64)
    """
    return torch.from_numpy(np.sqrt(packed_squares(grads, offsets)))


def packed_squares(grads: list[Tensor] | Tensor, offsets: np.ndarray) -> np.ndarray:
    """float64 squared L2 norms of many small fp32 CPU tensors (see `packed_l2_norms`)."""
    values = grads if isinstance(grads, Tensor) else flatten(grads)
    return np.add.reduceat(np.square(values.numpy(), dtype=np.float64), offsets)


# Shapes at most one per this many tensors: a `ShapeGroups` pass costs ~6 calls per shape.
_TENSORS_PER_SHAPE = 16


class ShapeGroups:
    """Many small fp32 CPU tensors of few shapes (a model of repeated blocks), gathered by one
    `torch.stack` per shape where `flatten` makes a view of every tensor: `squares` is
    `packed_squares` (600 tensors of two shapes: ~45 µs against ~175 µs, warm), `flatten`
    is `flatten` (~75 µs against ~195 µs) — the same values, the same norms to the last bit.

    >>> grads = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0]]), torch.tensor([0.0, 2.0])]
    >>> groups = ShapeGroups.of(grads, minimum=1)
    >>> groups.squares(grads).tolist() == packed_squares(grads, start_offsets([2, 1, 2])).tolist()
    True
    >>> groups.flatten(grads).tolist()
    [3.0, 4.0, 1.0, 0.0, 2.0]
    """

    def __init__(self, by_shape: dict[tuple[int, ...], list[int]]) -> None:
        # Per shape: its tensors' positions, what picks them, their first elements in its stack.
        self._groups: list[tuple[np.ndarray, Callable[[Sequence[Tensor]], Any], np.ndarray]] = []
        count = sum(len(positions) for positions in by_shape.values())
        first, numels = np.zeros(count, dtype=np.int64), np.zeros(count, dtype=np.int64)
        laid = 0  # (where each stack starts in the stacks laid end to end)
        for shape, positions in by_shape.items():
            numel = math.prod(shape)
            starts = np.arange(len(positions), dtype=np.int64) * numel
            self._groups.append((np.array(positions), operator.itemgetter(*positions), starts))
            first[positions], numels[positions] = laid + starts, numel
            laid += numel * len(positions)
        self._count = count
        # Each element's place in the stacks laid end to end, in `flatten`'s order.
        pairs = zip(first.tolist(), numels.tolist())
        self._order_array = np.concatenate([np.arange(f, f + n) for f, n in pairs])

    @classmethod
    def of(cls, tensors: Sequence[Tensor], minimum: int = _TENSORS_PER_SHAPE) -> ShapeGroups | None:
        """The groups of ``tensors`` by shape; None where there are more shapes than one per
        ``minimum`` tensors (`flatten` costs less then)."""
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, tensor in enumerate(tensors):
            by_shape.setdefault(tuple(tensor.shape), []).append(i)
        if len(by_shape) * minimum > len(tensors):
            return None
        return cls(by_shape)

    def _stacks(self, grads: Sequence[Tensor]) -> list[tuple[np.ndarray, np.ndarray, Tensor]]:
        stacks = []
        for positions, pick, starts in self._groups:
            picked = pick(grads)
            stacks.append(
                (positions, starts, torch.stack(picked) if len(positions) > 1 else picked)
            )
        return stacks

    def squares(self, grads: Sequence[Tensor]) -> np.ndarray:
        """`packed_squares` of ``grads`` (laid out as the tensors grouped)."""
        squares = np.empty(self._count)
        for positions, starts, stack in self._stacks(grads):
            values = np.square(stack.numpy().reshape(-1), dtype=np.float64)
            squares[positions] = np.add.reduceat(values, starts)
        return squares

    @functools.cached_property
    def _order(self) -> Tensor:
        """`_order_array` as a tensor, made when a concatenation first needs it: a plan learnt
        for the norms alone makes no op."""
        return torch.from_numpy(self._order_array)

    def flatten(self, grads: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
        """`flatten` of ``grads``: their values end to end, in a new tensor or ``out``."""
        stacks = [stack.reshape(-1) for _, _, stack in self._stacks(grads)]
        stacked = torch.cat(stacks) if len(stacks) > 1 else stacks[0]
        return torch.index_select(stacked, 0, self._order, out=out)


def stat_rows(l2: Tensor, l1: Tensor | None = None, linf: Tensor | None = None) -> Tensor:
    """[n, 5] float64 rows (L2, L1, max, NaN, Inf); L1 and max NaN when not computed, the
    counts zero until counted.

    >>> stat_rows(torch.tensor([5.0], dtype=torch.float64))
    tensor([[5., nan, nan, 0., 0.]], dtype=torch.float64)
    """
    zeros = torch.zeros_like(l2)
    if l1 is None or linf is None:
        l1 = linf = torch.full_like(l2, math.nan)
    return torch.stack([l2, l1, linf, zeros, zeros], dim=1)


# CPU: tensors longer than this are reduced in chunks of this many elements, in the same
# foreach call as the rest, and the chunks' fp32 results added in fp64. CPU's norm kernels
# accumulate a long tensor in fp32 (measured: L2 1.5e-4 relative error at 6.4 M elements);
# chunks keep it near 1e-7 at the same speed. (Rows reduced along a dimension would be as
# exact, but such reductions stall for milliseconds on a loaded machine's thread pool.)
# fp16/bf16 values square exactly in fp32, and the rounding of their sums is biased, not
# random: 32,768 of them drift by 1-3e-6, so their chunks are shorter.
_CHUNK_ELEMENTS = 1 << 15
_LOW_PRECISION_CHUNK_ELEMENTS = 1 << 12
# Where fp32 (or fp64) accumulation may have lost precision: a square (for L2) or |g| (L1)
# below the smallest normal number m (fp32: 1.2e-38) loses at most m, so a norm of n
# elements is exact to 1e-6 if its sum of squares (or L1) is at least n · m / 1e-6. Below
# that, at Inf (an overflowed sum) and at 0 with a non-zero element, it is redone exactly.
_SMALLEST_NORMAL = {torch.float64: 2.3e-308}
_FP32_SMALLEST_NORMAL = 1.2e-38


def _cpu_norms(grads: list[Tensor], ord: int) -> Tensor:
    """fp32-accumulated norms (fp64 for fp64 gradients), long tensors in chunks; one
    foreach call (L2) or one cascaded sum per tensor (L1: CPU's L1 kernel drifts by 2e-6
    already at 4,096 elements, its sum does not)."""
    accumulate = accumulation_dtype(grads[0].dtype)
    if ord == 1:
        return torch.stack([g.abs().sum(dtype=accumulate) for g in grads]).double()
    chunk = _CHUNK_ELEMENTS if accumulate is None else _LOW_PRECISION_CHUNK_ELEMENTS
    owner = _chunk_owner(tuple(g.numel() for g in grads), chunk)
    if owner is None:
        return torch.stack(torch._foreach_norm(grads, 2, dtype=accumulate)).double()
    pieces: list[Tensor] = []
    for grad in grads:
        if grad.numel() > chunk:
            pieces.extend(grad.reshape(-1).unsafe_split(chunk))  # views; no autograd here
        else:
            pieces.append(grad)
    norms = torch.stack(torch._foreach_norm(pieces, 2, dtype=accumulate)).double()
    squares = torch.zeros(len(grads), dtype=torch.float64)
    return squares.index_add_(0, owner, norms.square()).sqrt_()


@functools.lru_cache(maxsize=64)
def _chunk_owner(numels: tuple[int, ...], chunk: int) -> Tensor | None:
    """For a layout's chunks, the index of the tensor each belongs to; None if no tensor
    is split. Cached: the same layout comes back every step."""
    counts = [max(1, -(-numel // chunk)) for numel in numels]
    if all(count == 1 for count in counts):
        return None
    return torch.repeat_interleave(torch.tensor(counts))


def _repair(norms: Tensor, grads: list[Tensor], ord: int) -> None:
    """Redo exactly, all at once, the CPU norms accumulation may have over- or underflowed."""
    values = norms.numpy()
    floor = _repair_floor(tuple(g.numel() for g in grads), grads[0].dtype, ord)
    if (values >= floor).all() and (values < math.inf).all():
        return  # (the usual step: two comparisons; NaN stays NaN, as below)
    with np.errstate(invalid="ignore"):
        # (0 too: an all-zero gradient, a dead layer, is common; one whose squares all
        # underflowed is not, but only the exact pass tells them apart)
        redo = np.flatnonzero(np.isinf(values) | ((values >= 0) & (values < floor)))
    if len(redo):
        norms[redo] = exact_norms([grads[i] for i in redo], ord)


@functools.lru_cache(maxsize=64)
def _repair_floor(numels: tuple[int, ...], dtype: torch.dtype, ord: int) -> np.ndarray:
    """Per tensor, the least norm the accumulation cannot have lost precision in (see
    `_SMALLEST_NORMAL`). Cached: the same layout comes back every step."""
    smallest = _SMALLEST_NORMAL.get(dtype, _FP32_SMALLEST_NORMAL)
    enough = np.array(numels, dtype=np.float64) * smallest / 1e-6
    return np.sqrt(enough) if ord == 2 else enough


def exact_norms(grads: list[Tensor], ord: int) -> Tensor:
    """Norms in fp64, each scaled by its max |g| so that neither overflow nor underflow can
    occur: one packed pass for all of ``grads``.

    >>> exact_norms([torch.tensor([1e300, -1e300], dtype=torch.float64)], 2)
    tensor([1.4142e+300], dtype=torch.float64)
    >>> exact_norms([torch.full((4,), 1e-30), torch.tensor([float("inf"), 1.0])], 1)
    tensor([4.0000e-30,        inf], dtype=torch.float64)
    """
    absolute = flatten(grads).to(torch.float64, copy=True).abs_()
    lengths = torch.tensor([g.numel() for g in grads])
    if grads[0].dtype != torch.float64:  # their squares cannot leave fp64's normal range
        scale = torch.ones(len(grads), dtype=torch.float64)
    else:
        peak = torch.segment_reduce(absolute, "max", lengths=lengths, unsafe=True)
        scale = torch.where(torch.isfinite(peak) & (peak > 0), peak, torch.ones_like(peak))
        absolute.div_(scale.repeat_interleave(lengths))
    if ord == 1:
        return torch.segment_reduce(absolute, "sum", lengths=lengths, unsafe=True) * scale
    squares = torch.segment_reduce(absolute.square_(), "sum", lengths=lengths, unsafe=True)
    return squares.sqrt_() * scale


def nonfinite_counts(grads: list[Tensor]) -> Tensor:
    """[len(grads), 2] float64: exact NaN and Inf counts, in foreach kernels, without a sync.

    ``g - g`` is NaN exactly where g is NaN or ±Inf; clamping to [-1, 1] first turns ±Inf
    finite, so the same difference is then NaN only where g is NaN. ``norm(·, 0)`` counts.

    >>> nonfinite_counts([torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])])
    tensor([[1., 2.]], dtype=torch.float64)
    """
    nonfinite: list[Tensor] = []
    nan: list[Tensor] = []
    for chunk in _chunks(grads, _COUNT_CHUNK_ELEMENTS):
        nonfinite += torch._foreach_norm(torch._foreach_sub(chunk, chunk), 0, dtype=torch.float64)
        clamped = torch._foreach_clamp_max(torch._foreach_clamp_min(chunk, -1.0), 1.0)
        nan += torch._foreach_norm(torch._foreach_sub(clamped, clamped), 0, dtype=torch.float64)
    nan_count = torch.stack(nan)
    return torch.stack([nan_count, torch.stack(nonfinite) - nan_count], dim=1)


def _chunks(tensors: Sequence[Tensor], max_elements: int) -> list[list[Tensor]]:
    chunks: list[list[Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if chunks[-1] and size + tensor.numel() > max_elements:
            chunks.append([])
            size = 0
        chunks[-1].append(tensor)
        size += tensor.numel()
    return chunks


def sample_bounds(grads: Sequence[Tensor], counts: Sequence[int], device: torch.device) -> Tensor:
    """For each element `sample_elements` draws, the size of the tensor it is drawn from
    (float64, on ``device``): one tensor for a step's draws, built once per layout.

    >>> sample_bounds([torch.zeros(10), torch.zeros(2), torch.zeros(5)], [3, 4, 2], "cpu")
    tensor([10., 10., 10.,  5.,  5.], dtype=torch.float64)
    """
    drawn = [(g.numel(), c) for g, c in zip(grads, counts) if 0 < c < g.numel()]
    sizes = np.repeat([n for n, _ in drawn], [c for _, c in drawn]).astype(np.float64)
    return torch.from_numpy(sizes).to(device)


def sample_elements(
    grads: Sequence[Tensor], counts: Sequence[int], generator: torch.Generator, bounds: Tensor
) -> Tensor:
    """float32 samples, ``counts[i]`` elements drawn with replacement from ``grads[i]``.

    A tensor with no more elements than its count gives all of them. All draws come from one
    uniform tensor scaled by ``bounds`` (`sample_bounds`), so the kernels per step do not
    grow with the number of tensors beyond one gather each. Uses only ``generator``, so the
    training process's own random state is untouched.
    """
    pieces: list[Tensor] = []
    if len(bounds):
        draws = torch.rand(
            len(bounds), generator=generator, dtype=torch.float64, device=bounds.device
        )
        # u < 1 keeps u * n below n; the minimum guards an index a device could not recover.
        index = torch.minimum(draws.mul_(bounds), bounds - 1).long()
        pieces = list(index.split([c for g, c in zip(grads, counts) if 0 < c < g.numel()]))
    picked = []
    drawn = iter(pieces)
    for grad, count in zip(grads, counts):
        flat = grad.reshape(-1)
        if count >= flat.numel():
            picked.append(flat)
        elif count > 0:
            picked.append(flat.index_select(0, next(drawn)))
    if not picked:
        return torch.empty(0, dtype=torch.float32, device=grads[0].device)
    return torch.cat(picked).to(torch.float32)


def copy_to_host(packet: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """The step's one device→host copy: asynchronous into pinned memory on CUDA."""
    if packet.device.type == "cpu":
        return packet, None
    host = torch.empty(packet.shape, dtype=packet.dtype, pin_memory=packet.is_cuda)
    host.copy_(packet, non_blocking=True)
    if not packet.is_cuda:
        return host, None
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def fill_nonfinite_counts(stats: np.ndarray, grads: list[Tensor]) -> None:
    """Count NaN/Inf exactly in the CPU tensors whose norms came out non-finite.

    On finite steps this is one numpy check; CPU tensors need no device synchronisation.
    """
    bad = np.flatnonzero(~np.isfinite(stats[:, L2]))  # any NaN/Inf element makes L2 so
    if len(bad) == 0:
        return
    counts = torch.stack(
        [torch.stack([grads[i].isnan().sum(), grads[i].isinf().sum()]) for i in bad.tolist()]
    )
    stats[bad, NAN:] = counts.numpy()
