"""FSDP2 over tensor parallel with gradtrack: exact per-layer statistics from local shards.

    torchrun --nproc_per_node 4 examples/tp_fsdp.py               # gloo on CPU, (dp=2, tp=2)
    torchrun --nproc_per_node 4 examples/tp_fsdp.py --tp 4         # tensor parallel alone

A (dp, tp) device mesh: each block's ``up`` Linear Colwise and ``down`` Linear Rowwise
parallel over ``tp``, the whole model ``fully_shard``-ed over ``dp``. Every rank watches;
rank 0 writes the full gradients' statistics, combined from every rank's local shards in
one all-gather per logged step — no gradient is gathered.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import gradtrack


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    parser.add_argument("--backend", nargs="+", default=["console"])
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dp = world // args.tp
    device = "cuda" if cuda else "cpu"
    mesh = init_device_mesh(device, (dp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)  # the same initial weights on every rank
    width = 32
    model = nn.Sequential(*(Block(width) for _ in range(2)), nn.Linear(width, 4)).to(device)
    for block in model[:2]:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if dp > 1:
        fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Ranks of one tensor-parallel group see the same batch; data-parallel replicas their own.
    generator = torch.Generator().manual_seed(1 + mesh.get_coordinate()[0])  # type: ignore[index]
    target = torch.randn(width, 4, generator=torch.Generator().manual_seed(0))

    with gradtrack.watch(
        model,
        backend=args.backend,
        optimizer=optimizer,
        log_every=args.log_every,
        console={"interval_s": 0},
    ):
        for _ in range(args.steps):
            x = torch.randn(16, width, generator=generator)
            loss = nn.functional.mse_loss(model(x.to(device)), (x @ target).to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    if rank == 0:
        print(
            f"trained {args.steps} steps on a (dp={dp}, tp={args.tp}) mesh; loss {loss.item():.4f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
