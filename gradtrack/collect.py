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
    HostPart,
    copy_to_host,
    fill_nonfinite_counts,
    nonfinite_counts,
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
        self._placeholders: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self.host_transfers = 0
        # Kernels per step independent of the number of tensors, and NaN/Inf counted on the
        # device without a sync: what accelerators need. None: on every device but the CPU.
        self.foreach_only: bool | None = None
        # Sharded (DTensor) gradients: reduce the local shards, then combine the rows across
        # ranks with ``reduce_shards`` (see `gradtrack.distributed.RankGroup.reduce_shards`).
        self.local_shards = False
        self.reduce_shards: Callable[[Tensor, np.ndarray, int], Tensor] | None = None

    def collect(self, with_samples: bool, flags: Tensor | None = None) -> list[HostPart]:
        """Reduce every present gradient; one `HostPart` per device (usually one).

        ``flags``, a small float64 tensor of step evidence, rides along in the first part.
        """
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[Tensor]]]
        groups = defaultdict(lambda: ([], []))
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
                if grad.numel() == 0:
                    grad = self._placeholder(grad)
                indices, grads = groups[(grad.device, grad.dtype)]
                indices.append(i)
                grads.append(grad)
            by_device: dict[torch.device, list[tuple[list[int], list[Tensor]]]] = defaultdict(list)
            for (device, _), group in groups.items():
                by_device[device].append(group)
            return [
                self._reduce_device(device, group, with_samples, flags if i == 0 else None)
                for i, (device, group) in enumerate(by_device.items())
            ]

    def _reduce_device(
        self,
        device: torch.device,
        groups: list[tuple[list[int], list[Tensor]]],
        with_samples: bool,
        flags: Tensor | None,
    ) -> HostPart:
        foreach_only = self.foreach_only
        if foreach_only is None:
            foreach_only = device.type != "cpu"
        stats, samples, all_grads = [], [], []
        for indices, grads in groups:
            group_stats = tensor_norms(grads, foreach_only)
            if foreach_only:
                group_stats[:, 3:] = nonfinite_counts(grads)
            stats.append(group_stats)
            if with_samples:
                counts = self.sample_counts[indices]
                samples.append(sample_elements(grads, counts.tolist(), self._generator(device)))
            all_grads.extend(grads)
        tensor_index = np.concatenate([np.asarray(indices) for indices, _ in groups])
        rows = torch.cat(stats)
        if not foreach_only:  # CPU rows: count NaN/Inf now, where norms came out non-finite
            fill_nonfinite_counts(rows.numpy(), all_grads)
        if self.reduce_shards is not None:
            rows = self.reduce_shards(rows, tensor_index, len(self.params))
        float64 = [rows.reshape(-1)]
        if flags is not None:
            float64.append(flags.to(device, torch.float64, non_blocking=True))
        pieces = [torch.cat(float64).view(torch.float32), *samples]
        buffer, ready = copy_to_host(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
        self.host_transfers += 1
        return HostPart(
            tensor_index=tensor_index,
            sample_counts=(
                np.minimum(self.sample_counts[tensor_index], _numel_of(all_grads))
                if with_samples
                else None
            ),
            buffer=buffer,
            ready=ready,
            n_flags=0 if flags is None else flags.numel(),
        )

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
