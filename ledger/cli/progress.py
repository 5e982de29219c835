"""Progress of a long command on stderr, with an ETA, only when a person is watching.

``generate``, ``recover`` and the benchmarks (``python -m benchmarks``) report ``(done, total)``
through a callback; this turns that into one redrawn line::

    generate [############..................]  40%  400000/1000000  12 s elapsed, ETA 18 s

It draws only when stderr is a terminal (or ``--progress`` asks for it), so piped and redirected
output stays clean. Stdlib only: a line of text does not justify a dependency (tqdm and rich
would add import time to every command and a package to every install for one feature).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from ledger.domain.timefmt import duration

_WIDTH = 30


def wanted(forced: bool = False, stream: TextIO | None = None) -> bool:
    """Draw progress? Yes when forced or when the stream (default stderr) is a terminal."""
    s = stream if stream is not None else sys.stderr
    return forced or bool(getattr(s, "isatty", lambda: False)())


def eta(done: int, total: int, elapsed: float) -> float | None:
    """Seconds left at the average rate so far; ``None`` until there is a rate to go by."""
    if done <= 0 or total <= 0 or elapsed <= 0:
        return None
    return max(0.0, elapsed * (total - done) / done)


class Progress:
    """A callable ``(done, total)`` that redraws one stderr line at most ten times a second."""

    def __init__(self, label: str, enabled: bool, stream: TextIO | None = None) -> None:
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._now = time.monotonic
        self.start = self._now()
        self._last = float("-inf")
        self._open = False  # a line is drawn and not yet ended

    def line(self, done: int, total: int, elapsed: float) -> str:
        """The text of the progress line (no carriage return)."""
        frac = min(1.0, done / total) if total > 0 else 0.0
        bar = "#" * int(frac * _WIDTH)
        left = eta(done, total, elapsed)
        tail = ("done" if done >= total else
                f"ETA {duration(left)}" if left is not None else "ETA -")
        return (f"{self.label} [{bar.ljust(_WIDTH, '.')}] {frac * 100:3.0f}%  {done}/{total}  "
                f"{duration(elapsed)} elapsed, {tail}")

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        now = self._now()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        self.stream.write("\r" + self.line(done, total, now - self.start) + "\x1b[K")
        self._open = True
        if done >= total:
            self.close()
        else:
            self.stream.flush()

    def note(self, text: str) -> None:
        """A message line that does not tear the progress line (always printed)."""
        if self._open:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        self._open = False
        self.stream.flush()

    def close(self) -> None:
        """End the progress line, if one is drawn."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


__all__ = ["Progress", "eta", "wanted"]
