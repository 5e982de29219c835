"""The blocking facade over the async engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Awaitable
from typing import Unpack

from ledger.adapters.base import (
    AdapterOptions,
    HttpAdapter,
    Limits,
    OnEvent,
    Progress,
    Request,
    Target,
)
from ledger.adapters.contract import AdapterResult, StreamEvent
from ledger.domain.validation import Id, checked
from ledger.errors import InvalidArgument

_WAIT_SLICE_S = 0.2


class _Interrupted(Exception):
    """A callback's ``KeyboardInterrupt`` or ``SystemExit``, carried out of the loop thread.

    Raised as itself inside a task, asyncio lets it stop the loop (and the thread) instead of
    finishing the task, so the waiting caller would wait forever; as an ordinary exception it
    ends the send like any callback error, and the caller re-raises the original.
    """

    def __init__(self, exc: BaseException) -> None:
        super().__init__(repr(exc))
        self.exc = exc


def _relayed(on_event: OnEvent | None) -> OnEvent | None:
    if on_event is None:
        return None
    callback = on_event

    async def finish(ret: Awaitable[object]) -> None:
        try:
            await ret
        except (KeyboardInterrupt, SystemExit) as exc:
            raise _Interrupted(exc) from exc

    def relay(event: StreamEvent) -> Awaitable[None] | None:
        try:
            ret = callback(event)
        except (KeyboardInterrupt, SystemExit) as exc:
            raise _Interrupted(exc) from exc
        return finish(ret) if inspect.isawaitable(ret) else None

    return relay


@checked
class SyncAdapter:
    """The blocking facade: the same :class:`HttpAdapter`, run on a private event loop thread.

    ``on_event`` callbacks run on that thread while the calling thread waits. Use one
    ``SyncAdapter`` per process (or per configuration) and :meth:`close` it at exit (or use it
    as a ``with`` block). The arguments are :class:`HttpAdapter`'s (without ``clients``: the
    registry lives on the private loop).

    Args:
        **options: :class:`~ledger.adapters.base.AdapterOptions`.

    Raises:
        InvalidArgument: an option of the wrong type or out of range (checked before the loop
            thread starts, so a refused option leaves nothing running).
    """

    def __init__(self, **options: Unpack[AdapterOptions]) -> None:
        # Validated before the loop thread starts: a refused option leaves nothing running.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="ledger-adapter-loop", daemon=True
        )
        self._thread.start()
        # The registry is created here but its clients are created on the loop thread, which
        # is the only place they are ever used.
        self.adapter = HttpAdapter(**options)
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
        """:meth:`HttpAdapter.send`, waited for on the calling thread (same arguments).

        Raises:
            InvalidArgument: the adapter is closed, the call comes from its own loop thread
                (an ``on_event`` callback), or :meth:`HttpAdapter.send`'s caller misuse.
        """
        if self._closed:
            raise InvalidArgument("this SyncAdapter is closed; create a new one", field="self")
        if threading.current_thread() is self._thread:
            raise InvalidArgument(
                "SyncAdapter.send was called from its own loop thread (inside an on_event "
                "callback); use HttpAdapter.send in async code",
                field="self",
            )
        fut = asyncio.run_coroutine_threadsafe(
            self.adapter.send(
                route, envelope, profile_id=profile_id, on_event=_relayed(on_event),
                limits=limits, progress=progress, attempt_id=attempt_id,
            ),
            self._loop,
        )
        try:
            # Waited in short slices: a Ctrl-C (or any signal) is then handled within a fraction
            # of a second on every platform, not only where a lock wait is interruptible.
            while True:
                try:
                    return fut.result(timeout=_WAIT_SLICE_S)
                except concurrent.futures.TimeoutError:
                    if fut.done():
                        raise
                except _Interrupted as carried:
                    raise carried.exc from None
        except BaseException:
            fut.cancel()
            raise

    def close(self) -> None:
        """Close the clients and stop the loop thread (a second close does nothing)."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.adapter.aclose(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        # else the loop was stopped under it (a BaseException escaped a task): nothing there
        # would ever run a close, and waiting for one would hang.
        self._loop.close()

    def __enter__(self) -> SyncAdapter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["SyncAdapter"]
