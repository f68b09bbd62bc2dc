"""The training thread's share of the work: gather gradients, reduce them, hand them off.

`Collector.collect` launches the batched reductions and one host copy per device; it never
reads a value back, so on an accelerator it does not wait for the device.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from gradtrack.layers import Layer
from gradtrack.stats import (
    PACK_BELOW_ELEMENTS,
    HostPart,
    copy_to_host,
    fill_nonfinite_counts,
    nonfinite_counts,
    packed_norms,
    sample_bounds,
    sample_elements,
    tensor_norms,
)


class Collector:
    """Flattened view of the watched layers' parameters, and the step's batched reduction."""

    def __init__(self, layers: Sequence[Layer], sample_size: int, seed: int) -> None:
        self.layer_names = tuple(layer.name for layer in layers)
        self.params = [p for layer in layers for p in layer.params]
        self.tensor_layer = np.array(
            [i for i, layer in enumerate(layers) for _ in layer.params], dtype=np.int64
        )
        self.tensor_numel = np.array([p.numel() for p in self.params], dtype=np.int64)
        self.sample_counts = _split_sample_budget(layers, sample_size)
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._bounds: dict[tuple[torch.device, bytes, tuple[int, ...]], Tensor] = {}
        self._placeholders: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self.host_transfers = 0
        # Kernels per step independent of the number of tensors, and NaN/Inf counted on the
        # device without a sync: what accelerators need. None: on every device but the CPU.
        self.foreach_only: bool | None = None
        # Sharded (DTensor) gradients: reduce the local shards, then combine the rows across
        # ranks with ``reduce_shards`` (see `gradtrack.distributed.RankGroup.reduce_shards`).
        self.local_shards = False
        self.reduce_shards: Callable[[Tensor, np.ndarray, int], Tensor] | None = None

    def collect(
        self, with_samples: bool, flags: Sequence[Tensor | None] = (), full: bool = True
    ) -> list[HostPart]:
        """Reduce every present gradient; one `HostPart` per device (usually one).

        ``flags``, step evidence (tensors read as float64, None for unknown), ride along in
        the first part: in its host copy on an accelerator, read directly on the CPU.
        Without ``full`` only the L2 norms and NaN/Inf counts are computed (L1 and max NaN).
        """
        # Keyed by device, dtype and reduction: on the CPU, the full statistics of small
        # tensors are reduced packed together (`stats.packed_norms`), the rest per tensor
        # (`stats.tensor_norms`; for L2 alone one foreach call is cheaper than packing).
        groups: dict[tuple[torch.device, torch.dtype, bool], tuple[list[int], list[Tensor]]]
        groups = defaultdict(lambda: ([], []))
        foreach_only: dict[torch.device, bool] = {}
        pack_below = PACK_BELOW_ELEMENTS if full else 0
        with torch.no_grad():
            for i, param in enumerate(self.params):
                grad = param.grad
                if grad is None or not param.requires_grad:
                    continue
                if self.local_shards:
                    grad = grad.to_local()  # type: ignore[attr-defined]
                if grad.is_sparse:
                    # The dense gradient's statistics: implicit zeros add nothing to the sums.
                    grad = grad.coalesce()._values()
                numel = grad.numel()
                if numel == 0:
                    grad = self._placeholder(grad)
                device = grad.device
                if device not in foreach_only:
                    foreach_only[device] = (
                        device.type != "cpu" if self.foreach_only is None else self.foreach_only
                    )
                packed = numel < pack_below and not foreach_only[device]
                indices, grads = groups[(device, grad.dtype, packed)]
                indices.append(i)
                grads.append(grad)
            by_device: dict[torch.device, list[tuple[bool, list[int], list[Tensor]]]]
            by_device = defaultdict(list)
            for (device, _, packed), (indices, grads) in groups.items():
                by_device[device].append((packed, indices, grads))
            return [
                self._reduce_device(
                    device, group, foreach_only[device], with_samples, flags if i == 0 else (), full
                )
                for i, (device, group) in enumerate(by_device.items())
            ]

    def _reduce_device(
        self,
        device: torch.device,
        groups: list[tuple[bool, list[int], list[Tensor]]],
        foreach_only: bool,
        with_samples: bool,
        flags: Sequence[Tensor | None],
        full: bool,
    ) -> HostPart:
        stats, samples, all_grads = [], [], []
        for packed, indices, grads in groups:
            group_stats = packed_norms(grads) if packed else tensor_norms(grads, foreach_only, full)
            if foreach_only:
                group_stats[:, 3:] = nonfinite_counts(grads)
            stats.append(group_stats)
            if with_samples:
                counts = self.sample_counts[indices].tolist()
                bounds = self._sample_bounds(device, indices, grads, counts)
                samples.append(sample_elements(grads, counts, self._generator(device), bounds))
            all_grads.extend(grads)
        tensor_index = np.concatenate([np.asarray(indices) for _, indices, _ in groups])
        rows = torch.cat(stats) if len(stats) > 1 else stats[0]
        if not foreach_only:  # CPU rows: count NaN/Inf now, where norms came out non-finite
            fill_nonfinite_counts(rows.numpy(), all_grads)
        if self.reduce_shards is not None:
            rows = self.reduce_shards(rows, tensor_index, len(self.params))
        sample_counts = (
            np.minimum(self.sample_counts[tensor_index], _numel_of(all_grads))
            if with_samples
            else None
        )
        self.host_transfers += 1
        if device.type == "cpu":  # nothing to copy: the worker reads these tensors
            return HostPart(
                tensor_index,
                sample_counts,
                buffer=rows,
                cpu_flags=host_flags(flags),
                cpu_samples=(torch.cat(samples) if len(samples) > 1 else samples[0])
                if samples
                else None,
            )
        float64 = [rows.reshape(-1)]
        device_flags = device_flags_of(flags, device)
        if device_flags is not None:
            float64.append(device_flags)
        pieces = [torch.cat(float64).view(torch.float32), *samples]
        buffer, ready = copy_to_host(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
        return HostPart(
            tensor_index,
            sample_counts,
            buffer=buffer,
            ready=ready,
            n_flags=0 if device_flags is None else device_flags.numel(),
        )

    def _sample_bounds(
        self, device: torch.device, indices: list[int], grads: list[Tensor], counts: list[int]
    ) -> Tensor:
        """`stats.sample_bounds` for this set of tensors, kept on the device across steps
        (a copy to an accelerator every step would wait for it)."""
        key = (device, np.asarray(indices).tobytes(), tuple(g.numel() for g in grads))
        if key not in self._bounds:
            if len(self._bounds) >= 8:
                self._bounds.clear()
            self._bounds[key] = sample_bounds(grads, counts, device)
        return self._bounds[key]

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed)
            self._generators[device] = generator
        return self._generators[device]

    def _placeholder(self, grad: Tensor) -> Tensor:
        # foreach max-norm has no identity for empty tensors; one zero reads the same.
        key = (grad.device, grad.dtype)
        if key not in self._placeholders:
            self._placeholders[key] = torch.zeros(1, device=grad.device, dtype=grad.dtype)
        return self._placeholders[key]


def device_flags_of(flags: Sequence[Tensor | None], device: torch.device) -> Tensor | None:
    """The flags as one float64 tensor on ``device`` (NaN where unknown); None if all unknown."""
    if all(flag is None for flag in flags):
        return None
    nan = torch.full((1,), float("nan"), dtype=torch.float64, device=device)
    return torch.cat(
        [
            nan if flag is None else flag.to(device, torch.float64, non_blocking=True).reshape(-1)
            for flag in flags
        ]
    )


def host_flags(flags: Sequence[Tensor | None]) -> np.ndarray | None:
    """CPU flags read directly into float64 (NaN where unknown); None if all unknown.

    >>> host_flags([torch.tensor(True), None, torch.tensor([2.0, 3.0])])
    array([ 1., nan,  2.,  3.])
    """
    if all(flag is None for flag in flags):
        return None
    return np.concatenate(
        [
            np.full(1, np.nan) if flag is None else flag.numpy().reshape(-1).astype(np.float64)
            for flag in flags
        ]
    )


def _numel_of(grads: Sequence[Tensor]) -> np.ndarray:
    return np.array([g.numel() for g in grads], dtype=np.int64)


def _split_sample_budget(layers: Sequence[Layer], sample_size: int) -> np.ndarray:
    """Per tensor, its share of its layer's sample: ``min(sample_size, layer numel)`` in all,
    split in proportion to size (largest remainders get the leftover elements)."""
    counts: list[np.ndarray] = []
    for layer in layers:
        sizes = np.array([p.numel() for p in layer.params], dtype=np.int64)
        total = int(sizes.sum())
        if total <= sample_size:
            counts.append(sizes)
            continue
        exact = sample_size * sizes / total
        share = np.floor(exact).astype(np.int64)
        leftover = sample_size - int(share.sum())
        share[np.argsort(share - exact, kind="stable")[:leftover]] += 1
        counts.append(share)
    return np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
