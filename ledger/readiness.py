"""Whether the peer of an idle connection has spoken: one poll of its descriptor.

A connection nobody is using should have nothing to read. If it has (bytes, or its end), the
peer has written or closed it, and it must not carry the next request: the PostgreSQL pool
(:mod:`ledger.storage.pgpool`) asks before lending a connection, httpcore's pool asks through
the adapters' asyncio sockets (:mod:`ledger.adapters.transport`).
"""

from __future__ import annotations

import select
from typing import Protocol


class HasFileno(Protocol):
    """A socket or a connection: anything with a descriptor."""

    def fileno(self) -> int:
        """The descriptor (negative once closed, or raises)."""
        ...


def peer_spoke(conn: HasFileno) -> bool:
    """Whether ``conn`` has something to read or is closed.

    ``poll`` where there is one: ``select`` refuses descriptors past 1024, which a busy process
    has.
    """
    try:
        fd = conn.fileno()
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(0))
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):  # closed: a negative or stale descriptor
        return True


__all__ = ["HasFileno", "peer_spoke"]
