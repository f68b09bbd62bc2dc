"""DDP with gradtrack: every rank watches, rank 0 writes the synchronized gradient's summaries.

    torchrun --nproc_per_node 2 examples/ddp.py                 # gloo on CPU
    torchrun --nproc_per_node 2 examples/ddp.py --backend mlflow --gather-ranks

Rank 0 writes; the other ranks send rank 0 their local gradient norms once per logged step
(one all-gather), so a NaN that arises on one rank is named in the alert.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import gradtrack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--backend", nargs="+", default=["console"])
    parser.add_argument(
        "--gather-ranks", action="store_true", help="also write each rank's local layer norms"
    )
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if device is not None:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4)
    ).to(device)  # fmt: skip
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    target = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))

    with gradtrack.watch(
        ddp,
        backend=args.backend,
        optimizer=optimizer,
        log_every=args.log_every,
        distributed={"gather_ranks": args.gather_ranks},
        console={"interval_s": 0},
    ):
        for _ in range(args.steps):
            x = torch.randn(64, 32, generator=generator).to(device)
            loss = nn.functional.mse_loss(ddp(x), x @ target.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    if rank == 0:
        print(f"trained {args.steps} steps on {world} ranks; last loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
