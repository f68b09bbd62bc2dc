"""Which layers are watched: naming, selection by pattern and type, and the errors for typos."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradtrack
from gradtrack.capture.layers import discover_layers
from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError


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


class Heads(nn.Module):
    """ModuleDict keys that one metric key would merge, and a child named like the root."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))  # the root's own parameter: layer "root"
        self.root = nn.Linear(4, 4)
        self.heads = nn.ModuleDict({"task@a": nn.Linear(4, 1), "task_a": nn.Linear(4, 1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.root(x) * self.gain
        return self.heads["task@a"](hidden) + 2 * self.heads["task_a"](hidden)


def test_layers_that_would_share_a_metric_key_get_distinct_keys() -> None:
    import gradtrack
    from gradtrack.formats.metrics import metric_key, scalar_metrics
    from gradtrack.sinks import MemorySink

    model = Heads()
    layers = discover_layers(model, GradtrackConfig())
    # The exact, key-safe module path keeps its key; the other gets the first free suffix.
    assert [layer.name for layer in layers] == ["root-2", "root", "heads.task@a-2", "heads.task_a"]
    assert layers[0].params == (model.gain,) and layers[1].params[0] is model.root.weight
    sink = MemorySink()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with gradtrack.watch(model, backend=sink, optimizer=optimizer, log_every=1):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    metrics = scalar_metrics(sink.records[0])
    keys = [metric_key("grad_norm", layer.name) for layer in layers]
    assert len(set(keys)) == 4 and all(key in metrics for key in keys)
    # Each key carries its own layer's gradient: task_a's is twice task@a's.
    assert metrics["grad_norm/heads.task_a"] == pytest.approx(
        2 * metrics["grad_norm/heads.task_a-2"], rel=1e-6
    )
    assert metrics["grad_norm/root-2"] == pytest.approx(model.gain.grad.abs().item(), rel=1e-6)


def test_depth_keys_sort_as_text_in_model_order_and_path_keys_stay() -> None:
    layers = [m for i in range(12) for m in (nn.Linear(4, 4), nn.ReLU())]
    model = nn.Sequential(*layers)
    depth, path = gradtrack.sinks.MemorySink(), gradtrack.sinks.MemorySink()
    for sink, keys in ((depth, "depth"), (path, "path")):
        with gradtrack.watch(model, backend=sink, log_every=1, layer_keys=keys):
            model(torch.randn(2, 4)).sum().backward()
    norms = [key for key in depth.scalars() if key.startswith("grad_norm/")]
    assert sorted(norms) == norms  # what a tracker's UI lists: layers by depth
    assert norms[:3] == ["grad_norm/00_0", "grad_norm/01_2", "grad_norm/02_4"]
    assert norms[-1] == "grad_norm/11_22"
    assert [key for key in path.scalars() if key.startswith("grad_norm/")][:3] == [
        "grad_norm/0",
        "grad_norm/2",
        "grad_norm/4",
    ]  # fmt: skip  (the default: module paths, as before)
