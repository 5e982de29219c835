"""A clock shared by several processes, for multi-process tests that must control time.

:class:`SharedClock` keeps one float in a small file mapped into every process that opens it;
one process (the test) moves it, every other process reads it. Readers never see a half-written
value (a sequence number around each write, as in a seqlock). It is a
:class:`~ledger.clock.Clock`, so ``Ledger.open(url, clock=SharedClock(path))`` in a worker makes
leases expire exactly when the test says.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

_LAYOUT = struct.Struct("<Qd")  # sequence number (odd while writing), time


class SharedClock:
    """Epoch seconds stored in ``path``; :meth:`advance` and :meth:`set` move it for everyone."""

    def __init__(self, path: str | Path, *, start: float | None = None) -> None:
        self.path = str(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < _LAYOUT.size:
                os.ftruncate(fd, _LAYOUT.size)
            self._map = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)
        if start is not None:
            self.set(start)

    def now(self) -> float:
        """The shared time (a consistent read, retried while a writer is mid-write)."""
        while True:
            seq, value = _LAYOUT.unpack_from(self._map, 0)
            if seq % 2 == 0 and _LAYOUT.unpack_from(self._map, 0)[0] == seq:
                return float(value)

    def set(self, t: float) -> None:
        """Set the shared time to ``t`` for every process (one writer at a time)."""
        seq = _LAYOUT.unpack_from(self._map, 0)[0]
        struct.pack_into("<Q", self._map, 0, seq + 1)
        struct.pack_into("<d", self._map, 8, float(t))
        struct.pack_into("<Q", self._map, 0, seq + 2)

    def advance(self, seconds: float) -> None:
        """Move the shared time on by ``seconds``."""
        self.set(self.now() + seconds)

    def close(self) -> None:
        """Unmap the file (the time stays in it for the other processes)."""
        self._map.close()


__all__ = ["SharedClock"]
