"""Where a non-finite gradient was made: the module, by replaying a bad step's forward and
backward; and whether the weights themselves have gone non-finite.

Healthy steps pay two Python calls from the probes' shared hooks on the root module
(references, no device work); the replay runs only on a step the guard found non-finite,
before the optimizer applies it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from gradtrack.capture.layers import ROOT_LAYER_NAME

ReplayStage = Literal["forward", "loss", "backward"]


def float_tensors(value: Any) -> list[Tensor]:
    """The floating-point tensors in a module's output (or inputs): a nest of tuples, lists
    and dicts walked only where the value is not one tensor (the usual output)."""
    if type(value) is Tensor:
        return [value] if value.is_floating_point() else []
    return [t for t in tree_leaves(value) if isinstance(t, Tensor) and t.is_floating_point()]


@dataclass(frozen=True)
class Origin:
    """What a replay found: the module that made it (None: not found) and in which pass,
    with a note on what the replay could not see."""

    module: str | None
    stage: ReplayStage | None
    note: str = ""


def _all_finite(tensors: Sequence[Tensor | None]) -> Tensor:
    """On the device, no read: whether every element of every tensor is finite."""
    flags = [torch.isfinite(t).all() for t in tensors if t is not None]
    if not flags:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([f.to(flags[0].device) for f in flags]).all()


def _read(flags: Sequence[Tensor]) -> list[bool]:
    """Many device flags in one read per device (one wait each, where a device is involved;
    a ``.cpu()`` per flag would wait once per module)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, flag in enumerate(flags):
        by_device.setdefault(flag.device, []).append(i)
    values = [False] * len(flags)
    for indices in by_device.values():
        read = torch.stack([flags[i] for i in indices]).cpu().numpy().tolist()
        for i, value in zip(indices, read):
            values[i] = bool(value)
    return values


def _finite(tensors: Sequence[Tensor | None]) -> bool:
    return _read([_all_finite(tensors)])[0]


# The CPU generator's state (5 KB, ~4 µs a short step to copy) is kept for a replay only
# where the model's forward draws from it (dropout on the CPU): seen by comparing the state
# before and after each of the first `RNG_CHECKS` forwards, then one in `RNG_CHECK_EVERY`;
# once a forward drew, it is kept at every forward.
RNG_CHECKS = 8
RNG_CHECK_EVERY = 256

# The gradient reaching the model's output is kept to replay a bad step's backward only up
# to this size: a language model's logits gradient can take gigabytes, which training would
# otherwise have freed at the end of backward. Larger outputs: the forward is replayed alone.
MAX_KEPT_OUTPUT_GRAD_BYTES = 64 << 20


