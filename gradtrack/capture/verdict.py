"""Every step's guard and its verdict, on the training thread: finite or not, spiking or
not, and the skip a rule asks for — known now where that costs no wait for the device, else
latched on the device for the next logged step (`gradtrack.capture.latch`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from gradtrack.capture.collect import Collector, Guard
from gradtrack.capture.latch import BadStepLatch
from gradtrack.capture.skip import Skip
from gradtrack.capture.spike import on_host
from gradtrack.capture.step_signals import Signals
from gradtrack.handoff.layout import spike_fields

OnError = Callable[[int, Exception], None]


class Verdict(NamedTuple):
    finite: bool
    spiking: bool
    skip: Skip | None  # the skip a rule asks for


UNKNOWN = Verdict(True, False, None)  # (latched instead, or FSDP2: the logged steps judge)


class StepJudge:
    """Guards each step (one batched norm pass) and judges it.

    ``raise_on_alert``: a rule may raise. It, or a skip rule, must see every step's
    verdict, paying one read per step on an accelerator. ``every_step``: the verdict is read
    at every step; under FSDP2 each rank sees only its shards, so unlogged steps would need
    a collective, and the verdict comes with the logged steps instead.
    """

    def __init__(
        self,
        collector: Collector,
        signals: Signals,
        raise_on_alert: bool,
        every_step: bool,
        on_error: OnError,
    ) -> None:
        self.collector = collector
        self.signals = signals
        self.raise_on_alert = raise_on_alert
        self.judge_now = raise_on_alert or signals.skips is not None
        self.every_step = every_step
        # None: the verdict is read at each step on the CPU, and latched on the device for
        # the next logged step elsewhere; False: latched everywhere (how tests take the
        # accelerator's path on a CPU).
        self.reads_host: bool | None = None
        self.latch: BadStepLatch | None = None
        self._on_error = on_error
        # The last judged step's total and layer norms (`LayerNorms`), on the device.
        self.layer_norms: torch.Tensor | None = None

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
        norms, spike = self._signals(guard, step)
        self.layer_norms = norms
        verdict = self._verdict(guard, norms, spike)
        if verdict is None:
            self._latch(guard, step, spike)
            return UNKNOWN, spike
        return verdict, spike

    def spike_or_unknown(self, guard: Guard, spike: torch.Tensor | None) -> torch.Tensor | None:
        """The step's spike vector for its record: NaN where this step's statistics failed;
        None without the spike rule."""
        spikes = self.signals.spikes
        if spikes is None or spike is not None:
            return spike
        device = guard.devices[0].device
        return torch.full((spikes.size,), float("nan"), dtype=torch.float64, device=device)

    def take_latch(self, guard: Guard) -> torch.Tensor | None:
        return None if self.latch is None else self.latch.take(guard.devices[0].device)

    def holding(self) -> torch.Tensor | None:
        """On the device: whether a bad step was latched before the last judged one (the
        flight recorder then holds its window); None where nothing is latched."""
        return None if self.latch is None else self.latch.holding

    def read_latch(self) -> np.ndarray | None:
        """At the end of training: the bad step latched since the last logged step, if any."""
        return None if self.latch is None else self.latch.read()

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
        if not self.every_step:
            return UNKNOWN
        cpu = all(part.device.type == "cpu" for part in guard.devices)
        if not self.judge_now and (self.reads_host is False or not cpu):
            return None
        if norms is None:
            return Verdict(bool(guard.finite(wait=True)), False, None)
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
        spiking = spike_host is not None and bool(spike_fields(spike_host)["spiking"].any())
        skips = self.signals.skips
        skip = None if skips is None else skips.decide(finite, layer_norms, spike_host)
        return Verdict(finite, spiking, skip)

    def _latch(self, guard: Guard, step: int, spike: torch.Tensor | None) -> None:
        if self.latch is None:
            spikes = self.signals.spikes
            spike_size = 0 if spikes is None else spikes.size
            self.latch = BadStepLatch(len(self.collector.params), spike_size)
        self.latch.update(guard, step, spike)
