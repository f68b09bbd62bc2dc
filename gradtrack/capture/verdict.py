"""Every step's guard, its verdict and its plan, on the training thread.

The verdict: finite or not, spiking or not, and the skip or raise a per-step rule asks for —
known now where that costs no wait for the device, else latched on the device for the next
logged step. The plan: what the step then needs — summarised or not, with its per-layer
metrics or not (decided here, once, and carried to the worker), and judged by the worker
before its optimizer step or not.

- `StepJudge` judges and plans a step; `QuietSteps` serves the common one (healthy, between
  logged ones, on one CPU device) in one short pass.
- `BadStepLatch`, on accelerators: the first non-finite step between two logged steps, kept
  on the device. Reading the verdict at every step would wait for the device; instead a few
  tiny kernels per step remember the first bad step and its norms, and the next logged step
  carries them to the host in its one copy.
- `StepSchedule`: which steps are logged, sampled, and per-layer; schedules are plain
  ``step -> bool``, ``DenseEarly`` giving a short run enough per-layer columns to see anything
  and a long run the cost of ``layer_every``.
- `build_signals`: the signals beyond the gradients' statistics a watch may ask for
  (docs/signals.md) — the every-step spike statistics, the skip rules, the update signals,
  the flight recorder — checked and built at watch time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, cast

import numpy as np
import torch
from torch import Tensor

from gradtrack.capture.collect import Collector, DeviceGrads, DevicePlan, Guard
from gradtrack.capture.flight_ring import FlightRecorder
from gradtrack.capture.skip import Journal, Skip, SkipPolicy
from gradtrack.capture.spike import LayerNorms, NormWindow, on_host
from gradtrack.capture.stats import (
    DeviceIndex,
    ShapeGroups,
    accumulation_dtype,
    packed_squares,
)
from gradtrack.capture.updates import (
    SampledUpdateProbe,
    UpdateProbe,
    WholeUpdateProbe,
)
from gradtrack.config import GradtrackConfig
from gradtrack.config.rules import SKIPPABLE
from gradtrack.errors import GradientAlertError, GradtrackError
from gradtrack.handoff.layout import FirstInWindow, HostValues, spike_fields
from gradtrack.handoff.rules import PerStepRules, StepRules, Trip

OnError = Callable[[int, Exception], None]


class Verdict(NamedTuple):
    finite: bool
    spiking: bool
    skip: Skip | None  # the skip a rule asks for
    trip: Trip | None = None  # the per-step rule whose action "raise" this step trips


# A step's spike vector and latch, for its record (`StepJudge.evidence`).
EvidenceParts = tuple[torch.Tensor | HostValues | None, torch.Tensor | None]

UNKNOWN = Verdict(True, False, None)  # (latched instead, or FSDP2: the logged steps judge)


@dataclass
class StepPlan:
    """What one step turned out to need, from its schedule and its verdict."""

    step: int
    guard: Guard
    logged: bool
    with_samples: bool
    verdict: Verdict
    spike: torch.Tensor | HostValues | None  # (host values: a small CPU model's, as floats)
    error: GradientAlertError | None  # a skip rule that escalated (max_consecutive)
    first_bad: bool  # the first non-finite step of its ``layer_every`` window
    first_flagged: bool  # that, or the first spiking step of its window
    per_layer: bool  # written with its per-layer metrics (max and mean |g| computed)
    judge_now: bool  # the worker judges it before its optimizer step (a raise rule)
    skipped_steps: int  # steps skip rules left out so far

    @property
    def skip(self) -> Skip | None:
        return self.verdict.skip

    @property
    def bad(self) -> bool:
        return not self.verdict.finite

    @property
    def due(self) -> bool:
        return self.logged or self.with_samples

    @property
    def needs_record(self) -> bool:
        """Summarised: a due step, the first flagged one of its window, a skipped one, or
        one the worker must judge now."""
        flagged = self.first_flagged or self.skip is not None or self.error is not None
        return self.due or flagged or self.judge_now


# Up to this many columns × tensors, a quiet step sums its layers' squares by one product
# with a 0/1 matrix (one operation); beyond it, by a bincount (O(tensors)).
_SUMS_BY_PRODUCT = 1 << 14
# Up to this many gradient tensors, a quiet step's norms are summed and judged as Python
# floats: inside a training step (its caches cold) each numpy call costs ~10 µs, six of them
# more than a loop over a few dozen floats (`benchmarks.fastloop`'s tight loop: +35 µs a step
# against +80 µs).
SMALL_MODEL_TENSORS = 64


class QuietLogged(NamedTuple):
    """What a logged step judged in the short pass hands on: each tensor's plain norm, and
    its spike vector (None without the spike rule)."""

    tensor_norms: list[float]
    spike: list[float] | None


class QuietSteps:
    """The common step, in one short pass: one between logged steps, of a model whose
    gradients are dense on one CPU device, watched with no skip or raise rule. Its plain
    fp32 norms (the floor's pass; many small tensors packed, see `l2_norms`), its total and
    layer norms, the spike test, the flight recorder's row — nothing else, no object made.

    True: the step was healthy (finite, no column spiking) and was taken into the spike
    window and the flight recorder, and needs nothing more. False leaves no trace, for
    `StepJudge.plan` to judge the step in full (a bad or spiking step, a layout that is not
    the simple one, a fault)."""

    def __init__(
        self,
        collector: Collector,
        layer_norms: LayerNorms | None,
        spikes: NormWindow | None,
        flight: FlightRecorder | None,
    ) -> None:
        self._params = collector.params
        self._whole = collector.whole
        self._layouts = collector.layouts
        self._tensor_layer = collector.index.tensor_layer
        self._columns = 1 if layer_norms is None else layer_norms.columns
        self._spikes = spikes
        self._flight = flight
        self._plan: list[DevicePlan] | None = None  # the layout whose columns are below
        self._packed: np.ndarray | None = None
        self._shapes: ShapeGroups | None = None  # (packed, of few shapes: stacked per shape)
        self._accumulate: torch.dtype | None = None
        self._present: list[int] | None = None  # the tensors with a gradient, where not all
        self._layer_columns = np.zeros(0, dtype=np.int64)
        self._sums: np.ndarray | None = None  # [columns, tensors] 0/1, where small
        self._small: list[int] | None = None  # each tensor's column, for `_judge_values`
        self._handed_whole = False  # a logged step's gradients go to the worker whole

    def __call__(self, step: int) -> bool:
        grads = self._gradients()
        if grads is None:
            return False
        if self._small is not None:
            return self._judge_values(step, grads, self._small) is not None
        if self._shapes is not None:
            squares = self._shapes.squares(grads)
        elif self._packed is not None:
            squares = packed_squares(grads, self._packed)
        else:
            plain = torch._foreach_norm(grads, 2, dtype=self._accumulate)
            squares = np.square(torch.stack(plain).numpy(), dtype=np.float64)
        if self._columns == 1:
            return math.isfinite(squares.sum())
        if self._sums is not None:  # (one product: the total and each layer's squares)
            norms = self._sums @ squares
        else:
            norms = np.bincount(self._layer_columns, weights=squares, minlength=self._columns)
            norms[0] = norms.sum()
        if not math.isfinite(norms[0]):  # (NaN, Inf, or an fp32 norm that overflowed)
            return False
        np.sqrt(norms, out=norms)
        if self._spikes is not None and not self._spikes.quiet(norms):
            return False
        if self._flight is not None:
            self._flight.record_host(step, norms)
        return True

    def logged(self, step: int, per_layer: bool, judge_now: bool) -> StepPlan | None:
        """The plan of logged step ``step`` of a small model whose gradients the worker
        reduces from one copy (`gradtrack.capture.collect.WholeCopies`), judged in this pass
        where it was healthy (then taken into the spike window and the flight recorder, as a
        quiet step is). None leaves no trace, for `StepJudge.plan` to judge it in full."""
        if self._plan is not None and (self._small is None or not self._handed_whole):
            return None  # (the layout learnt is not one this pass serves: no gradient read)
        grads = self._gradients()
        if grads is None or self._small is None or not self._handed_whole:
            return None
        assert self._plan is not None  # (learnt by `_gradients`)
        plan = self._plan[0]
        judged = self._judge_values(step, grads, self._small, logged=True)
        if judged is None:
            return None
        # (the plain pass; numpy makes a tensor of a short list in a third of torch's time)
        l2 = torch.from_numpy(np.array(judged.tensor_norms))
        part = DeviceGrads(plan.device, False, plan.tensors, [(plan.slices[0], grads)], l2, True)
        return StepPlan(
            step,
            Guard([part], exact=True),  # (exact: the worker reduces the step's copy)
            logged=True,
            with_samples=False,
            verdict=Verdict(True, False, None),
            spike=judged.spike,  # (packed as floats: `StepEvidence.on_host`)
            error=None,
            first_bad=False,
            first_flagged=False,
            per_layer=per_layer,
            judge_now=judge_now,
            skipped_steps=0,
        )

    def _gradients(self) -> list[torch.Tensor] | None:
        """The step's present gradients, where their layout is the simple one this pass
        serves (learnt as it first comes); None otherwise."""
        grads: list[torch.Tensor] = [p.grad for p in self._params]  # type: ignore[misc]
        plan = self._layouts.plan(grads)  # (None where one is absent: not the simple layout)
        if plan is not self._plan and not self._learn(plan, grads):
            return None
        if self._present is not None:  # (frozen or absent gradients left out)
            grads = [grads[i] for i in self._present]
        return grads

    def _judge_values(
        self, step: int, grads: list[torch.Tensor], columns: list[int], logged: bool = False
    ) -> QuietLogged | None:
        """`__call__` for a small model, its norms as Python floats: the same float64 squares
        of the same fp32 norms, summed per layer, then the same tests and records. None: not
        healthy, no trace left. ``logged``: the spike vector is taken too, as the window
        stood before this step entered it (what `NormWindow.on_host` gives a record)."""
        # (each 0-d norm read from CPU memory by its own ``tolist``, a float: like reading them
        # stacked, no op dispatched, no ``.item()``, at a third of the cost inside a step:
        # 12 → 4 µs)
        read = torch._foreach_norm(grads, 2, dtype=self._accumulate)
        plain = cast(list[float], [norm.tolist() for norm in read])
        if self._columns == 1:
            total = sum(norm * norm for norm in plain)
            return QuietLogged(plain, None) if math.isfinite(total) else None
        squares = [0.0] * self._columns
        for norm, column in zip(plain, columns):
            squares[column] += norm * norm
        total = sum(squares)
        if not math.isfinite(total):  # (NaN, Inf, or an fp32 norm that overflowed)
            return None
        squares[0] = total
        norms = [math.sqrt(square) for square in squares]
        spike = None
        if self._spikes is not None:
            spike = self._spikes.vector_values(norms) if logged else None
            if not self._spikes.quiet_values(norms):
                return None
        if self._flight is not None:
            self._flight.record_host(step, norms)
        return QuietLogged(plain, spike)

    def _learn(self, plan: list[DevicePlan], grads: list[torch.Tensor]) -> bool:
        """Whether ``plan`` (a new layout) is the simple one this pass serves; if so, its
        columns are kept for the steps that follow."""
        if len(plan) != 1 or plan[0].device.type != "cpu" or len(plan[0].groups) != 1:
            return False
        group = plan[0].groups[0]
        if not group.simple:
            return False  # (a sparse, complex or empty gradient: `plan` judges)
        self._plan, self._packed = plan, group.offsets
        self._shapes = group.shapes
        self._handed_whole = self._whole.fits_plan(plan[0], foreach_only=False)
        every = len(group.indices) == len(self._params)
        self._present = None if every else list(group.indices)
        self._accumulate = accumulation_dtype(grads[group.indices[0]].dtype)
        self._layer_columns = self._tensor_layer[plan[0].tensors] + 1
        self._sums = None
        small = len(self._layer_columns) <= SMALL_MODEL_TENSORS and self._packed is None
        self._small = self._layer_columns.tolist() if small else None
        if self._columns * len(self._layer_columns) <= _SUMS_BY_PRODUCT:
            self._sums = np.zeros((self._columns, len(self._layer_columns)))
            self._sums[0] = 1.0
            self._sums[self._layer_columns, np.arange(len(self._layer_columns))] = 1.0
        return True


class StepJudge:
    """Guards each step (one batched norm pass), judges it and plans it.

    ``raises``: the per-step rules whose action is "raise"; they, or a skip rule, must see
    every step's verdict, paying one read per step on an accelerator. ``judge_due``: a raise
    rule only the worker can judge (or a layout whose unlogged steps have no verdict) has it
    judge every due step before its optimizer step. ``every_step``: the verdict is read at
    every step; under FSDP2 each rank sees only its shards, so unlogged steps would need a
    collective, and the verdict comes with the logged steps instead.
    """

    def __init__(
        self,
        collector: Collector,
        signals: Signals,
        schedule: StepSchedule,
        raises: StepRules,
        judge_due: bool,
        every_step: bool,
        on_error: OnError,
    ) -> None:
        self.collector = collector
        self.signals = signals
        self.schedule = schedule
        self.raises = raises if raises else None  # (None: nothing to find, asked once)
        self.judge_due = judge_due
        # The verdict is read at every step: a per-step raise or skip rule acts on it now.
        self.reads_every_verdict = bool(raises) or signals.skips is not None
        self.every_step = every_step
        # None: the verdict is read at each step on the CPU, and latched on the device for
        # the next logged step elsewhere; False: latched everywhere (how tests take the
        # accelerator's path on a CPU).
        self.reads_host: bool | None = None
        self.latch: BadStepLatch | None = None
        self._on_error = on_error
        # The last judged step's total and layer norms (`LayerNorms`), on the device.
        self.layer_norms: torch.Tensor | None = None
        plain = collector.partitions is None and collector.mesh is None
        served = plain and not collector.local_shards and every_step and not raises
        self._quiet = (
            QuietSteps(collector, signals.layer_norms, signals.spikes, signals.flight)
            if served and signals.skips is None
            else None
        )

    def quiet(self, step: int) -> bool:
        """True: step ``step``, not due, was healthy and fully judged in the short pass
        (`QuietSteps`); False: `plan` judges it."""
        quiet = self._short_pass()
        if quiet is None or self.schedule.any_due(step):
            return False
        try:
            return quiet(step)
        except Exception:  # judged in full instead, where a fault is reported
            return False

    def quiet_logged(self, step: int) -> StepPlan | None:
        """The plan of a logged (not sampled) step of a small CPU model, judged healthy in
        the short pass and handed to the worker whole (`QuietSteps.logged`): what `plan`
        makes of such a step, without its dozen numpy calls. None: `plan` judges it."""
        quiet = self._short_pass()
        logged, with_samples = self.schedule.due(step)
        if quiet is None or not logged or with_samples:
            return None
        try:
            return quiet.logged(step, self.schedule.per_layer(step), self.judge_due)
        except Exception:  # judged in full instead, where a fault is reported
            return None

    def _short_pass(self) -> QuietSteps | None:
        """The short pass, where steps may take it: verdicts read on the host, none latched."""
        if self.reads_host is False or self.collector.foreach_only or self.latch is not None:
            return None
        return self._quiet

    def plan(self, step: int, micro_batches: list[int]) -> StepPlan | None:
        """Guard step ``step``, judge it, record it in the flight recorder and plan it; None
        if guarding failed (reported)."""
        logged, with_samples = self.schedule.due(step)
        guard = self.guard(step, exact=logged or with_samples)
        if guard is None:
            return None
        verdict, spike = self.judge(guard, step)
        error = None
        skips = self.signals.skips
        if verdict.skip is not None and skips is not None:
            error = skips.count(step, verdict.skip)
            if error is None:
                self._write_journal(step, verdict.skip, micro_batches)
            else:
                verdict = verdict._replace(skip=None)
        if self.signals.flight is not None:  # one copy on the device
            holding = None if self.latch is None else self.latch.holding  # (a bad step before)
            self.signals.flight.record(step, self.layer_norms, self._on_error, holding)
        bad = not verdict.finite
        first_bad = bad and self.schedule.first_bad(step)
        spiked = verdict.spiking and not bad and self.schedule.first_spike(step)
        first_flagged = first_bad or spiked
        due = logged or with_samples
        return StepPlan(
            step,
            guard,
            logged,
            with_samples,
            verdict,
            spike,
            error,
            first_bad,
            first_flagged,
            per_layer=(due and self.schedule.per_layer(step)) or first_flagged,
            judge_now=verdict.trip is not None or (due and self.judge_due),
            skipped_steps=0 if skips is None else skips.total,
        )

    def exact(self, plan: StepPlan) -> None:
        """A bad or skipped step is summarised: its norms must be exact."""
        if not plan.guard.exact:
            plan.guard = self.guard(plan.step, exact=True) or plan.guard

    def evidence(self, plan: StepPlan) -> EvidenceParts:
        """The step's spike vector (NaN where its statistics failed) and latch, for its
        record."""
        device = plan.guard.devices[0].device
        spike, spikes = plan.spike, self.signals.spikes
        if spike is None and spikes is not None:  # (this step's statistics failed)
            spike = torch.full((spikes.size,), math.nan, dtype=torch.float64, device=device)
        return spike, None if self.latch is None else self.latch.take(device)

    def guard(self, step: int, exact: bool) -> Guard | None:
        """Each gradient's L2 norm, in one batched pass on its device (exact where the step
        is summarised, see `Collector.guard`); None if that failed (reported)."""
        try:
            return self.collector.guard(exact)
        except Exception as exc:  # watching must never crash training
            self._on_error(step, exc)
            return None

    def judge(self, guard: Guard, step: int) -> tuple[Verdict, torch.Tensor | None]:
        """The step's verdict (`UNKNOWN` where it was latched instead) and spike vector."""
        if self._on_host(guard):
            return self._judge_on_host(guard, step)
        norms, spike = self._signals(guard, step)
        self.layer_norms = norms
        verdict = self._verdict(guard, norms, spike)
        if verdict is None:
            self._latch(guard, step, spike)
            return UNKNOWN, spike
        return verdict, spike

    def read_latch(self) -> np.ndarray | None:
        """At the end of training: the bad step latched since the last logged step, if any."""
        return None if self.latch is None else self.latch.read()

    def _on_host(self, guard: Guard) -> bool:
        """The usual CPU case, judged in numpy at every step: one CPU device (its norms are
        host memory: nothing to wait for), the verdict read at the step, signals on."""
        return (
            len(guard.devices) == 1
            and on_host(guard)
            and self.every_step
            and self.reads_host is not False
            and self.signals.layer_norms is not None
        )

    def _judge_on_host(self, guard: Guard, step: int) -> tuple[Verdict, torch.Tensor | None]:
        """`judge` in numpy: the layer norms, the spike vector and the verdict, each computed
        once on host memory (what `_signals` and `_verdict` do for any device)."""
        layer_norms, spikes = self.signals.layer_norms, self.signals.spikes
        assert layer_norms is not None  # (`_on_host`)
        try:
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                norms = layer_norms.on_host(guard.devices[0])
                spike = None if spikes is None else spikes.on_host(norms)
        except Exception as exc:  # watching must never crash training
            self._on_error(step, exc)
            self.layer_norms = None
            return self._verdict(guard, None, None) or UNKNOWN, None
        self.layer_norms = torch.from_numpy(norms)
        spike_vector = None if spike is None else torch.from_numpy(spike)
        # The total is finite only where every norm is (or where a finite fp64 norm's square
        # overflowed: then each norm is read).
        finite = math.isfinite(norms[0]) or bool(guard.finite())
        return self._ruled(finite, norms, spike), spike_vector

    def _signals(self, guard: Guard, step: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every step, on the device: the layer norms and the spike vector."""
        layer_norms, spikes = self.signals.layer_norms, self.signals.spikes
        if layer_norms is None:
            return None, None
        try:
            norms = layer_norms(guard)
            if spikes is None:
                return norms, None
            return norms, spikes.update(norms, host=on_host(guard))
        except Exception as exc:  # watching must never crash training
            self._on_error(step, exc)
            return None, None

    def _verdict(
        self, guard: Guard, norms: torch.Tensor | None, spike: torch.Tensor | None
    ) -> Verdict | None:
        """The verdict where it is known without waiting for a device (or a raise or skip
        rule pays one read per step); None: latch it instead."""
        if not self.every_step:  # each rank sees its pieces: latched, combined when logged
            return None
        cpu = all(part.device.type == "cpu" for part in guard.devices)
        if not self.reads_every_verdict and (self.reads_host is False or not cpu):
            return None
        if norms is None:  # (the layer norms failed: only the total can be judged)
            finite = bool(guard.finite(wait=True))
            total = np.full(1, np.nan if not finite else 0.0)
            trip = self.raises.find(finite, total, None) if self.raises is not None else None
            return Verdict(finite, False, None, trip)
        if cpu:  # host memory already: nothing to wait for, nothing to copy
            finite = bool(guard.finite())
            layer_norms = norms.numpy()
            spike_host = None if spike is None else spike.numpy()
        else:  # the one read a raise or skip rule costs: every device's verdict with it
            flags = [torch.isfinite(part.l2).all().to(norms.device) for part in guard.devices]
            parts = [torch.stack(flags).double(), norms, *([] if spike is None else [spike])]
            read = torch.cat(parts).cpu().numpy()
            finite = bool(read[: len(flags)].all())
            layer_norms = read[len(flags) : len(flags) + len(norms)]
            spike_host = None if spike is None else read[len(flags) + len(norms) :]
        return self._ruled(finite, layer_norms, spike_host)

    def _ruled(self, finite: bool, norms: np.ndarray, spike: np.ndarray | None) -> Verdict:
        """The verdict from the step's host values: spiking or not, and the skip and raise
        rules it trips."""
        spiking = spike is not None and bool(spike_fields(spike)["spiking"].any())
        skips = self.signals.skips
        skip = None if skips is None else skips.decide(finite, norms, spike)
        trip = self.raises.find(finite, norms, spike) if self.raises is not None else None
        return Verdict(finite, spiking, skip, trip)

    def _latch(self, guard: Guard, step: int, spike: torch.Tensor | None) -> None:
        if self.latch is None:
            spikes = self.signals.spikes
            spike_size = 0 if spikes is None else spikes.size
            self.latch = BadStepLatch(len(self.collector.params), spike_size)
        self.latch.update(guard, step, spike)

    def _write_journal(self, step: int, skip: Skip, micro_batches: list[int]) -> None:
        journal = self.signals.journal
        if journal is None:
            return
        try:
            journal.add(step, skip, micro_batches)
        except OSError as exc:  # the step is still skipped; only its journal line is lost
            self._on_error(step, exc)


# Per-layer steps per doubling of the step count, once past the dense start.
DEFAULT_DENSITY = 32


class DenseEarly:
    """True for the per-layer steps: every logged step at first, then ever sparser, until
    one per ``every`` steps.

    After a per-layer step ``s`` the next is due at the next multiple of ``gap(s)``: the
    largest power of two not above ``s // density`` (at least 1), and ``every`` from step
    ``density * every`` on — from there the steps are the first logged step of each window
    of ``every``, as with the fixed schedule. That is every logged step up to
    ``2 * density``, then ``density`` to ``2 * density`` per-layer steps per doubling of
    the step count. Over fixed windows of ``every`` this adds at most
    ``density * (1 + log2 every)`` per-layer steps to a run of any length (``density=32,
    every=100``: ≤ 245; a 200-step run logged every 10 steps gets 20 columns instead of
    2). It is asked only on logged steps, in increasing order.

    >>> due = DenseEarly(every=100, density=4)
    >>> [step for step in range(0, 1000) if due(step)][:14]
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20]
    >>> due = DenseEarly(every=100, density=4)  # logged every 10 steps
    >>> [step for step in range(0, 1000, 10) if due(step)][8:]
    [80, 100, 120, 130, 160, 200, 230, 260, 320, 390, 450, 500, 600, 700, 800, 900]
    """

    def __init__(self, every: int, density: int = DEFAULT_DENSITY) -> None:
        if every < 1 or density < 1:
            raise ValueError(f"every and density must be >= 1, got {every}, {density}")
        self.every, self.density = every, density
        self._next_due = 0

    def gap(self, step: int) -> int:
        """Steps from per-layer step ``step`` to the next one: ``every`` once
        ``step // density`` reaches it, else the largest power of two not above that (at
        least 1). Powers of two nest, so sparser steps stay on the denser ones."""
        target = step // self.density
        if target >= self.every:
            return self.every
        return 1 << max(0, target.bit_length() - 1)

    def __call__(self, step: int) -> bool:
        if step < self._next_due:
            return False
        gap = self.gap(step)
        self._next_due = (step // gap + 1) * gap
        return True


def extra_steps_bound(every: int, density: int = DEFAULT_DENSITY) -> int:
    """How many more per-layer steps `DenseEarly` writes than fixed windows of ``every``,
    at most, for a run of any length.

    >>> extra_steps_bound(100)
    245
    """
    return math.ceil(density * (1 + math.log2(every)))


def layer_schedule(config: GradtrackConfig) -> Callable[[int], bool]:
    """The per-layer schedule ``config.layer_schedule`` names, for ``config.layer_every``.

    >>> due = layer_schedule(GradtrackConfig(layer_every=100, layer_schedule="dense_early"))
    >>> [step for step in range(0, 200, 10) if due(step)] == list(range(0, 200, 10))
    True
    >>> due = layer_schedule(GradtrackConfig(layer_every=100))
    >>> [step for step in range(0, 200, 10) if due(step)]
    [0, 100]
    """
    if config.layer_schedule == "dense_early":
        return DenseEarly(config.layer_every)
    return FirstInWindow(config.layer_every)


class StepSchedule:
    """What each step writes: summarised (``log_every``), sampled for histograms
    (``histograms.every``), with per-layer metrics (`layer_schedule`), and which bad or spiking
    step of each ``layer_every`` window is written with its per-layer metrics anyway.

    >>> schedule = StepSchedule(GradtrackConfig(log_every=5, histograms={"every": 10}))
    >>> [schedule.due(step) for step in (0, 5, 7)]
    [(True, True), (True, False), (False, False)]
    >>> [schedule.any_due(step) for step in (0, 5, 7)]
    [True, True, False]
    >>> schedule = StepSchedule(GradtrackConfig(log_every=5, log_offset=1))  # Lightning's
    >>> [step for step in range(12) if schedule.due(step)[0]]
    [4, 9]
    """

    def __init__(self, config: GradtrackConfig) -> None:
        self.log_every = config.log_every
        self.offset = config.log_offset
        self.hist_every = config.histograms.every
        self.per_layer = layer_schedule(config)
        # The first non-finite step of each window, logged or not (the guard's find); and
        # the first spiking one, apart: a spike must not take a later NaN's place.
        self.first_bad = FirstInWindow(config.layer_every)
        self.first_spike = FirstInWindow(config.layer_every)

    def due(self, step: int) -> tuple[bool, bool]:
        """(summarised, sampled) for ``step``."""
        step += self.offset
        sampled = self.hist_every is not None and step % self.hist_every == 0
        return step % self.log_every == 0, sampled

    def any_due(self, step: int) -> bool:
        """Whether ``step`` is summarised or sampled (asked at every forward and step)."""
        step += self.offset
        if step % self.log_every == 0:
            return True
        return self.hist_every is not None and step % self.hist_every == 0


class BadStepLatch:
    """The step number and per-tensor L2 norms of the first bad step since the last `take`
    — non-finite, or spiking (`gradtrack.capture.spike`) — as one float64 tensor
    ``[step, *norms, *spike]`` on the model's (first) device; -1 for no step yet and for
    tensors without a gradient at that step; ``spike`` the step's spike vector (``spike_size``
    values, none without the spike rule)."""

    def __init__(self, n_tensors: int, spike_size: int = 0) -> None:
        self.n_tensors = n_tensors
        self.size = 1 + n_tensors + spike_size
        self._state: Tensor | None = None
        self._index = DeviceIndex()
        self.holding: Tensor | None = None  # see `update`

    def update(self, guard: Guard, step: int, spike: Tensor | None = None) -> None:
        """Latch this step if it is the first bad one: no host read, no branch."""
        part = guard.devices[0]  # (a model spread over devices is latched on its first)
        state = self._state_on(part.device)
        bad = ~torch.isfinite(part.l2).all()
        if spike is not None:
            bad = bad | spike_flagged(spike)
        empty = state[0] < 0
        self.holding = ~empty  # a bad step latched before this one
        fresh = torch.logical_and(bad, empty)
        if spike is not None:
            tail = state[1 + self.n_tensors :]
            tail.copy_(torch.where(fresh, spike, tail))
        state[0] = torch.where(fresh, float(step), state[0])
        index = self._index(part.index, part.device) + 1
        state[index] = torch.where(fresh, part.l2, state[index])

    def take(self, device: torch.device) -> Tensor:
        """The latch, for a logged step's host copy; the next step starts a fresh one (in
        place would race with the copy, which runs later in the device's stream)."""
        state, self._state, self.holding = self._state_on(device), None, None
        return state

    def read(self) -> np.ndarray | None:
        """The latch read on the host (a wait for the device: for the end of training only);
        None if no step was latched since the last take."""
        state, self._state, self.holding = self._state, None, None
        if state is None:
            return None
        flags = state.cpu().numpy()
        return None if flags[0] < 0 else flags

    def _state_on(self, device: torch.device) -> Tensor:
        if self._state is None:  # made on the device: a copy from the host could wait
            self._state = torch.full((self.size,), -1.0, dtype=torch.float64, device=device)
        return self._state


