"""The local fake provider in a process of its own, so its CPU never counts as the client's.

:class:`ledger.testing.fakeprovider.FakeProvider` is started in a spawned child process on
loopback with sticky per-model behaviours (e.g. model ``bench-503`` always answers 503), and
:class:`FakeServer` hands the parent its endpoint. Client CPU measured in the parent
(``time.process_time``) then covers the ledger and the HTTP client only.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
from collections.abc import Mapping
from multiprocessing.connection import Connection

from benchmarks.common import BenchError

START_TIMEOUT_S = 60.0


def _serve(conn: Connection, defaults: dict[str, str]) -> None:
    from ledger.testing.fakeprovider import FakeProvider

    async def main() -> None:
        fake = FakeProvider()
        for model, fault in defaults.items():
            fake.set_default(fault, model=model)
        await fake.start()
        conn.send(fake.port)
        # Wait for the parent's stop (or its death: recv raises EOFError).
        loop = asyncio.get_running_loop()
        with contextlib.suppress(EOFError):
            await loop.run_in_executor(None, conn.recv)
        await fake.stop()

    asyncio.run(main())


class FakeServer:
    """A fake provider process: ``with FakeServer({"bench-503": "unavailable"}) as fake:``."""

    def __init__(self, model_defaults: Mapping[str, str] | None = None) -> None:
        self._defaults = dict(model_defaults or {})
        self._ctx = mp.get_context("spawn")
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def endpoint(self, protocol: str) -> str:
        """The ``Route.endpoint`` for ``protocol``, as ``FakeProvider.endpoint`` gives it."""
        return self.base_url + "/v1" if protocol == "openai" else self.base_url

    def __enter__(self) -> FakeServer:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child, self._defaults), daemon=True,
                                       name="ledger-bench-fake-provider")
        self._proc.start()
        child.close()
        self._conn = parent
        try:
            if not parent.poll(START_TIMEOUT_S):
                raise BenchError("the fake provider process did not start within "
                                 f"{START_TIMEOUT_S:.0f}s")
            self.port = int(parent.recv())
        except EOFError:
            self._stop()
            raise BenchError("the fake provider process exited before it listened") from None
        except BaseException:
            self._stop()
            raise
        return self

    def _stop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send("stop")
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join()
            self._proc = None

    def __exit__(self, *exc: object) -> None:
        self._stop()


__all__ = ["FakeServer"]
