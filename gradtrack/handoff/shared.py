"""Memory the training process and its worker process share: where the training thread copies
a small CPU step's gradients and weights (`gradtrack.capture.collect.WholeCopies`), and where
the worker process reads them in place.

Without it those copies are reduced to their rows by the training process's feed thread before
they cross the pipe (tens of KiB a step through the pipe fell behind a fast loop): numpy work
whose Python takes the GIL the training thread needs at every op — at every step logged, more
than the training thread's own part of a logged step. Here a copy crosses as three numbers,
and the worker process reduces it.

An anonymous file (``memfd``) both processes map: one flag per copy in use at its head (set
when a copy is laid, cleared by the worker process once it let the copy go, or here where a
copy never crossed: a step dropped from a full queue), then the copies, laid in turn as in a
ring. Full (the worker process lags by more than the ring holds) or absent (not Linux; or a model
no step of which is copied whole, `gradtrack.capture.collect.ring_size`), a copy is an
ordinary tensor, and the feed thread reduces it as before.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections import deque
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

_FLAGS = 4096  # copies in use at most (the flags at the file's head)
_ALIGN = 64

# The ring's size: `RING_BYTES` for a watch whose copies go out every 10th step or less
# often, more where they go out more often, up to `RING_MAX_BYTES` (see `ring_bytes`).
RING_BYTES = 16 << 20
RING_MAX_BYTES = 64 << 20


def ring_bytes(every: int) -> int:
    """The ring's size for a watch whose steps' copies go out every ``every`` steps (logged
    or sampled): room for as many steps' copies as the default's 16 MiB holds at
    ``log_every=10``, up to 64 MiB.

    The child takes a step's copies off the ring as it arrives, in bursts (the feed thread
    gathers steps for 50 ms, and the child's threads share its GIL): a ring that fills between
    bursts lays nothing, and the training process's feed thread reduces the copies itself.
    At ``log_every=1``, over 20,000 steps of `benchmarks.fastloop`'s tight loop in a row, a
    16 MiB ring had no room for 31-64 % of the steps' copies, 64 MiB for 2-14 % (3 runs
    each; ``fastloop --chunk 2000``: 2.63x → 2.40x and 2.49x → 2.45x in two runs).

    >>> [ring_bytes(n) >> 20 for n in (1, 3, 5, 10, 100)]
    [64, 53, 32, 16, 16]
    """
    size = min(RING_MAX_BYTES, max(RING_BYTES, RING_BYTES * 10 // max(1, every)))
    return size // _ALIGN * _ALIGN


class SharedCopies:
    """The ring of copies, as the training process lays them (`empty`) and hands them on
    (`crossing`), or as the worker process reads them (`view`, see `attach`)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self._map = mmap.mmap(fd, _FLAGS + size)
        self._flags = np.frombuffer(self._map, dtype=np.uint8, count=_FLAGS)
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_FLAGS, count=size)
        self._base = self._data.data_ptr()
        self._head = 0  # bytes laid so far; the next copy starts at ``_head % size``
        self._tail = 0  # ... of which free again
        self._held: deque[tuple[int, int]] = deque()  # (flag, its copy's end), oldest first
        self._laid = 0  # copies laid so far (a copy's flag: its number modulo `_FLAGS`)
        self._floats = self._data.view(torch.float32)  # (copies are sliced from it: one op)
        self._uncrossed: dict[int, _Laid] = {}  # a copy's address → it, until it crosses
        # Flags change only in the process that mapped the ring: a process forked from it
        # (a DataLoader worker) that collects an object it inherited must not free its room.
        self._pid = os.getpid()

    @classmethod
    def create(cls, size: int) -> SharedCopies | None:
        """The training process's ring of ``size`` bytes, its pages touched now (a page
        first written inside a step costs it a fault: ~20 a logged step of a small model,
        tens of µs); None where this system has no anonymous shared file."""
        try:
            fd = os.memfd_create("gradtrack-copies")
            os.ftruncate(fd, _FLAGS + size)
        except (AttributeError, OSError):
            return None
        shared = cls(fd, size)
        shared._data.zero_()
        return shared

    # -- the training process -------------------------------------------------------------
    def empty(self, numel: int) -> Tensor | None:
        """A float32 tensor of ``numel`` elements laid in the ring, to copy into; None where
        the ring has no room for it."""
        nbytes = -(-numel * 4 // _ALIGN) * _ALIGN
        if nbytes > self.size // 4:
            return None
        self._reclaim()
        start = self._head % self.size
        skip = self.size - start if start + nbytes > self.size else 0  # (past the end: at 0)
        if self._head + skip + nbytes - self._tail > self.size or len(self._held) == _FLAGS:
            return None
        self._head += skip
        start = self._head % self.size
        self._head += nbytes
        flag = self._laid % _FLAGS
        self._laid += 1
        self._flags[flag] = 1
        self._held.append((flag, self._head))
        copy = self._floats[start // 4 : start // 4 + numel]
        address = self._base + start
        self._uncrossed[address] = _Laid(copy, self._dropped, flag, address)
        return copy

    def holds(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` lies in the ring (the worker process reads it in place)."""
        return self._base <= tensor.data_ptr() < self._base + self.size

    def crossing(self, tensor: Tensor) -> tuple[int, int, int] | None:
        """How ``tensor``, a copy laid here, crosses to the worker process: its offset, its
        elements and its flag (the worker process clears the flag); None if it is not one."""
        laid = self._uncrossed.pop(tensor.data_ptr(), None) if self.holds(tensor) else None
        if laid is None:
            return None
        return laid.address - self._base, tensor.numel(), laid.flag

    def _dropped(self, laid: _Laid) -> None:
        """A copy let go here before it crossed (a step dropped from a full queue): its room
        is free again."""
        if os.getpid() != self._pid:
            return
        if self._uncrossed.get(laid.address) is laid:
            del self._uncrossed[laid.address]
            self._flags[laid.flag] = 0

    def _reclaim(self) -> None:
        """Free the room of the oldest copies the worker process (or this one) let go."""
        held, flags = self._held, self._flags
        while held and not flags[held[0][0]]:
            self._tail = held.popleft()[1]

    # -- the worker process ---------------------------------------------------------------
    def view(self, offset: int, numel: int, flag: int) -> Tensor:
        """The copy at ``offset``, read in place; its flag cleared once it is let go."""
        copy = torch.frombuffer(self._map, dtype=torch.float32, count=numel, offset=_FLAGS + offset)
        weakref.finalize(copy, self._let_go, flag)
        return copy

    def _let_go(self, flag: int) -> None:
        if os.getpid() == self._pid:
            self._flags[flag] = 0


class _Laid(weakref.ref):
    """A copy laid in the ring that has not crossed yet: its flag and address, and a call to
    `SharedCopies._dropped` if the copy is let go first (a weak reference with a callback:
    a third of the cost of a ``weakref.finalize``, on every copy of a logged step)."""

    __slots__ = ("address", "flag")
    flag: int
    address: int

    def __new__(
        cls, copy: Tensor, dropped: Callable[[_Laid], None], flag: int, address: int
    ) -> _Laid:
        laid = super().__new__(cls, copy, dropped)
        laid.flag, laid.address = flag, address
        return laid

    def __init__(self, *_args: object) -> None:  # (`__new__` made it: ref's own takes two)
        pass


# The worker process's ring, once `attach`ed (`shared_copy` reads from it).
_attached: SharedCopies | None = None


def attach(fd: int, size: int) -> None:
    """In the worker process: map the ring the training process passed it."""
    global _attached
    _attached = SharedCopies(fd, size)


def shared_copy(offset: int, numel: int, flag: int) -> Tensor:
    """A copy as it arrives in the worker process (what `SharedCopies.crossing` pickles to)."""
    assert _attached is not None, "a shared copy reached a process without the ring"
    return _attached.view(offset, numel, flag)
