"""The blocking facade: the same engine, driven on the calling thread."""

from __future__ import annotations

from typing import Unpack

from ledger.adapters.base import (
    AdapterOptions,
    Clients,
    HttpAdapter,
    Limits,
    OnEvent,
    Progress,
    Request,
    Target,
)
from ledger.adapters.contract import AdapterResult
from ledger.adapters.exchange import blocking_driver, run
from ledger.domain.validation import Id, checked
from ledger.errors import InvalidArgument


@checked
class SyncAdapter:
    """The blocking facade: :class:`HttpAdapter`'s engine, driven on the calling thread.

    Every decision of a call (what is sent, what a status, a byte or a timeout means, what the
    result holds) is the engine's, the same as :class:`HttpAdapter`'s; only the I/O differs: a
    blocking ``httpx.Client`` per endpoint origin, shared by every thread, with no event loop
    and no thread hop (:mod:`ledger.adapters.exchange`). ``on_event`` callbacks run on the
    calling thread; one that returns an awaitable is run to its end there. Use one
    ``SyncAdapter`` per process (or per configuration) and :meth:`close` it at exit (or use it
    as a ``with`` block). The arguments are :class:`HttpAdapter`'s.

    Args:
        clients: The pooled httpx clients (default: a private :class:`ClientRegistry`; its
            blocking clients are the ones used, and :meth:`close` closes them).
        **options: :class:`~ledger.adapters.base.AdapterOptions`.

    Raises:
        InvalidArgument: an option of the wrong type or out of range.
    """

    def __init__(self, *, clients: Clients | None = None,
                 **options: Unpack[AdapterOptions]) -> None:
        self.adapter = HttpAdapter(clients=clients, **options)
        self._closed = False

    def send(
        self,
        route: Target,
        envelope: Request,
        *,
        profile_id: Id | None,
        on_event: OnEvent | None = None,
        limits: Limits | None = None,
        progress: Progress | None = None,
        attempt_id: Id | None = None,
    ) -> AdapterResult:
        """:meth:`HttpAdapter.send`, blocking on the calling thread (same arguments).

        Raises:
            InvalidArgument: the adapter is closed, or :meth:`HttpAdapter.send`'s caller
                misuse.
        """
        if self._closed:
            raise InvalidArgument("this SyncAdapter is closed; create a new one", field="self")
        engine = self.adapter
        call = engine._start(route, envelope, profile_id, on_event, limits, progress,
                             attempt_id, blocking_driver())
        if isinstance(call, AdapterResult):
            return call
        return run(engine._exchange(call, engine.clients.get_sync(call.url),
                                    call.progress.trace_sync))

    def close(self) -> None:
        """Close the blocking clients (a second close does nothing).

        A call still in flight on one (another thread's) fails at once as a local
        cancellation, as :meth:`HttpAdapter.aclose <ledger.adapters.HttpAdapter.aclose>`
        says: its connection is shut down, which ends a read blocked on it (for the status
        line or inside a body, over TLS too), rather than waiting out its read limit.
        """
        if self._closed:
            return
        self._closed = True
        self.adapter.clients.close()

    def __enter__(self) -> SyncAdapter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["SyncAdapter"]
