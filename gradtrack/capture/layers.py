"""Which parameters gradtrack watches, and under which layer name each is summarised.

A layer is a module that owns parameters directly, named by its module path; a parameter
shared by several modules is counted once, under the first owner in ``named_modules()`` order.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch import nn

from gradtrack.capture.zero import is_engine
from gradtrack.config import GradtrackConfig
from gradtrack.errors import GradtrackError
from gradtrack.formats.metrics import metric_key

ROOT_LAYER_NAME = "root"


@dataclass(frozen=True)
class Layer:
    """One summarised unit: a module's own parameters, or a single parameter."""

    name: str
    module_type: type[nn.Module]
    param_names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside the wrappers that only forward to it: ``torch.compile``'s
    ``OptimizedModule``, (Distributed)DataParallel and DeepSpeed's engine. Layers are named
    from it, so a run's keys are the same with or without the wrappers.

    >>> inner = nn.Linear(2, 1)
    >>> unwrap_model(nn.DataParallel(inner)) is inner
    True
    """
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif is_engine(model):
            model = model.module  # type: ignore[assignment]
        elif type(model).__name__ == "OptimizedModule" and isinstance(
            inner := getattr(model, "_orig_mod", None), nn.Module
        ):
            model = inner
        else:
            return model


# A module that owns parameters: its layer name, the module, and its own (name, parameter)s.
_Owner = tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]


def _owned_parameters(model: nn.Module) -> list[_Owner]:
    seen: set[int] = set()
    owners = []
    for module_name, module in model.named_modules():
        own = []
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            own.append((full_name, param))
        if own:
            owners.append((module_name or ROOT_LAYER_NAME, module, own))
    return owners


def discover_layers(model: nn.Module, config: GradtrackConfig) -> list[Layer]:
    """The layers of ``model`` that ``config`` selects, in ``named_modules()`` order.

    Frozen parameters and layers are kept: a step summarises only parameters that have a
    gradient then, so a parameter unfrozen later is picked up from its first gradient on.

    >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> [layer.name for layer in discover_layers(model, GradtrackConfig())]
    ['0', '2']
    """
    owners = _owned_parameters(model)
    if not any(p.requires_grad for _, _, own in owners for _, p in own):
        total = sum(len(own) for _, _, own in owners)
        raise GradtrackError(
            f"{type(model).__name__} has no trainable parameters ({total} parameters, none with "
            "requires_grad=True): there is no gradient to watch. Unfreeze some parameters "
            "before calling gradtrack.watch."
        )

    candidates, root_own = _candidates(model, owners, config)
    if not candidates:
        kinds = ", ".join(t.__name__ for t in config.module_types)
        raise GradtrackError(f"no module that owns parameters is of type {kinds}")
    names = [layer.name for layer in candidates]
    _check_patterns("include", config.include, names)
    _check_patterns("exclude", config.exclude, names)
    selected = [
        layer
        for layer in candidates
        if (not config.include or _matches(layer.name, config.include))
        and not _matches(layer.name, config.exclude)
    ]
    if not selected:
        raise GradtrackError(
            f"include={list(config.include)} and exclude={list(config.exclude)} leave no layer "
            f"to watch; layers: {_preview(names)}"
        )
    # The root module's own parameters are named `ROOT_LAYER_NAME`, not by a module path.
    exact = [id(layer) not in root_own for layer in selected]
    distinct = distinct_names([layer.name for layer in selected], exact)
    if config.layer_keys == "depth":
        distinct = depth_ordered(distinct)
    return [replace(layer, name=name) for layer, name in zip(selected, distinct)]


def _candidates(
    model: nn.Module,
    owners: list[_Owner],
    config: GradtrackConfig,
) -> tuple[list[Layer], set[int]]:
    """The layers of the owners of the selected module types (per parameter or per module,
    by ``granularity``), and the ids of those that hold the root module's own parameters."""
    candidates: list[Layer] = []
    root_own: set[int] = set()
    for module_name, module, own in owners:
        if config.module_types and not isinstance(module, config.module_types):
            continue
        if config.granularity == "parameter":
            candidates.extend(Layer(name, type(module), (name,), (p,)) for name, p in own)
        else:
            candidates.append(
                Layer(
                    module_name,
                    type(module),
                    tuple(name for name, _ in own),
                    tuple(p for _, p in own),
                )
            )
            if module is model:
                root_own.add(id(candidates[-1]))
    return candidates, root_own


def depth_ordered(names: Sequence[str]) -> list[str]:
    """``names`` after their zero-padded position, so that sorting them as text (what the
    trackers' UIs do) keeps model order (``layer_keys="depth"``).

    >>> depth_ordered(["0", "2", "10"])
    ['0_0', '1_2', '2_10']
    >>> depth_ordered([str(i) for i in range(11)])[-2:]
    ['09_9', '10_10']
    """
    width = len(str(len(names) - 1))
    return [f"{i:0{width}d}_{name}" for i, name in enumerate(names)]


