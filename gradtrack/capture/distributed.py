"""torch.distributed: which rank writes, and the one collective per logged step.

Two layouts, told apart by the parameters:

* **replicated** (DDP, or any job whose gradients are all-reduced): every rank ends the
  step with the same gradient, so rank 0 summarises its own copy like a single process.
  What only a rank knows is its *local* gradient before the all-reduce; a post-accumulate
  hook takes one L2 norm per tensor of it on logged steps (before DDP's reducer sees the
  gradient), and one all-gather brings every rank's norms to rank 0: the ranks where a
  NaN/Inf arose, and per-rank layer norms with ``distributed.gather_ranks``.
* **sharded** (DTensor parameters on any device mesh: FSDP2, HSDP, tensor parallel and
  their 2-D combinations; DeepSpeed ZeRO 1–3's partitioned gradients): each rank reduces its
  local shards and one all-gather combines them into the full gradients' statistics
  (`gradtrack.capture.mesh.MeshReduction`).

Steps that are not logged see no collective at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from gradtrack.capture.stats import accumulation_dtype, stored_values
from gradtrack.config import GradtrackConfig

Layout = Literal["replicated", "sharded"]


def writes_to_sinks(config: GradtrackConfig) -> bool:
    """Whether this process has sinks: rank 0 of a coordinated job, every rank otherwise
    (the other ranks only help rank 0 summarise)."""
    return not config.distributed.enabled or not _initialized() or dist.get_rank() == 0


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_dtensor(tensor: Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local")


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor; a plain tensor (tensor parallel leaves some) itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


@dataclass(frozen=True)
class RankGroup:
    """The processes that train one model together, as gradtrack sees them."""

    layout: Layout
    group: Any  # a ProcessGroup; None means the default group
    rank: int
    world_size: int

    def all_gather(self, local: Tensor) -> Tensor:
        """[world_size, *local.shape]: every rank's ``local``, in rank order (one collective)."""
        out = local.new_empty(self.world_size * local.numel())
        # Renamed in torch 2.13 (the old name warns); the flat, concatenated form suits both.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local.reshape(-1).contiguous(), group=self.group)
        return out.view(self.world_size, *local.shape)

    def broadcast_from_first(self, message: str | None) -> str | None:
        """The group's first rank's ``message``, on every rank (a raise rule's verdict)."""
        box = [message]
        source = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=source, group=self.group)
        return box[0]


def replicated(ranks: RankGroup | None) -> TypeGuard[RankGroup]:
    """Whether the watch runs over ranks that each hold every gradient (DDP, ZeRO-1/2's
    reduced gradients); False alone and where each rank holds only its shards."""
    return ranks is not None and ranks.layout == "replicated"


def rank_group(
    model: nn.Module, params: list[nn.Parameter], partitioned: bool = False
) -> RankGroup | None:
    """How ``model`` is trained across processes; None in a single process. ``partitioned``:
    each rank holds a piece of every reduced gradient (DeepSpeed ZeRO 1–3)."""
    if not _initialized():
        return None
    if partitioned or any(is_dtensor(p) for p in params):  # within the default group
        return RankGroup("sharded", None, dist.get_rank(), dist.get_world_size())
    group = getattr(model, "process_group", None)
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return None
    return RankGroup("replicated", group, dist.get_rank(group), world_size)


class LocalNormProbe:
    """Each rank's local gradient norm per tensor, before gradients are all-reduced.

    A post-accumulate-grad hook runs before DDP's reducer hook on the same parameter, so it
    sees the rank's own (accumulated) gradient. It computes only on logged steps.
    """

    def __init__(self, params: list[nn.Parameter], is_due: Any) -> None:
        self._is_due = is_due
        self._norms: list[Tensor | None] = [None] * len(params)
        self.handles: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(lambda p, i=i: self._ready(i, p))
            for i, param in enumerate(params)
            if param.requires_grad
        ]

    def _ready(self, index: int, param: Tensor) -> None:
        if not self._is_due() or param.grad is None:
            return
        grad = stored_values(param.grad)
        with torch.no_grad():
            norm = torch.linalg.vector_norm(grad, dtype=accumulation_dtype(grad.dtype))
        self._norms[index] = norm

    def take(self, device: torch.device) -> Tensor:
        """float64 [tensors]: this step's local norms, 0 for tensors without a gradient."""
        norms = self._norms
        self._norms = [None] * len(norms)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(
            [zero if n is None else n.to(device, torch.float64, non_blocking=True) for n in norms]
        )
