"""The training thread's share of the work: gather gradients, reduce them, hand them off.

Every step, `Collector.guard` takes each gradient's exact L2 norm in one batched pass; on
logged (and bad) steps `Collector.collect` adds the rest and one host copy per device. Neither
reads a value back, so on an accelerator neither waits for the device.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from gradtrack.capture.distributed import RankGroup, is_dtensor, local_tensor
from gradtrack.capture.layers import Layer
from gradtrack.capture.mesh import MeshReduction, ShardStep, check_placements
from gradtrack.capture.stats import (
    ShapeGroups,
    abs_norms,
    copy_to_host,
    fill_nonfinite_counts,
    flat_copy,
    flatten,
    l2_norms,
    nonfinite_counts,
    pack_offsets,
    packed_l2_norms,
    sample_bounds,
    sample_elements,
    start_offsets,
    stat_rows,
    stored_values,
)
from gradtrack.capture.zero import PartitionGrads, full_numel
from gradtrack.config import GradtrackConfig
from gradtrack.formats.histogram import split_in_proportion
from gradtrack.handoff.layout import (
    EvidenceLayout,
    FlatGrads,
    HostPart,
    StepEvidence,
    TensorIndex,
)
from gradtrack.handoff.shared import SharedCopies, ring_bytes

_LAYOUT = operator.attrgetter("layout")
# A layout: each gradient's (None where absent), and whether each parameter requires one.
_LayoutKey = tuple[tuple[object, ...], tuple[bool, ...]]
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


# A logged step of at most this many fp32 elements on the CPU hands the worker one copy of
# its gradients, end to end, and the worker reduces them (`gradtrack.handoff.layout.FlatGrads`):
# below it a step's statistics cost more in per-call Python than in arithmetic (its L1, max
# and exact L2 took ~80 µs of the training thread's time on the 6,500 weights of
# `benchmarks.fastloop`'s tight loop, the copy ~3 µs). Past it the copy would cost what the
# reductions do, and a worker process's feed thread would hold the GIL to pickle it.
DEFER_BELOW_ELEMENTS = 1 << 16


@dataclass
class DeviceGrads:
    """One device's gradients at one step, grouped by dtype, with their L2 norms (exact, or
    the guard's plain pass where ``deferred``: the worker reduces the step's copy)."""

    device: torch.device
    foreach_only: bool  # the accelerator kernel path (kernels per step independent of depth)
    index: np.ndarray  # for each row: the tensor's index in `Collector.params`
    groups: list[tuple[slice, list[Tensor]]]  # per dtype: its rows and its gradients
    l2: Tensor  # float64 [rows], on the device
    deferred: bool = False
    # Where deferred and packed: the gradients end to end, as the guard concatenated them
    # for their norms (a new tensor), which the step's copy is made from; each one's first
    # element in it.
    flat: Tensor | None = None
    offsets: np.ndarray | None = None


class GroupPlan(NamedTuple):
    """One device-and-dtype group of a layout: its tensors' indices in `Collector.params`,
    and whether every one of them is used as it is (no sparse, complex or empty gradient)."""

    indices: list[int]
    simple: bool
    # Where the group is many small CPU tensors: each one's first element in their packed
    # concatenation, for the guard's one packed pass (`gradtrack.capture.stats.l2_norms`).
    offsets: np.ndarray | None = None
    dtype: torch.dtype = torch.float32  # (of the tensors whose statistics are taken)
    elements: int = 0  # in all, in those tensors
    # ... and where those are of few shapes: gathered by one stack per shape instead.
    shapes: ShapeGroups | None = None


class DevicePlan(NamedTuple):
    """One device's groups in a layout, with what every step would otherwise recompute:
    each group's rows and the rows' tensor indices."""

    device: torch.device
    groups: list[GroupPlan]
    slices: list[slice]
    tensors: np.ndarray  # for each row: the tensor's index in `Collector.params`

    @classmethod
    def of(cls, device: torch.device, groups: list[GroupPlan]) -> DevicePlan:
        slices, start = [], 0
        for group in groups:
            slices.append(slice(start, start + len(group.indices)))
            start += len(group.indices)
        tensors = np.concatenate([np.asarray(g.indices, dtype=np.int64) for g in groups])
        return cls(device, groups, slices, tensors)


class Layouts:
    """The layouts a step's gradients come in — which are present, how each is laid out,
    which parameters still require one — each grouped once per device and dtype (`_plan`),
    so that a step pays a few C-level passes over its gradients to find its plan."""

    def __init__(
        self,
        params: list[nn.Parameter],
        usable: Callable[[Tensor], Tensor],
        check: Callable[[int, Tensor], None],
    ) -> None:
        self._params = params
        self._usable = usable  # the tensor whose statistics are a gradient's
        self._check = check  # raises for a gradient laid out in a way gradtrack refuses
        self._plans: dict[_LayoutKey, list[DevicePlan]] = {}
        self._last: tuple[_LayoutKey, list[DevicePlan]] | None = None  # (the last step's)

    def plan(self, grads: list[Tensor]) -> list[DevicePlan]:
        try:  # (the usual case: every gradient is there)
            layouts = tuple(map(_LAYOUT, grads))
        except AttributeError:  # (None, an absent gradient, has no layout)
            layouts = tuple(None if g is None else g.layout for g in grads)
        key = (layouts, tuple(map(_REQUIRES_GRAD, self._params)))
        last = self._last
        if last is not None and key == last[0]:  # (element by element, no hash of the key)
            return last[1]
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(grads)
        self._last = key, plan
        return plan

    def _plan(self, grads: list[Tensor]) -> list[DevicePlan]:
        """How this layout of present gradients groups: per device, per dtype, the tensors'
        indices and whether each is used as it is (the common dense case)."""
        if len(self._plans) > 64:  # layouts that keep changing: keep the cache small
            self._plans.clear()
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[bool], list[int]]]
        groups = defaultdict(lambda: ([], [], []))
        for i, (param, grad) in enumerate(zip(self._params, grads)):
            if grad is None or not param.requires_grad:
                continue
            self._check(i, grad)
            usable = self._usable(grad)
            simple = usable is grad
            indices, simples, numels = groups[(usable.device, usable.dtype)]
            indices.append(i)
            simples.append(simple)
            numels.append(usable.numel())
        by_device: dict[torch.device, list[GroupPlan]] = defaultdict(list)
        for (device, dtype), (indices, simples, numels) in groups.items():
            simple = all(simples)  # (packed: gradients used as they are)
            tensors = [grads[i] for i in indices]
            offsets = pack_offsets(tensors) if simple else None
            shapes = None if offsets is None else ShapeGroups.of(tensors)
            group = GroupPlan(indices, simple, offsets, dtype, sum(numels), shapes)
            by_device[device].append(group)
        return [DevicePlan.of(device, device_groups) for device, device_groups in by_device.items()]


@dataclass
class Guard:
    """What every step computes, logged or not: the present gradients and their L2 norms
    (one batched pass, the cost of `clip_grad_norm_`'s), kept on their devices."""

    devices: list[DeviceGrads]
    exact: bool = True  # norms exact (logged steps), or the plain pass between them

    def finite(self, wait: bool = False) -> bool | None:
        """Whether every gradient is finite; None if only a host sync could tell (an
        accelerator, unless ``wait``: a raise rule may pay one sync per step)."""
        if not wait and any(part.device.type != "cpu" for part in self.devices):
            return None
        return all(
            bool(np.isfinite(part.l2.numpy()).all())
            if part.device.type == "cpu"
            else bool(torch.isfinite(part.l2).all())  # the one sync a raise rule may cost
            for part in self.devices
        )


class Sampler:
    """A logged step's histogram samples: each tensor's share of its layer's sample
    (`_split_sample_budget`), drawn with one seeded generator per device, the bounds of each
    set of tensors kept on its device across steps (a copy to an accelerator every step
    would wait for it)."""

    def __init__(self, counts: np.ndarray, seed: int) -> None:
        self.counts = counts  # per tensor in `Collector.params`, on this rank
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._bounds: dict[tuple[torch.device, bytes, tuple[int, ...]], Tensor] = {}

    def draw(self, part: DeviceGrads) -> list[Tensor]:
        """One sample per dtype group of the device's gradients."""
        return [self._draw(part.device, part.index[rows], grads) for rows, grads in part.groups]

    def counts_of(self, index: np.ndarray, grads: Sequence[Tensor]) -> np.ndarray:
        """The elements each tensor's sample holds: its share, or all of a smaller tensor."""
        return np.minimum(self.counts[index], _numel_of(grads))

    def _draw(self, device: torch.device, indices: np.ndarray, grads: list[Tensor]) -> Tensor:
        counts = self.counts[indices].tolist()
        key = (device, indices.tobytes(), tuple(g.numel() for g in grads))
        if key not in self._bounds:
            if len(self._bounds) >= 8:
                self._bounds.clear()
            self._bounds[key] = sample_bounds(grads, counts, device)
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
            self._generators[device].manual_seed(self._seed)
        return sample_elements(grads, counts, self._generators[device], self._bounds[key])


def ring_size(config: GradtrackConfig, params: Iterable[Tensor]) -> int:
    """The bytes of the ring a worker process shares for a watch of a model with ``params``
    (`ring_bytes`, for the steps whose copies go out: logged or sampled), or 0 where none of
    the model's weights is an fp32 CPU tensor (a model on an accelerator, or in another
    dtype): no step of it is ever copied whole. Any fp32 CPU weight gets a ring, whatever
    the model's size: which steps are copied is decided at each step, from the gradients
    present (a sparse one's values, an unused branch's none) and the layers watched."""
    if not any(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):
        return 0
    sampled = config.histograms.every
    return ring_bytes(config.log_every if sampled is None else min(config.log_every, sampled))


class WholeCopies:
    """A small model on the CPU: what the worker reduces from one copy, where the training
    thread would otherwise pay a dozen small reductions in per-call Python — a logged step's
    gradients (`FlatGrads`) and the weights around its optimizer step
    (`gradtrack.capture.updates.WholeUpdateProbe`): dense fp32 CPU tensors, at most
    `DEFER_BELOW_ELEMENTS` in all, summarised whole by this process (``here``: no mesh, ZeRO
    partitions or DTensor shards)."""

    def __init__(self, here: bool) -> None:
        self.here = here
        self._offsets: dict[tuple[int, ...], np.ndarray] = {}  # by the tensors' sizes
        # Where the copies are laid when the worker is a process: memory it reads in place.
        self.shared: SharedCopies | None = None

    def copy(self, tensors: Sequence[Tensor], numel: int) -> Tensor:
        """``tensors`` (``numel`` elements in all) end to end in a new float32 tensor: laid
        in the memory the worker process shares where it has room, else an ordinary one."""
        into = None if self.shared is None else self.shared.empty(numel)
        if into is None:
            return flat_copy(tensors)
        return into.copy_(flatten(tensors) if len(tensors) > 1 else tensors[0].reshape(-1))

    def copy_by_shape(self, shapes: ShapeGroups, tensors: Sequence[Tensor], numel: int) -> Tensor:
        """`copy`, of many small tensors of few shapes: stacked by shape into the copy."""
        into = None if self.shared is None else self.shared.empty(numel)
        return shapes.flatten(tensors, out=into)

    def copy_flat(self, flat: list[Tensor], numel: int) -> Tensor:
        """`copy`, of tensors given as their flat views (``numel`` elements in all): one
        ``cat`` straight into the copy."""
        into = None if self.shared is None else self.shared.empty(numel)
        return torch.cat(flat) if into is None else torch.cat(flat, out=into)

    def fit(self, tensors: Sequence[Tensor]) -> bool:
        """Whether ``tensors`` (the weights) are handed off whole: none empty."""
        return (
            self.here
            and bool(tensors)
            and all(
                t.device.type == "cpu"
                and t.dtype == torch.float32
                and t.layout == torch.strided
                and t.numel() > 0
                for t in tensors
            )
            and sum(t.numel() for t in tensors) <= DEFER_BELOW_ELEMENTS
        )

    def fits_plan(self, plan: DevicePlan, foreach_only: bool) -> bool:
        """Whether a logged step on this layout hands the worker its gradients to reduce."""
        return (
            not foreach_only
            and self.here
            and plan.device.type == "cpu"
            and all(group.dtype == torch.float32 for group in plan.groups)
            and sum(group.elements for group in plan.groups) <= DEFER_BELOW_ELEMENTS
        )

    def hand_off(
        self,
        part: DeviceGrads,
        sampler: Sampler | None,
        evidence: StepEvidence | None,
        full: bool,
    ) -> HostPart:
        """A small CPU step's part: its gradients copied end to end, for the worker to reduce;
        its samples, where due (``sampler``), drawn here as always."""
        grads = [grad for _, group in part.groups for grad in group]
        kept = None if evidence is None else evidence.kept_outputs
        if kept is not None and kept.copied_whole():  # (the output rides along, unchecked)
            evidence.kept_outputs = None  # type: ignore[union-attr]
        else:
            kept = None
        sizes = None if kept is None else kept.sizes()  # (its outputs' and their gradients')
        # (a copy: the user may change the gradients after the step; the guard's concatenation
        # is one already, made in this step)
        copied = grads if part.flat is None else [part.flat]
        together = copied if kept is None else [*copied, *kept.outputs, *kept.grads]
        offsets, elements = self._offsets_of(part, grads)
        numel = elements + (0 if sizes is None else sizes[0] + sizes[1])
        if part.flat is not None and kept is None and self.shared is None:
            values = part.flat  # (its own tensor: nothing to copy)
        else:
            values = self.copy(together, numel)
        samples = sampler.draw(part) if sampler is not None else []
        counts = sampler.counts_of(part.index, grads) if sampler is not None else None
        return cpu_part(
            part.index,
            counts,
            samples,
            evidence,
            flat=FlatGrads(values, offsets, full, sizes),
        )

    def _offsets_of(self, part: DeviceGrads, grads: list[Tensor]) -> tuple[np.ndarray, int]:
        """Each gradient's first element in the step's copy, and their elements in all: the
        layout's where the guard concatenated them, else kept per layout as the plans are."""
        if part.flat is not None and part.offsets is not None:
            return part.offsets, part.flat.numel()
        numels = tuple(g.numel() for g in grads)
        offsets = self._offsets.get(numels)
        if offsets is None:
            if len(self._offsets) > 64:
                self._offsets.clear()
            offsets = self._offsets[numels] = start_offsets(numels)
        return offsets, sum(numels)


class Collector:
    """Flattened view of the watched layers' parameters, and the step's batched reduction.

    With ``ranks`` of a sharded (DTensor) job, each rank reduces its local shards and one
    all-gather per logged step combines them (`gradtrack.capture.mesh.MeshReduction`, built here:
    one collective to find each piece's owner); DTensor gradients without ``ranks`` are
    summarised as this rank's shards. With ``partitions`` (DeepSpeed ZeRO 1–3) the gradients
    are read from the optimizer's partitions, not ``p.grad``, and combined the same way.
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        sample_size: int,
        seed: int,
        ranks: RankGroup | None = None,
        partitions: PartitionGrads | None = None,
    ) -> None:
        self.params = [p for layer in layers for p in layer.params]
        self.partitions = partitions
        tensor_layer = np.array(
            [i for i, layer in enumerate(layers) for _ in layer.params], dtype=np.int64
        )
        self.local_shards = any(is_dtensor(p) for p in self.params)
        # The weights themselves are in pieces (FSDP2's DTensors, ZeRO-3): no update signals.
        self.sharded_weights = self.local_shards or bool(partitions and partitions.stage3)
        self.mesh, sample_counts, numel = _combined_pieces(
            layers, self.params, tensor_layer, ranks, partitions, sample_size
        )
        self.sampler = Sampler(sample_counts, seed)
        # (each gradient summarised whole by this process: no pieces to combine)
        self.whole = WholeCopies(self.mesh is None and partitions is None and not self.local_shards)
        self.index = TensorIndex(
            tuple(layer.name for layer in layers), tensor_layer, np.array(numel, dtype=np.int64)
        )
        self._placeholders: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self.layouts = Layouts(self.params, self._usable, self._check_placements)
        self.host_transfers = 0
        # Kernels per step independent of the number of tensors, and NaN/Inf counted on the
        # device without a sync: what accelerators need. None: on every device but the CPU.
        self.foreach_only: bool | None = None

    def guard(self, exact: bool = True) -> Guard:
        """Every present gradient's L2 norm, grouped per device and dtype.

        ``exact`` (logged steps): each norm to ~1e-7 relative. Without it (the steps in
        between, which need only the verdict) the CPU takes one plain fp32 pass, the floor's:
        a norm of millions of elements may then be off by ~1e-4 relative, but a finite
        gradient still never reads Inf (overflow is redone exactly). Accelerators are always
        exact (fp64 accumulation costs them nothing).
        """
        with torch.no_grad():
            found: list[Tensor | None] = (
                [p.grad for p in self.params] if self.partitions is None else self.partitions()
            )
            grads: list[Tensor] = found  # type: ignore[assignment]
            plan = self.layouts.plan(grads)
            parts = []
            for device_plan in plan:
                present = [
                    [grads[i] for i in group.indices]
                    if group.simple
                    else [self._usable(grads[i]) for i in group.indices]
                    for group in device_plan.groups
                ]
                parts.append(self._device_grads(device_plan, present, exact))
            return Guard(parts, exact)

    def _check_placements(self, i: int, grad: Tensor) -> None:
        if self.mesh is not None and is_dtensor(grad):
            check_placements(grad, self.index.layer_names[self.index.tensor_layer[i]])

    def _usable(self, grad: Tensor) -> Tensor:
        """The dense, real, non-empty tensor whose statistics are the gradient's."""
        if self.local_shards:
            grad = local_tensor(grad)
        # A sparse gradient's statistics are its stored values': implicit zeros add nothing.
        grad = stored_values(grad)
        if grad.is_complex():  # summarised as |z|: the norm of the complex tensor
            grad = grad.abs()
        if grad.numel() == 0:
            grad = self._placeholder(grad)
        return grad

    def _device_grads(
        self, plan: DevicePlan, groups: list[list[Tensor]], exact: bool
    ) -> DeviceGrads:
        device = plan.device
        foreach_only = device.type != "cpu" if self.foreach_only is None else self.foreach_only
        # (deferred: the worker's rows are exact; the guard's verdict needs only the plain pass)
        deferred = exact and self.whole.fits_plan(plan, foreach_only)
        flat = None
        if deferred and plan.groups[0].offsets is not None:  # (one fp32 group, packed)
            shapes = plan.groups[0].shapes  # (concatenated once: for the norms and the copy)
            flat = flatten(groups[0]) if shapes is None else shapes.flatten(groups[0])
            norms = [packed_l2_norms(flat, plan.groups[0].offsets)]
        else:
            norms = [
                l2_norms(
                    grads,
                    on_host=not foreach_only,
                    exact=exact and not deferred,
                    packed=group.offsets,
                )
                for group, grads in zip(plan.groups, groups)
            ]
        return DeviceGrads(
            device,
            foreach_only,
            plan.tensors,
            list(zip(plan.slices, groups)),
            torch.cat(norms) if len(norms) > 1 else norms[0],
            deferred,
            flat,
            None if flat is None else plan.groups[0].offsets,
        )

    def collect(
        self,
        guard: Guard,
        with_samples: bool,
        evidence: StepEvidence | None = None,
        full: bool = True,
    ) -> list[HostPart]:
        """The step's statistics from its ``guard``; one `HostPart` per device (usually one).

        The step's ``evidence`` rides along in the first part: in its host copy on an
        accelerator, read directly on the CPU.
        Without ``full`` only the guard's L2 norms and the NaN/Inf counts are taken (L1 and
        max NaN): L1 and max cost two more passes over every gradient.
        """
        with torch.no_grad():
            return [
                self._reduce_device(part, with_samples, evidence if i == 0 else None, full)
                for i, part in enumerate(guard.devices)
            ]

    def _reduce_device(
        self,
        part: DeviceGrads,
        with_samples: bool,
        evidence: StepEvidence | None,
        full: bool,
    ) -> HostPart:
        device, foreach_only = part.device, part.foreach_only
        if part.deferred:
            self.host_transfers += 1
            return self.whole.hand_off(part, self.sampler if with_samples else None, evidence, full)
        if full:
            on_host = not foreach_only
            l1, linf = zip(*(abs_norms(grads, on_host) for _, grads in part.groups))
            rows = stat_rows(part.l2, torch.cat(l1), torch.cat(linf))
        else:
            rows = stat_rows(part.l2)
        all_grads = [grad for _, grads in part.groups for grad in grads]
        if foreach_only:
            for group_rows, grads in part.groups:
                rows[group_rows, 3:] = nonfinite_counts(grads)
        else:  # CPU rows: count NaN/Inf now, where norms came out non-finite
            fill_nonfinite_counts(rows.numpy(), all_grads)
        tensor_index = part.index
        samples = self.sampler.draw(part) if with_samples else []
        sample_counts = self.sampler.counts_of(tensor_index, all_grads) if with_samples else None
        if self.mesh is not None:
            combined = self.mesh(
                ShardStep(rows, tensor_index, samples, sample_counts, evidence or StepEvidence())
            )
            rows, samples, sample_counts = combined.rows, combined.samples, combined.sample_counts
            evidence = combined.evidence if evidence is not None else None
        return self._hand_off(device, rows, tensor_index, samples, sample_counts, evidence)

    def _hand_off(
        self,
        device: torch.device,
        rows: Tensor,
        tensor_index: np.ndarray,
        samples: list[Tensor],
        sample_counts: np.ndarray | None,
        evidence: StepEvidence | None,
    ) -> HostPart:
        """The device's `HostPart`: its one host copy launched, or on the CPU the tensors
        themselves."""
        self.host_transfers += 1
        if device.type == "cpu":  # nothing to copy: the worker reads these tensors
            return cpu_part(tensor_index, sample_counts, samples, evidence, buffer=rows)
        layout = EvidenceLayout() if evidence is None else evidence.layout()
        float64 = [rows.reshape(-1)]
        if evidence is not None:
            float64.append(evidence.on_device(device))
        pieces = [torch.cat(float64).view(torch.float32), *samples]
        buffer, ready = copy_to_host(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
        return HostPart(
            tensor_index,
            sample_counts,
            buffer=buffer,
            ready=ready,
            evidence_layout=layout,
        )

    def _placeholder(self, grad: Tensor) -> Tensor:
        # foreach max-norm has no identity for empty tensors; one zero reads the same.
        key = (grad.device, grad.dtype)
        if key not in self._placeholders:
            self._placeholders[key] = torch.zeros(1, device=grad.device, dtype=grad.dtype)
        return self._placeholders[key]


def cpu_part(
    tensor_index: np.ndarray,
    sample_counts: np.ndarray | None,
    samples: list[Tensor],
    evidence: StepEvidence | None,
    buffer: Tensor | None = None,
    flat: FlatGrads | None = None,
) -> HostPart:
    """A CPU device's `HostPart`: nothing to copy, the worker reads these tensors (its rows
    in ``buffer``, or its gradients in ``flat``) and packs the step's evidence (the user's
    own output tensors, where kept unchecked, are checked now: the loop may change them)."""
    if evidence is not None:
        evidence.check_kept()
    return HostPart(
        tensor_index,
        sample_counts,
        buffer=buffer,
        cpu_samples=(torch.cat(samples) if len(samples) > 1 else samples[0]) if samples else None,
        flat=flat,
        unpacked=evidence,
    )


def _combined_pieces(
    layers: Sequence[Layer],
    params: list[nn.Parameter],
    tensor_layer: np.ndarray,
    ranks: RankGroup | None,
    partitions: PartitionGrads | None,
    sample_size: int,
) -> tuple[MeshReduction | None, np.ndarray, list[int]]:
    """How the ranks' pieces of each gradient combine (None: they do not), each tensor's
    histogram sample on this rank, and the elements each tensor's statistics cover: the
    whole tensor's where pieces combine or the gradient is whole, else this rank's piece's
    (DTensor shards or ZeRO partitions summarised by each rank on its own)."""
    sample_counts = _split_sample_budget(layers, sample_size)
    numel = [full_numel(p) for p in params]
    mesh = None
    if partitions is not None and ranks is not None:
        mesh = MeshReduction.for_partitions(
            ranks, partitions.local_numel, sample_counts, params[0].device
        )
    elif partitions is not None:
        numel = list(partitions.local_numel)
    elif ranks is not None and ranks.layout == "sharded":
        names = [layers[i].name for i in tensor_layer]
        mesh = MeshReduction.build(ranks, list(zip(names, params)), sample_counts)
    elif any(is_dtensor(p) for p in params):
        numel = [local_tensor(p).numel() for p in params]
    return mesh, (sample_counts if mesh is None else mesh.local_sample_counts), numel


def _numel_of(grads: Sequence[Tensor]) -> np.ndarray:
    return np.array([g.numel() for g in grads], dtype=np.int64)


def _split_sample_budget(layers: Sequence[Layer], sample_size: int) -> np.ndarray:
    """Per tensor, its share of its layer's sample: ``min(sample_size, layer numel)`` in all,
    split in proportion to size."""
    counts = [
        split_in_proportion(sample_size, np.array([full_numel(p) for p in layer.params]))
        for layer in layers
    ]
    return np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
