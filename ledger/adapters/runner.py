"""Driving a Run with the adapters: the send functions the retry owner calls.

``sender(adapter)`` turns an :class:`HttpAdapter` (async) or :class:`SyncAdapter` into the send
function of :func:`ledger.run.aexecute` / :func:`ledger.run.execute`. A successful answer's text
is hashed so the ledger records it as provenance (a later model-derived part is covered only if
it matches, hash for hash). Streamed events go to ``on_event`` as they arrive; the retry owner
separately tells the caller to discard text of a failed attempt.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ledger.adapters.base import HttpAdapter
from ledger.adapters.contract import (
    AdapterResult,
    EventCallback,
)
from ledger.adapters.sync import SyncAdapter
from ledger.core.envelope import MODEL_DERIVED, Part
from ledger.core.facts import Observation
from ledger.policy.model import StreamingPolicy
from ledger.run import Dispatch, SendResult


def output_part(result: AdapterResult, attempt_id: str) -> Part:
    """The answer's text as an envelope part for the next turn, with its provenance."""
    return Part(role="assistant", content=result.text, data_class=MODEL_DERIVED,
                provenance=attempt_id)


def output_parts(result: AdapterResult, attempt_id: str) -> tuple[Part, ...]:
    """The whole answer as parts — its text, then one part per tool call (``tool_call_id``,
    ``name``, the arguments as JSON text) — each with the Attempt as its provenance."""
    parts: list[Part] = []
    if result.text or not result.tool_calls:
        parts.append(output_part(result, attempt_id))
    for call in result.tool_calls:
        parts.append(Part(role="assistant", content=call.arguments_json or "{}",
                          data_class=MODEL_DERIVED, provenance=attempt_id,
                          tool_call_id=call.id, name=call.name))
    return tuple(parts)


def to_send_result(result: AdapterResult, attempt_id: str) -> SendResult:
    """What the retry owner records for ``result`` (``sent`` is copied as reported)."""
    if not result.ok:
        obs = result.observation or Observation(message="adapter failure without observation")
        return SendResult(ok=False, observation=obs, sent=result.sent,
                          partial_text=result.partial_text)
    usage = result.usage
    return SendResult(
        ok=True,
        output=result,
        prompt_tokens=usage.prompt_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else None,
        cost=result.cost,
        model_reported=result.model_reported,
        output_hash=output_part(result, attempt_id).content_hash,
        parts=output_parts(result, attempt_id),
    )


def async_sender(
    adapter: HttpAdapter,
    *,
    on_event: EventCallback | None = None,
    limits: StreamingPolicy | None = None,
) -> Callable[[Dispatch], Awaitable[SendResult]]:
    async def send(d: Dispatch) -> SendResult:
        res = await adapter.send(d.route, d.envelope, profile_id=d.profile_id,
                                 on_event=on_event, limits=limits, progress=d.progress)
        return to_send_result(res, d.attempt_id)

    return send


def sync_sender(
    adapter: SyncAdapter,
    *,
    on_event: EventCallback | None = None,
    limits: StreamingPolicy | None = None,
) -> Callable[[Dispatch], SendResult]:
    def send(d: Dispatch) -> SendResult:
        res = adapter.send(d.route, d.envelope, profile_id=d.profile_id, on_event=on_event,
                           limits=limits, progress=d.progress)
        return to_send_result(res, d.attempt_id)

    return send


__all__ = ["async_sender", "output_part", "output_parts", "sync_sender", "to_send_result"]
