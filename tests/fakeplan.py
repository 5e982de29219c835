"""What the session and integration tests share: one fake provider per module and a two-route
plan (primary and backup, in different capacity groups) on it."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest

from ledger import Grant, Price, Route
from ledger.domain.facts import WireProtocol
from ledger.testing import FakeProvider, Fault, ReceivedRequest

PRICE = Price(input_per_mtok=Decimal(1), output_per_mtok=Decimal(2))


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider().in_thread() as fp:
        yield fp


@pytest.fixture(autouse=True)
def _clear(fake: FakeProvider) -> None:
    fake.clear()


def plan(fake: FakeProvider, protocol: str = "openai") -> list[Route]:
    proto = WireProtocol(protocol)
    return [Route(id="primary", provider="fake", model="primary-model", group="ga",
                  recipient="fake", protocol=proto, endpoint=fake.endpoint(protocol),
                  price=PRICE),
            Route(id="backup", provider="fake-b", model="backup-model", group="gb",
                  recipient="fake", protocol=proto, endpoint=fake.endpoint(protocol),
                  price=PRICE)]


def tool_call_ids(request: ReceivedRequest) -> list[str]:
    """The tool-call ids a request carried, calls and results in order, whatever its protocol.

    Gemini's wire has no ids (a ``functionResponse`` is matched by name): its requests give none.
    """
    body = request.json
    ids: list[str] = []
    if request.protocol == "openai":
        for m in body["messages"]:
            ids += [c["id"] for c in m.get("tool_calls") or []]
            if m["role"] == "tool":
                ids.append(m["tool_call_id"])
    elif request.protocol == "openai_responses":
        ids += [i["call_id"] for i in body["input"]
                if i.get("type") in ("function_call", "function_call_output")]
    elif request.protocol == "anthropic":
        for m in body["messages"]:
            for b in m["content"] if isinstance(m["content"], list) else []:
                if b["type"] == "tool_use":
                    ids.append(b["id"])
                elif b["type"] == "tool_result":
                    ids.append(b["tool_use_id"])
    return ids


async def cancelled_twice(call: Callable[[], Awaitable[Any]], fake: FakeProvider) -> None:
    """Run ``call`` until its request has left, then cancel it, and again a loop step later
    (as the Agents SDK's and pydantic-ai's timeouts do while draining the call)."""
    fake.enqueue(Fault.NO_RESPONSE)
    task = asyncio.ensure_future(call())
    assert await asyncio.to_thread(fake.wait_for_requests, 1)
    await cancelled_often(task, 2, gap_s=0)


async def cancelled_often(task: asyncio.Future[Any], times: int, *, gap_s: float) -> None:
    """Cancel ``task`` ``times`` times, ``gap_s`` apart (0: a loop step); it ends cancelled."""
    for _ in range(times):
        task.cancel()
        await asyncio.sleep(gap_s)
    with pytest.raises(asyncio.CancelledError):
        await task


def narrow_first(routes: list[Route]) -> tuple[list[Route], Grant]:
    """``routes`` whose first recipient the grant approves for the user's input, not for tool
    results (``narrow``; the others, ``fake``, for every class), and that grant."""
    everything = ["user_input", "model_derived", "tool_result", "tool_description", "system"]
    first, *rest = routes
    return ([first.model_copy(update={"recipient": "narrow"}), *rest],
            Grant(recipients={"narrow": [c for c in everything if c != "tool_result"],
                              "fake": everything}))


def carried_tool_file(request: ReceivedRequest, data: bytes, result: str) -> None:
    """Assert that ``request`` carried ``data`` as its one image, in a user part after the
    tool result that says ``result`` (each wire takes a turn's tool results first)."""
    assert request.problem is None
    assert [(m.media_type, m.data, m.role) for m in request.media] == [
        ("image/png", data, "user")]
    body = request.body.decode()
    assert body.index(result) < body.index(base64.b64encode(data).decode())