class OriginProbe:
    """Keeps references to what the root module received and to its output (the last
    forward of a step), so that a bad step can be replayed. Its ``before_forward`` and
    ``after_forward`` are called by the root module's shared hooks
    (`gradtrack.capture.probes.ForwardTaps`).

    The gradient that reaches the output is kept by autograd itself (``retain_grad``, a hook
    in C++): a Python hook on the output cost every step ~9 µs to register and a call back
    into Python during backward. The output's ``.grad`` stays readable after the optimizer
    step (as for a user's own ``retain_grad``) and is released when the next forward begins:
    training's peak memory, in the forward and backward, is what it was without the probe.

    It is kept on the steps ``is_due`` names and, once a bad step was located, on every step:
    keeping it cost a short step ~10 µs (a tight loop's 0.26 ms step 1.04x:
    `benchmarks.fastloop`). Another step's backward is replayed from a unit gradient at the
    output, which finds what the model's own operations make (a square root or a division at
    zero) but not what the loss or the gradient's size made; its `Origin` says so.
    """

    def __init__(self, model: nn.Module, is_due: Callable[[], bool]) -> None:
        self.model = model
        self._is_due = is_due
        self._every_step = False  # a bad step was located: every output gradient kept
        self._grads_kept = False  # the gradient reaching this step's output is kept
        self._inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._rng: Tensor | None = None
        # The output's floating-point tensors that need a gradient, and which of them this
        # probe made retain it (their ``.grad`` is released when the next forward begins).
        self._outputs: list[Tensor] = []
        self._retained: list[Tensor] = []
        self._output_too_large = False
        self._forwards = 0
        self.draws = False  # a forward of the model drew from the CPU generator
        self._checking = False  # this forward's RNG state is compared after it

    def before_forward(self, args: Any, kwargs: Any) -> None:
        if self._retained:  # (the last step's output, or a second forward in this step's)
            self._release()
        self._inputs = (args, kwargs)
        self._output_too_large = False
        self._forwards += 1
        if self.draws:
            self._rng = torch.get_rng_state()  # dropout masks on the CPU replay as they were
        elif self._forwards <= RNG_CHECKS or self._forwards % RNG_CHECK_EVERY == 0:
            self._rng, self._checking = torch.get_rng_state(), True
        else:
            self._rng = None  # (the forwards checked drew nothing: a replay draws the same)

    def after_forward(self, output: Any) -> None:
        if self._checking and self._rng is not None:
            self._checking = False
            self.draws = not torch.equal(torch.get_rng_state(), self._rng)
        if type(output) is Tensor:  # (the usual output, in a few attribute reads: every step)
            one = output.requires_grad and output.is_floating_point()
            outputs, size = ([output], output.nbytes) if one else ([], 0)
        else:
            outputs = [leaf for leaf in float_tensors(output) if leaf.requires_grad]
            size = sum(leaf.nbytes for leaf in outputs)
        if size > MAX_KEPT_OUTPUT_GRAD_BYTES:
            self._output_too_large = True  # never hold what training would free
            return
        self._outputs = outputs
        self._grads_kept = self._every_step or self._is_due()
        if not self._grads_kept:
            return
        for leaf in outputs:
            if leaf.grad_fn is not None and not leaf.retains_grad:
                leaf.retain_grad()
                self._retained.append(leaf)

    def output_grads(self) -> list[Tensor | None]:
        """The gradient that reached each output tensor in this step's backward (None: none
        reached it, or it is a leaf), in the order of the output's tensors; where it was not
        kept this step, a unit gradient for each output that needs one."""
        if not self._grads_kept:
            return [torch.ones_like(t) if t.grad_fn is not None else None for t in self._outputs]
        return [leaf.grad if leaf.grad_fn is not None else None for leaf in self._outputs]

    def forget(self) -> None:
        """Drop the step's inputs at its end (they would hold memory); its output gradients
        are released when the next forward begins."""
        self._inputs, self._rng, self._outputs = None, None, []

    def _release(self) -> None:
        for leaf in self._retained:
            leaf.grad = None
        self._retained = []

    def locate(self) -> Origin:
        """Replay the last forward (and, where it is finite, the backward, from the gradient
        that reached the output) with a check after every module; the model's buffers, the
        RNG and every ``.grad`` are left as they were."""
        if self._inputs is None:
            return Origin(None, None, "no forward of the model was seen in this step")
        self._every_step = True  # (the bad steps that follow are replayed exactly)
        output_grads, too_large = self.output_grads(), self._output_too_large
        model, (args, kwargs) = self.model, self._inputs
        names = {module: name for name, module in model.named_modules()}
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        try:
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                # (a full backward hook on a module whose inputs need no gradient warns)
                warnings.simplefilter("ignore")
                if self._rng is not None:
                    torch.set_rng_state(self._rng)
                replay = _Replay(
                    model, names, args, kwargs, output_grads, self._rng, not self._grads_kept
                )
                found = replay.origin()
                if too_large and found.module is None:  # (the replay re-ran our hooks)
                    note = (
                        "the gradient reaching the model output is larger than "
                        f"{MAX_KEPT_OUTPUT_GRAD_BYTES >> 20} MiB and is not kept, so the "
                        "backward was not replayed"
                    )
                    return Origin(None, found.stage, note)
                return found
        except Exception as exc:  # a replay must never break training
            return Origin(None, None, f"the replay failed ({type(exc).__name__}: {exc})")
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)

    def remove(self) -> None:
        """(The hooks that call it are the `ForwardTaps` owner's to remove.) The last
        step's output keeps its ``.grad``, as long as the user holds it."""
        self.forget()
        self._retained = []


