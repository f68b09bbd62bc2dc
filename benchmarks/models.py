"""The benchmark models: each returns a model and a closure computing its loss on fixed data."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

LossFn = Callable[[], torch.Tensor]


def cnn() -> tuple[nn.Module, LossFn]:
    """The quickstart CNN (6 parameter tensors), batch 64 of 3×32×32."""
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )  # fmt: skip
    images, labels = torch.randn(64, 3, 32, 32), torch.randint(10, (64,))
    return model, lambda: nn.functional.cross_entropy(model(images), labels)


def deep_mlp(depth: int = 64, width: int = 256) -> tuple[nn.Module, LossFn]:
    """64 × (Linear + LayerNorm + GELU), width 256: 258 parameter tensors, batch 64."""
    blocks = [
        m for _ in range(depth) for m in (nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
    ]
    model = nn.Sequential(*blocks, nn.Linear(width, 1))
    inputs = torch.randn(64, width)
    return model, lambda: model(inputs).pow(2).mean()


def transformer(layers: int = 6, width: int = 256) -> tuple[nn.Module, LossFn]:
    """A 6-layer transformer encoder, d=256, 4 heads, batch 16 × 32 tokens."""
    layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
    inputs = torch.randn(16, 32, width)
    return model, lambda: model(inputs).pow(2).mean()


def stress(tensors: int = 2000, width: int = 16) -> tuple[nn.Module, LossFn]:
    """Many tiny layers: ``tensors`` parameter tensors (Linear weight + bias pairs)."""
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(tensors // 2)])
    inputs = torch.randn(8, width)
    return model, lambda: model(inputs).pow(2).mean()


MODELS: dict[str, Callable[[], tuple[nn.Module, LossFn]]] = {
    "cnn": cnn,
    "mlp": deep_mlp,
    "transformer": transformer,
    "stress": stress,
}


def bf16_transformer(
    layers: int = 8, width: int = 2048, batch: int = 4, tokens: int = 1024
) -> tuple[nn.Module, LossFn]:
    """A bf16 transformer encoder (``layers`` × d=``width``, ``width // 128`` heads, FFN 4×),
    batch ``batch`` × ``tokens``: sized to keep an accelerator busy. The default, ~400 M
    parameters and 4,096 tokens (~1e13 FLOPs a step), is meant for ~50 ms a step on an
    H100/H200-class GPU (an estimate from peak bf16 throughput, not a measurement)."""
    layer = nn.TransformerEncoderLayer(
        width, nhead=max(1, width // 128), dim_feedforward=4 * width, dropout=0.0,
        batch_first=True,
    )  # fmt: skip
    model = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
    model.to(torch.bfloat16)
    inputs = torch.randn(batch, tokens, width, dtype=torch.bfloat16)
    return model, lambda: model(inputs).float().pow(2).mean()
