"""When a logged step also writes its per-layer metrics: schedules are plain ``step -> bool``.

``DenseEarly`` gives a short run enough columns to see anything and a long run the cost of
``layer_every``; `layer_schedule` picks the one a config asks for.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gradtrack.config import GradtrackConfig
from gradtrack.handoff.layout import FirstInWindow

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
        return self.due(step) != (False, False)
