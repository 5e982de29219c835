"""The blocking facade over the async engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ssl
import threading

from ledger.adapters.base import (
    MAX_EVENT_BYTES,
    HttpAdapter,
    check_adapter_options,
)
from ledger.adapters.contract import (
    AdapterResult,
    EventCallback,
)
from ledger.adapters.secrets import (
    EVIDENCE_CAP_BYTES,
    SecretProvider,
)
from ledger.decide.effects import SendProgress
from ledger.domain.envelope import Envelope
from ledger.domain.validation import checked_calls
from ledger.domain.values import Route
from ledger.errors import InvalidArgument
from ledger.policy.model import StreamingPolicy

_WAIT_SLICE_S = 0.2


@checked_calls
class SyncAdapter:
    """The blocking facade: the same :class:`HttpAdapter`, run on a private event loop thread.

    ``on_event`` callbacks run on that thread while the calling thread waits. Use one
    ``SyncAdapter`` per process (or per configuration) and :meth:`close` it at exit (or use it
    as a ``with`` block). The arguments are :class:`HttpAdapter`'s (without ``clients``: the
    registry lives on the private loop).

    Args:
        secrets: Where each profile's secret comes from (default: the environment).
        limits: The default time limits (a ``StreamingPolicy``).
        verify: TLS verification (``True``, ``False`` or an ``ssl.SSLContext``).
        max_body_bytes: Largest whole body read.
        evidence_cap_bytes: Largest error excerpt kept as evidence.
        max_stream_bytes: Most bytes read from one stream.
        max_event_bytes: Largest stream event (and line) parsed.

    Raises:
        InvalidArgument: an option of the wrong type or out of range (checked before the loop
            thread starts, so a refused option leaves nothing running).
    """

    def __init__(
        self,
        *,
        secrets: SecretProvider | None = None,
        limits: StreamingPolicy | None = None,
        verify: ssl.SSLContext | bool = True,
        max_body_bytes: int = 16 * 1024 * 1024,
        evidence_cap_bytes: int = EVIDENCE_CAP_BYTES,
        max_stream_bytes: int = 64 * 1024 * 1024,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        # Checked before the loop thread starts: a refused option leaves nothing running.
        check_adapter_options(secrets=secrets, limits=limits, verify=verify,
                              max_body_bytes=max_body_bytes,
                              evidence_cap_bytes=evidence_cap_bytes,
                              max_stream_bytes=max_stream_bytes,
                              max_event_bytes=max_event_bytes)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="ledger-adapter-loop", daemon=True
        )
        self._thread.start()
        # The registry is created here but its clients are created on the loop thread, which
        # is the only place they are ever used.
        self.adapter = HttpAdapter(
            secrets=secrets,
            limits=limits,
            verify=verify,
            max_body_bytes=max_body_bytes,
            evidence_cap_bytes=evidence_cap_bytes,
            max_stream_bytes=max_stream_bytes,
            max_event_bytes=max_event_bytes,
        )
        self._closed = False

    def send(
        self,
        route: Route,
        envelope: Envelope,
        *,
        profile_id: str | None,
        on_event: EventCallback | None = None,
        limits: StreamingPolicy | None = None,
        progress: SendProgress | None = None,
        attempt_id: str | None = None,
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
                route, envelope, profile_id=profile_id, on_event=on_event, limits=limits,
                progress=progress, attempt_id=attempt_id,
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
        except BaseException:
            fut.cancel()
            raise

    def close(self) -> None:
        """Close the clients and stop the loop thread (a second close does nothing)."""
        if self._closed:
            return
        self._closed = True
        asyncio.run_coroutine_threadsafe(self.adapter.aclose(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncAdapter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["SyncAdapter"]
