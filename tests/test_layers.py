"""Which layers are watched: naming, selection by pattern and type, and the errors for typos."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError
from gradtrack.layers import discover_layers


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"attn": nn.Linear(8, 8), "norm": nn.LayerNorm(8)}) for _ in range(2)
        )
        self.head = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.ones(1))


def names(**overrides: object) -> list[str]:
    return [layer.name for layer in discover_layers(Encoder(), GradtrackConfig(**overrides))]


def test_layers_are_modules_that_own_parameters_in_module_order() -> None:
    assert names() == [
        "root", "embed", "layers.0.attn", "layers.0.norm", "layers.1.attn", "layers.1.norm", "head",
    ]  # fmt: skip


def test_include_exclude_and_module_types() -> None:
    assert names(include=["layers.*"], exclude=["*.norm"]) == ["layers.0.attn", "layers.1.attn"]
    assert names(module_types=[nn.Linear]) == ["layers.0.attn", "layers.1.attn", "head"]
    assert names(module_types=["LayerNorm", "Embedding"]) == [
        "embed",
        "layers.0.norm",
        "layers.1.norm",
    ]


def test_parameter_granularity() -> None:
    assert names(granularity="parameter", include=["layers.0.*", "head.*"]) == [
        "layers.0.attn.weight", "layers.0.attn.bias", "layers.0.norm.weight", "layers.0.norm.bias",
        "head.weight", "head.bias",
    ]  # fmt: skip


def test_a_pattern_that_matches_nothing_names_the_closest_layers() -> None:
    with pytest.raises(
        GradtrackError,
        match=r"'layer.0.atn' matches no layer; closest layer names: \['layers.0.attn'",
    ):
        names(include=["layer.0.atn"])
    with pytest.raises(GradtrackError, match="exclude pattern 'haed' matches no layer"):
        names(exclude=["haed"])


def test_selection_that_leaves_nothing_is_an_error() -> None:
    with pytest.raises(GradtrackError, match="leave no layer to watch"):
        names(include=["head"], exclude=["h*"])
    with pytest.raises(GradtrackError, match="no module that owns parameters is of type Conv2d"):
        names(module_types=[nn.Conv2d])