@dataclass(frozen=True)
class _Replay:
    """A bad step's forward and backward replayed from what the root module received, with a
    check after every module (``names``: each module's path)."""

    model: nn.Module
    names: dict[nn.Module, str]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output_grads: list[Tensor | None]  # (one per output tensor that needs a gradient)
    rng: Tensor | None
    unit: bool = False  # ``output_grads`` are ones: the step's own were not kept

    def origin(self) -> Origin:
        # Flags stay on the device until the pass ends: one read per pass.
        if not _finite(float_tensors((self.args, self.kwargs))):
            return Origin(None, "forward", "the input batch itself holds NaN/Inf")
        forward_bad = self._forward_bad()
        if forward_bad:
            return Origin(_shown(forward_bad[0]), "forward", _FORWARD_NOTE)
        reached = [grad for grad in self.output_grads if grad is not None]
        if reached and not _finite(reached):
            return Origin(None, "loss")
        if not reached:
            return Origin(None, None, "the model output had no gradient to replay")
        made, order = self._backward_made()
        if not made and self.unit:  # (the loss, where the layer nearest it got NaN/Inf too)
            if self._nearest_output_bad(order):
                return Origin(None, "loss", _UNIT_LOSS_NOTE + " " + _FORWARD_NOTE)
            return Origin(None, None, _UNIT_AFTER_NOTE + " " + _FORWARD_NOTE)
        if not made:
            return Origin(
                None,
                None,
                "the replay's backward stayed finite: the model's own forward and backward did "
                "not make it (a gradient changed after backward — a hook, clipping code, a "
                "collective — or what the replay cannot see) " + _FORWARD_NOTE,
            )
        # Innermost: a module none of whose submodules also made it; the first in backward order.
        inner = [name for name in made if not any(_inside(other, name) for other in made)]
        note = _UNIT_NOTE + " " + _FORWARD_NOTE if self.unit else _FORWARD_NOTE
        return Origin(_shown(inner[0] if inner else made[0]), "backward", note)

    def _forward_bad(self) -> list[str]:
        """The modules whose output was non-finite in the forward, in execution order."""
        forward: list[tuple[str, Tensor]] = []  # (module, output finite), in execution order

        def after_forward(module: nn.Module, _args: Any, output: Any) -> None:
            forward.append((self.names[module], _all_finite(float_tensors(output))))

        handles = [m.register_forward_hook(after_forward) for m in self.names]
        try:
            with torch.no_grad():
                self.model(*self.args, **self.kwargs)
        finally:
            for handle in handles:
                handle.remove()
        finite = _read([flag for _, flag in forward])
        return [name for (name, _), ok in zip(forward, finite) if not ok]

    def _nearest_output_bad(self, order: list[str]) -> bool:
        """Whether the step's own gradient (``.grad``, as backward left it) is non-finite in
        the first module of ``order`` (backward order) that holds one: a NaN the loss sent
        reaches every layer, one written into a gradient after backward only that layer."""
        modules = {name: module for module, name in self.names.items()}
        for name in order:
            grads = [p.grad for p in modules[name].parameters(recurse=False) if p.grad is not None]
            if grads:
                return not _finite(grads)
        return False

    def _backward_made(self) -> tuple[list[str], list[str]]:
        """The modules, in backward order, that made a non-finite gradient in the backward
        from ``output_grads``: their output gradient was finite, and their input gradient (or
        their own parameters') was not; and every module, in backward order."""
        names = self.names
        backward: list[tuple[str, Tensor, Tensor]] = []  # (module, output/input gradient finite)

        def after_backward(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
            backward.append(
                (names[module], _all_finite(list(grad_out)), _all_finite(list(grad_in)))
            )

        handles = [m.register_full_backward_hook(after_backward) for m in names]
        try:
            if self.rng is not None:
                torch.set_rng_state(self.rng)  # the same dropout masks as the first replay
            with torch.enable_grad():
                replayed = self.model(*self.args, **self.kwargs)
                outputs = [t for t in float_tensors(replayed) if t.requires_grad]
                pairs = [(o, g) for o, g in zip(outputs, self.output_grads) if g is not None]
                params = [p for p in self.model.parameters() if p.requires_grad]
                grads = torch.autograd.grad(
                    [o for o, _ in pairs], params, [g for _, g in pairs], allow_unused=True
                )
        finally:
            for handle in handles:
                handle.remove()
        owners, own_flags = _own_gradients_finite(names, params, grads)
        flags = _read([f for _, out_ok, in_ok in backward for f in (out_ok, in_ok)] + own_flags)
        own_bad = {names[m] for m, ok in zip(owners, flags[2 * len(backward) :]) if not ok}
        made = [
            name
            for k, (name, _, _) in enumerate(backward)
            if flags[2 * k] and (not flags[2 * k + 1] or name in own_bad)
        ]
        return made, [name for name, _, _ in backward]


def _own_gradients_finite(
    names: dict[nn.Module, str], params: list[nn.Parameter], grads: Sequence[Tensor | None]
) -> tuple[list[nn.Module], list[Tensor]]:
    """The modules that own parameters, and per module (on the device) whether its own
    parameters' gradients are finite: they count as its inputs' (a first layer has no
    other)."""
    grad_of = {id(p): g for p, g in zip(params, grads)}
    owners = [m for m in names if any(True for _ in m.parameters(recurse=False))]
    flags = [_all_finite([grad_of.get(id(p)) for p in m.parameters(recurse=False)]) for m in owners]
    return owners, flags


def _inside(name: str, ancestor: str) -> bool:
    return name != ancestor and (ancestor == "" or name.startswith(f"{ancestor}."))


def _shown(path: str) -> str:
    return path or ROOT_LAYER_NAME


_UNIT_KEPT = (
    "the gradient that reached the model output is kept on logged steps, and on every step "
    "once a bad one was seen"
)
_UNIT_NOTE = "(the backward replayed from a unit gradient at the model output: " + _UNIT_KEPT + ")"
_UNIT_LOSS_NOTE = (
    "the forward stayed finite, and a backward replayed from a unit gradient at the model "
    "output too, while the step's gradient is non-finite in the layer nearest the output: "
    "most likely the loss made it, or the size of the gradient it sent (" + _UNIT_KEPT + ")"
)
_UNIT_AFTER_NOTE = (
    "the replay's forward stayed finite, and a backward from a unit gradient at the model "
    "output too, while the layer nearest the output has a finite gradient: a gradient "
    "changed after backward (a hook, clipping code, a collective), or the step's own output "
    "gradient made it deeper in (" + _UNIT_KEPT + ")"
)
_FORWARD_NOTE = (
    "(replayed from the inputs the model received: randomness other than the CPU generator's "
    "— CUDA dropout — and inputs changed in place since are not seen as they were)"
)


def nonfinite_weight_layers(
    layer_names: Sequence[str], params: Sequence[Tensor], tensor_layer: np.ndarray
) -> tuple[str, ...]:
    """The layers whose parameters (not gradients) hold a NaN or Inf, in depth order."""
    with torch.no_grad():
        norms = torch._foreach_norm([p.detach() for p in params])  # one batched pass
        finite = _read([torch.isfinite(n) for n in norms])  # one read, not one per tensor
    bad = sorted({int(tensor_layer[i]) for i, ok in enumerate(finite) if not ok})
    return tuple(layer_names[i] for i in bad)