def distinct_names(names: Sequence[str], exact: Sequence[bool] | None = None) -> list[str]:
    """``names`` made distinct as metric keys, so no layer's series overwrites another's.

    Two names collide when `metric_key` maps them to one key (``task@a`` and ``task_a``; the
    root module's own parameters, named ``root``, and a child module named ``root``). Of a
    colliding set, a name that is an ``exact`` module path (default: all are) and needs no
    mapping keeps its key; the others, in model order, get the first free suffix ``-2``,
    ``-3``, … (the root's own ``root`` is not a module path: a child named ``root`` keeps it).

    >>> distinct_names(["heads.task@a", "heads.task_a"])
    ['heads.task@a-2', 'heads.task_a']
    >>> distinct_names(["root", "root"], exact=[False, True])  # the root's own, a child
    ['root-2', 'root']
    """
    keys = [metric_key("grad_norm", name) for name in names]
    if len(set(keys)) == len(keys):
        return list(names)
    exact = [True] * len(names) if exact is None else exact
    # Who keeps a contested key: an exact, key-safe module path first, then model order.
    order = sorted(
        range(len(names)),
        key=lambda i: (not (exact[i] and keys[i] == f"grad_norm/{names[i]}"), i),
    )
    taken: dict[str, int] = {}
    result = list(names)
    for i in order:
        name, suffix = names[i], 1
        while keys[i] in taken:
            suffix += 1
            name = f"{names[i]}-{suffix}"
            keys[i] = metric_key("grad_norm", name)
            if suffix > len(names) + 1:  # a key cut at 250 characters: no suffix survives
                other = names[taken[metric_key("grad_norm", names[i])]]
                raise GradtrackError(
                    f"layers {other!r} and {names[i]!r} map to one metric key and no suffix "
                    "can tell them apart (keys are cut at 250 characters); exclude one of them"
                )
        taken[keys[i]] = i
        result[i] = name
    return result


def activation_modules(model: nn.Module, config: GradtrackConfig) -> list[tuple[str, nn.Module]]:
    """Leaf modules (with or without parameters) whose output gradients ``activations=True``
    watches, filtered by the same include/exclude patterns and module types."""
    leaves = []
    for name, module in model.named_modules():
        if next(module.children(), None) is not None:
            continue
        name = name or ROOT_LAYER_NAME
        if config.module_types and not isinstance(module, config.module_types):
            continue
        if config.include and not _matches(name, config.include):
            continue
        if not _matches(name, config.exclude):
            leaves.append((name, module))
    distinct = distinct_names([name for name, _ in leaves])
    return [(name, module) for name, (_, module) in zip(distinct, leaves)]


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _check_patterns(option: str, patterns: Sequence[str], names: list[str]) -> None:
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.4)
            hint = f"closest layer names: {close}" if close else f"layers: {_preview(names)}"
            raise GradtrackError(f"{option} pattern {pattern!r} matches no layer; {hint}")


def _preview(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … ({len(names) - limit} more)" if len(names) > limit else "")


# Modules whose gradient is row-sparse (only the rows a batch looked up): its RMS says how many
# rows were used, not how well gradient flows, so it is never compared with other layers'.
RECURRENT_KINDS = frozenset({"RNN", "LSTM", "GRU", "RNNCell", "LSTMCell", "GRUCell"})
_SATURATING = frozenset({"Tanh", "Sigmoid", "Hardtanh", "Softsign", "Hardsigmoid"})
_PIECEWISE_LINEAR = frozenset({"ReLU", "ReLU6", "LeakyReLU", "PReLU", "RReLU", "Threshold"})


def layer_kinds(layers: Sequence[Layer], granularity: str = "layer") -> tuple[str, ...]:
    """What rules compare like with like by: the module type, and per parameter its role.

    >>> layer_kinds(discover_layers(nn.Sequential(nn.Linear(2, 2)), GradtrackConfig()))
    ('Linear',)
    """
    if granularity == "parameter":
        return tuple(
            f"{layer.module_type.__name__}.{layer.name.rsplit('.', 1)[-1]}" for layer in layers
        )
    return tuple(layer.module_type.__name__ for layer in layers)


def saturating_layers(model: nn.Module, layers: Sequence[Layer]) -> tuple[bool, ...]:
    """Per layer: whether exactly-zero gradients there more likely mean saturated tanh/sigmoid
    units than dead ReLUs — a recurrent layer, or a model whose activation modules are all
    saturating ones (functional activations are invisible: then the ReLU reading stays)."""
    types = {type(module).__name__ for module in model.modules()}
    saturating_model = bool(types & _SATURATING) and not types & _PIECEWISE_LINEAR
    return tuple(
        saturating_model or layer.module_type.__name__ in RECURRENT_KINDS for layer in layers
    )
