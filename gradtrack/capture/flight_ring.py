"""The flight recorder's ring on the training thread: every step's per-layer norms (from the
guard's, `gradtrack.capture.spike.LayerNorms`) written with its step into one row of a
``[K, 1 + layers]`` float64 ring on the model's device — two small kernels per step, no host
read, no per-layer host work.

The rows since the last hand-off ride to the worker in the next summarised step's one host
copy (`StepEvidence.flight`), and the worker keeps them (`gradtrack.worker.flight_log`) and sends
the
window when an incident fires, so nothing flows back to this thread. Once an accelerator's
guard latched a bad step, the ring holds still until a logged step (or close) reads it: that
step's window survives any ``log_every``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

OnError = Callable[[int, Exception], None]


class FlightRecorder:
    """The last ``capacity`` steps' layer norms, on the device of the norms it is given: one
    float64 row ``[step, *layer norms]`` per step, so a frozen ring still says which steps
    it holds.

    >>> recorder = FlightRecorder(capacity=4, n_layers=2)
    >>> for step in range(6):
    ...     recorder.record(step, torch.tensor([9.0, step, -step], dtype=torch.float64))
    >>> rows = recorder.take().reshape(-1, 3)
    >>> rows[:, 0].tolist(), rows[:, 1].tolist()
    ([2.0, 3.0, 4.0, 5.0], [2.0, 3.0, 4.0, 5.0])
    >>> recorder.take() is None  # nothing new since
    True
    """

    def __init__(self, capacity: int, n_layers: int) -> None:
        self.capacity = capacity
        self.n_layers = n_layers
        self._ring: Tensor | None = None
        self._host: np.ndarray | None = None  # the ring's memory, where it is the CPU's
        self._written = 0  # slots written so far (the next one is ``_written % capacity``)
        self._handed = 0  # ... of which handed to the worker
        # The last rows `record_host` took (the newest ``_written`` counts), not yet in the
        # ring's memory: a list append costs a quiet step less than numpy's writes.
        self._waiting: list[tuple[int, np.ndarray | list[float]]] = []

    @property
    def nbytes(self) -> int:
        """Device memory the ring takes: capacity × (1 + layers) × 8 bytes."""
        return self.capacity * (1 + self.n_layers) * 8

    def record(
        self,
        step: int,
        norms: Tensor | None,
        on_error: OnError | None = None,
        hold: Tensor | None = None,
    ) -> None:
        """Keep one step's norms (``[1 + layers]``: the total first, as `LayerNorms` gives;
        None: the step has none). ``hold``, a boolean on the device: True keeps the ring as
        it is (a bad step was latched before this one, and its window must outlive the steps
        until the next logged step reads it). A failure goes to ``on_error``: training goes
        on."""
        if norms is None:
            return
        try:
            self._record(step, norms, hold)
        except Exception as exc:  # watching must never crash training
            if on_error is None:
                raise
            on_error(step, exc)

    def record_host(self, step: int, norms: np.ndarray | list[float]) -> None:
        """`record` for host norms (a CPU model's quiet step), which the caller hands over
        (they must not change): kept in a list, written into the ring with the others once
        ``capacity`` wait or the ring is read."""
        if self._host is None:
            self.record(step, torch.as_tensor(norms, dtype=torch.float64))
            return
        self._waiting.append((step, norms))
        self._written += 1
        if len(self._waiting) == self.capacity:
            self._settle()

    def _settle(self) -> None:
        """Write the rows `record_host` keeps into their slots, in one numpy write."""
        waiting, self._waiting = self._waiting, []
        if not waiting:
            return
        assert self._host is not None  # (they wait only where the ring is the CPU's)
        start = self._written - len(waiting)
        self._host[np.arange(start, self._written) % self.capacity] = _rows(waiting)

    def _record(self, step: int, norms: Tensor, hold: Tensor | None) -> None:
        self._settle()
        if self._ring is None or self._ring.device != norms.device:
            self._ring = torch.full(
                (self.capacity, 1 + self.n_layers),
                -1.0,
                dtype=torch.float64,
                device=norms.device,
            )
            self._host = self._ring.numpy() if self._ring.device.type == "cpu" else None
        index = self._written % self.capacity
        if hold is None and self._host is not None:  # (the ring is on the norms' device)
            row = self._host[index]  # (CPU memory: two numpy writes, no kernel launches)
            row[:] = norms.numpy()
            row[0] = step
            self._written += 1
            return
        slot = self._ring[index]
        if hold is None:
            slot.copy_(norms, non_blocking=True)
            slot[0].fill_(step)  # (the total's place)
        else:  # no host read, no branch: the slot keeps its row where held
            fresh = norms.to(torch.float64, copy=True)
            fresh[0].fill_(step)
            slot.copy_(torch.where(hold, slot, fresh))
        self._written += 1

    def take(self) -> Tensor | list[float] | None:
        """The rows written since the last take (at most ``capacity``, oldest first), as one
        flat float64 tensor on the ring's device (a copy: the ring goes on); None if there
        are none. A held ring hands on rows it handed before: `FlightLog.add` drops them.
        Rows `record_host` kept, at most `HOST_VALUES` numbers, come as Python floats (what a
        CPU model's logged step packs without a tensor, see `StepEvidence.on_host`)."""
        count = min(self._written - self._handed, self.capacity)
        self._handed = self._written
        if 0 < count <= len(self._waiting):  # (all kept by `record_host`: read, never again)
            waiting, self._waiting = self._waiting[-count:], []
            if count * (1 + self.n_layers) <= HOST_VALUES:
                return _flat_rows(waiting)
            return torch.from_numpy(_rows(waiting).reshape(-1))
        self._settle()
        if count == 0 or self._ring is None:
            return None
        end = self._written % self.capacity
        start = (end - count) % self.capacity
        if start < end:
            rows = self._ring[start:end].clone()
        else:  # wrapped around
            rows = torch.cat([self._ring[start:], self._ring[:end]])
        return rows.reshape(-1)

    def take_on_host(self) -> np.ndarray | None:
        """`take`, read on the host (a wait for the device: for the end of training only)."""
        taken = self.take()
        if isinstance(taken, list):
            return np.array(taken, dtype=np.float64)
        return None if taken is None else taken.cpu().numpy()


# The most numbers `FlightRecorder.take` hands on as Python floats (a few rows of a small
# model); more come as one tensor, which numpy fills faster than Python lists grow.
HOST_VALUES = 256


def _flat_rows(waiting: list[tuple[int, np.ndarray | list[float]]]) -> list[float]:
    """The rows `record_host` kept, end to end as Python floats, each step in its total's
    place.

    >>> _flat_rows([(7, [3.0, 1.0, 2.0]), (8, [5.0, 3.0, 4.0])])
    [7.0, 1.0, 2.0, 8.0, 3.0, 4.0]
    """
    flat: list[float] = []
    for step, norms in waiting:
        flat.append(float(step))
        flat += norms[1:]  # (an array's items are numpy floats: floats too)
    return flat


def _rows(waiting: list[tuple[int, np.ndarray | list[float]]]) -> np.ndarray:
    """The rows `record_host` kept, ``[steps, 1 + layers]`` float64, each step in its total's
    place (new memory: the kept norms stay as they were handed over)."""
    if len(waiting) == 1:  # (a step logged at every step: one row, no list of lists)
        step, norms = waiting[0]
        row = np.array(norms, dtype=np.float64)
        row[0] = step
        return row[None]
    rows = np.array([norms for _, norms in waiting], dtype=np.float64)
    rows[:, 0] = [step for step, _ in waiting]
    return rows
