"""``AsyncLedger.open(url)`` is a real coroutine as well as an ``async with`` context: asyncio's
own runners take it, and a block that never awaits it leaves no "never awaited" coroutine."""

from __future__ import annotations

import asyncio
import gc
import warnings

from ledger import AsyncLedger


def test_asyncio_run_and_create_task_take_the_opening_of_an_async_ledger(db_url: str) -> None:
    led = asyncio.run(AsyncLedger.open(db_url))
    assert isinstance(led, AsyncLedger)
    asyncio.run(led.close())

    async def in_a_task() -> AsyncLedger:
        return await asyncio.create_task(AsyncLedger.open(db_url))

    other = asyncio.run(in_a_task())
    assert isinstance(other, AsyncLedger)
    asyncio.run(other.close())


def test_an_opening_used_only_as_a_block_leaves_no_coroutine_unawaited(db_url: str) -> None:
    async def main() -> None:
        async with AsyncLedger.open(db_url) as led:
            assert isinstance(led, AsyncLedger)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(main())
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
