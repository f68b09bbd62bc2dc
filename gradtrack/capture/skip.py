"""``action="skip"``: a bad step's optimizer step is left out, and written to a journal.

The decision is made in the training thread before ``optimizer.step()`` runs, from the
step's layer norms and spike flags read on the host (free on the CPU; one read per step on
an accelerator). A skipped step changes nothing: the optimizer's ``step`` is not called, so
weights, moments and step counts stay exactly as they were.
"""

from __future__ import annotations

import json
import os
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gradtrack.errors import GradientAlertError, GradtrackError
from gradtrack.formats import write_atomic
from gradtrack.formats.event import AlertEvent
from gradtrack.handoff.rules import PerStepRules, StepRules, Trip

Skip = Trip  # why one step is left out: the rule, and the layer it names (None: the total)


class SkipPolicy:
    """Which steps the ``skip`` rules leave out (`StepRules` for ``action="skip"``), and how
    many in a row before skipping gives way to an error."""

    def __init__(self, per_step: PerStepRules, max_consecutive: int):
        self.rules = StepRules(per_step, "skip")
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = 0

    def decide(self, finite: bool, norms: np.ndarray, spike: np.ndarray | None) -> Skip | None:
        """The first of nonfinite, spike, exploding whose skip rule this step trips."""
        skip = self.rules.find(finite, norms, spike)
        if skip is None:
            self.consecutive = 0
        return skip

    def count(self, step: int, skip: Skip) -> GradientAlertError | None:
        """Count a skip; or, once ``max_consecutive`` steps in a row were skipped, the error
        to raise instead (the step is then not skipped)."""
        if self.consecutive >= self.max_consecutive:
            return GradientAlertError(
                AlertEvent(
                    step=step,
                    wall_time=time.time(),
                    rule=skip.rule,
                    layer=skip.layer,
                    statistic="consecutive_skips",
                    value=float(self.consecutive + 1),
                    threshold=float(self.max_consecutive),
                    severity="error",
                    message=(
                        f"{skip.rule} at step {step} after {self.consecutive} skipped steps in "
                        f"a row (skip.max_consecutive={self.max_consecutive}): skipping does not "
                        "recover this run. Restore a checkpoint from before the first skip and "
                        "look at that step's event, or lower the learning rate."
                    ),
                )
            )
        self.consecutive += 1
        self.total += 1
        return None


class Journal:
    """The bad-step journal: a JSON list of the skipped steps, rewritten whole at each skip
    (atomically: a crash leaves the previous version), so a resumed run can read it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: list[dict[str, Any]] = []

    def add(self, step: int, skip: Skip, micro_batches: list[int]) -> None:
        self._entries.append(
            {
                "step": step,
                "rule": skip.rule,
                "layer": skip.layer,
                "micro_batches": micro_batches,
                "wall_time": time.time(),
            }
        )
        write_atomic(self.path, json.dumps(self._entries, indent=1))


def read_journal(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The skipped steps a run wrote (``skip.journal``): each ``step``, ``rule``, ``layer`` and
    ``micro_batches`` — the indices, counted from 0 over the run, of the forward passes (with
    gradients) that made the step — to leave those batches out of a resumed run.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "skipped_steps.json"
    >>> Journal(path).add(13, Skip("nonfinite", "fc"), [13])
    >>> [(e["step"], e["micro_batches"]) for e in read_journal(path)]
    [(13, [13])]
    """
    entries = json.loads(Path(path).read_text())
    assert isinstance(entries, list)
    return entries


class ForwardCounter:
    """Counts the model's forward passes that record gradients: the micro-batches of a step
    (several with gradient accumulation) are those counted since the previous step."""

    def __init__(self, model: nn.Module) -> None:
        self.count = 0
        self._step_start = 0
        self.handle = model.register_forward_hook(self._forward)

    def _forward(self, *_: Any) -> None:
        if torch.is_grad_enabled():
            self.count += 1

    def take(self) -> list[int]:
        """The micro-batch indices of the step that ends now."""
        taken = list(range(self._step_start, self.count))
        self._step_start = self.count
        return taken


class OptimizerGate:
    """Wraps ``optimizer.step`` so that ``should_skip()``, asked first, can leave it out;
    without ``should_skip`` the step is left out where the step's end set ``held``.

    A step given a closure (Lightning's, which runs the forward and backward) has its
    closure run once first, so that the verdict is on the gradients it makes; the optimizer
    then gets that loss back. The wrapper is a bound method (LR schedulers wrap
    ``step.__func__``); `remove` restores the optimizer's own, or, where something wrapped
    the gate since, makes it pass through.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, should_skip: Callable[[], bool] | None
    ) -> None:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise GradtrackError(
                "action='skip' cannot gate LBFGS: it evaluates its closure several times per "
                "step; use action='warn' or 'raise' with this optimizer"
            )
        self.optimizer = optimizer
        self.held = False  # the verdict of a step ended before its optimizer step
        self._active = True
        self._had_own = "step" in vars(optimizer)
        original = optimizer.step

        def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if not self._active:
                return original(*args, **kwargs)
            closure = args[0] if args else kwargs.pop("closure", None)
            loss = None
            if callable(closure):
                with torch.enable_grad():
                    loss = closure()
                args, kwargs = args[1:], {**kwargs, "closure": lambda: loss}
            if should_skip is None:
                skip, self.held = self.held, False
            else:
                skip = should_skip()
            return loss if skip else original(*args, **kwargs)

        self._step = types.MethodType(step, optimizer)
        self._original = original
        optimizer.step = self._step  # type: ignore[method-assign]

    def remove(self) -> None:
        self._active = False
        if vars(self.optimizer).get("step") is self._step:
            if self._had_own:
                self.optimizer.step = self._original  # type: ignore[method-assign]
            else:
                del self.optimizer.step