def spike_flagged(spike: Tensor) -> Tensor:
    """Whether any column of a `gradtrack.capture.spike.NormWindow` vector spiked (on the
    device)."""
    return spike[2 * (len(spike) // 3) :].any()


@dataclass
class Signals:
    spikes: NormWindow | None = None  # every step's spike statistics
    skips: SkipPolicy | None = None  # the rules whose action is "skip"
    journal: Journal | None = None  # the skipped steps, on disk
    layer_norms: LayerNorms | None = None  # every step's layer norms (for these three)
    flight: FlightRecorder | None = None  # the last steps' layer norms, on the device
    # each logged step's ‖ΔW‖, ‖W‖
    updates: UpdateProbe | SampledUpdateProbe | WholeUpdateProbe | None = None
    # Why the default (sampled) update signals are off, said once when watching starts.
    missing: str | None = None


def build_signals(
    config: GradtrackConfig,
    per_step: PerStepRules,
    collector: Collector,
    own_steps: bool,
    guard_every_step: bool,
    scaled: bool = False,
) -> Signals:
    """The signals ``config`` asks for. ``own_steps``: each step is one step of a given
    optimizer (and no scaler), which gradtrack's hooks wrap: skipping and update signals
    need it; ``guard_every_step``: the guard reads every step (spikes need it); ``scaled``:
    a GradScaler ends the steps; ``per_step``: the per-step rules the alerts share."""
    rules = per_step.alert_rules
    layer_names = collector.index.layer_names
    skip_rules = rules.skip_rules()
    exact = config.update_signals is True
    _refuse_unsupported(skip_rules, exact, collector, own_steps)
    signals = Signals()
    spike_on = per_step.enabled["spike"]
    if spike_on.any() and guard_every_step:
        signals.spikes = NormWindow(
            len(layer_names),
            rules.spike.window,
            rules.spike.warmup,
            z=per_step.spike_z,
            ratio=per_step.spike_ratio.tolist(),
            enabled=spike_on.tolist(),
        )
    if skip_rules:
        signals.skips = SkipPolicy(per_step, config.skip.max_consecutive)
        signals.journal = Journal(config.skip.journal)
    if config.flight.enabled and guard_every_step:
        signals.flight = FlightRecorder(config.flight.steps + 1, len(layer_names))  # + the incident
    raise_rules = rules.with_action("raise", SKIPPABLE)  # judged on every step's norms
    if signals.spikes or signals.skips or signals.flight or raise_rules:
        signals.layer_norms = LayerNorms(collector.index.tensor_layer, len(layer_names))

    def packs() -> bool:  # (the CPU's packed passes, unless the accelerator's path is forced)
        return collector.foreach_only is not True

    if config.update_signals == "sampled":
        signals.missing = _sampled_missing(own_steps, collector.sharded_weights, scaled)
    if not config.update_signals or signals.missing is not None:
        return signals
    if collector.whole.fit(collector.params):
        signals.updates = WholeUpdateProbe(
            collector.params, collector.whole
        )  # (exact, from two copies)
    elif exact:
        signals.updates = UpdateProbe(collector.params, packs)
    else:
        signals.updates = SampledUpdateProbe(
            collector.params, seed=config.histograms.seed, packs=packs
        )
    return signals


def _refuse_unsupported(
    skip_rules: tuple[str, ...], exact: bool, collector: Collector, own_steps: bool
) -> None:
    """A clear error where skipping or exact update signals cannot work with this setup."""
    if (skip_rules or exact) and not own_steps:
        feature = f"action='skip' ({', '.join(skip_rules)})" if skip_rules else "update_signals"
        raise GradtrackError(
            f"{feature} needs optimizer= (without scaler=): gradtrack must be at the "
            "optimizer's step, before and after it runs. (A GradScaler already skips "
            "non-finite steps by itself.)"
        )
    if skip_rules and collector.partitions is not None:
        raise GradtrackError(
            f"action='skip' ({', '.join(skip_rules)}) cannot leave out a DeepSpeed ZeRO step: "
            "the ZeRO optimizer steps its own partitions; use action='raise' or 'warn'"
        )
    if exact and collector.sharded_weights:
        raise GradtrackError(
            "update_signals does not support sharded parameters (FSDP2, ZeRO-3) yet"
        )


def _sampled_missing(own_steps: bool, sharded: bool, scaled: bool) -> str | None:
    """What the default update signals (and the learning_rate rule's evidence) lack here."""
    if scaled:
        return (
            "update ratios and the learning-rate diagnosis are off under a GradScaler: its "
            "steps end at scaler.update(), after the optimizer has stepped"
        )
    if not own_steps:
        return "update ratios and the learning-rate diagnosis are off: they need optimizer="
    if sharded:
        return "update ratios are off: sharded parameters (FSDP2, ZeRO-3) are not supported yet"
    return None
