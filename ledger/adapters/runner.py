"""Driving a Run with the adapters: the send functions the retry owner calls.

:func:`async_sender` turns an :class:`HttpAdapter` into the send function of
:func:`ledger.api.turn.aexecute`, :func:`sync_sender` a :class:`SyncAdapter` into that of
:func:`ledger.api.turn.execute` (the Run sessions of :mod:`ledger.api.session` use them too).
Each request carries its Attempt's id (``Dispatch.attempt_id``, sent in the headers
``Dispatch.headers`` names and the retry owner recorded with the Attempt before the send). Each
answer becomes parts (:func:`output_parts`) whose hashes the ledger records as provenance, so
a later model-derived part is covered only if it matches, hash for hash. Streamed events go to
``on_event`` as they arrive; the retry owner separately tells the caller to discard text of a
failed attempt.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from ledger.adapters.base import HttpAdapter, Limits, OnEvent, failed_send, reported
from ledger.adapters.contract import (
    AdapterResult,
)
from ledger.adapters.sync import SyncAdapter
from ledger.decide.effects import Dispatch, SendResult
from ledger.domain.envelope import MODEL_DERIVED, Part
from ledger.domain.media import REASONING_MEDIA_TYPE
from ledger.domain.validation import checked, instance


def output_part(result: AdapterResult, attempt_id: str) -> Part:
    """The answer's text as an envelope part for the next turn, with its provenance."""
    return Part(role="assistant", content=result.text, data_class=MODEL_DERIVED,
                provenance=attempt_id)


def output_parts(result: AdapterResult, attempt_id: str) -> tuple[Part, ...]:
    """The whole answer as parts, each with the Attempt as its provenance.

    Its reasoning items (a Responses-API route's, Anthropic's thinking blocks, Gemini's thought
    signatures: carried back to that route only), its text
    (left out when the answer is only images or tool calls: an empty text block is what some
    providers refuse), its images and documents (assistant binary parts, in the order the
    provider sent them), then one part per tool call (``tool_call_id``, ``name``, the
    arguments as JSON text). The Run records every part's hash as the Attempt's provenance, so
    each may be carried into the next turn as it is, and an edited copy is not covered.
    """
    return _parts(result, attempt_id, output_part(result, attempt_id))


def _parts(result: AdapterResult, attempt_id: str, text: Part) -> tuple[Part, ...]:
    parts: list[Part] = [
        Part(role="assistant", data=data, media_type=REASONING_MEDIA_TYPE,
             data_class=MODEL_DERIVED, provenance=attempt_id)
        for data in result.reasoning]
    if result.text or not (result.tool_calls or result.media):
        parts.append(text)
    for m in result.media:
        where = {"data": m.data} if m.data is not None else {"url": m.url}
        parts.append(Part(role="assistant", media_type=m.media_type, data_class=MODEL_DERIVED,
                          provenance=attempt_id, **where))
    for call in result.tool_calls:
        parts.append(Part(role="assistant", content=call.arguments_json or "{}",
                          data_class=MODEL_DERIVED, provenance=attempt_id,
                          tool_call_id=call.id, name=call.name))
    return tuple(parts)


def to_send_result(result: AdapterResult, attempt_id: str) -> SendResult:
    """What the retry owner records for ``result`` (``sent`` is copied as reported).

    A tool call whose id the adapter made up in place of the provider's
    (:attr:`~ledger.adapters.contract.ToolCall.provider_id`) is named in ``renamed_calls``,
    which the settle records as ``tool_call_id`` events.

    A failure carries the usage it reported as an answer does: the provider may have billed it
    (a Responses ``incomplete`` answer, a stream its error event ended), and the Run is posted
    that cost rather than nothing or the whole hold. It carries the model the provider named
    too (``model_reported``), which the failed or unknown Attempt records
    (:func:`~ledger.adapters.base.failed_send`).
    """
    if not result.ok:
        return failed_send(result)
    # One text part serves both: building a Part hashes its content, and this is every call.
    text = output_part(result, attempt_id)
    return SendResult(
        ok=True,
        output=result,
        **reported(result),
        output_hash=text.content_hash,
        parts=_parts(result, attempt_id, text),
        renamed_calls=tuple((c.provider_id, c.id) for c in result.tool_calls
                            if c.provider_id is not None),
    )


@checked
def async_sender(
    adapter: Annotated[HttpAdapter, instance(HttpAdapter, "an HttpAdapter",
                                             "use sync_sender for a SyncAdapter")],
    *,
    on_event: OnEvent | None = None,
    limits: Limits | None = None,
) -> Callable[[Dispatch], Awaitable[SendResult]]:
    """The send function of :func:`ledger.api.turn.aexecute` over an :class:`HttpAdapter`.

    Args:
        adapter: The adapter every Attempt of the turn sends with.
        on_event: Receives the stream events of every Attempt (see :meth:`HttpAdapter.send`).
        limits: The time limits of each call (pass the Run's frozen ``policy.streaming``).

    Returns:
        ``send(dispatch)``, a coroutine function returning the
        :class:`~ledger.decide.effects.SendResult` the retry owner records.

    Raises:
        InvalidArgument: ``adapter`` is not an :class:`HttpAdapter` (a :class:`SyncAdapter`
            goes with :func:`sync_sender`), or ``on_event``/``limits`` are of the wrong type.

    Example:
        >>> send = async_sender(adapter, limits=policy.streaming)  # doctest: +SKIP
        >>> result = await aexecute(led, lease, envelope, send)  # doctest: +SKIP
    """
    async def send(d: Dispatch) -> SendResult:
        res = await adapter.send(d.route, d.envelope, profile_id=d.profile_id,
                                 on_event=on_event, limits=limits, progress=d.progress,
                                 attempt_id=d.attempt_id)
        return to_send_result(res, d.attempt_id)

    return send


@checked
def sync_sender(
    adapter: Annotated[SyncAdapter, instance(SyncAdapter, "a SyncAdapter",
                                             "use async_sender for an HttpAdapter")],
    *,
    on_event: OnEvent | None = None,
    limits: Limits | None = None,
) -> Callable[[Dispatch], SendResult]:
    """The send function of :func:`ledger.api.turn.execute` over a :class:`SyncAdapter`.

    The arguments are :func:`async_sender`'s; the function returned blocks.

    Args:
        adapter: The blocking adapter every Attempt of the turn sends with.
        on_event: Receives the stream events of every Attempt (on the calling thread).
        limits: The time limits of each call.

    Returns:
        ``send(dispatch)``, returning the :class:`~ledger.decide.effects.SendResult`.

    Raises:
        InvalidArgument: ``adapter`` is not a :class:`SyncAdapter`, or ``on_event``/``limits``
            are of the wrong type.
    """
    def send(d: Dispatch) -> SendResult:
        res = adapter.send(d.route, d.envelope, profile_id=d.profile_id, on_event=on_event,
                           limits=limits, progress=d.progress, attempt_id=d.attempt_id)
        return to_send_result(res, d.attempt_id)

    return send


__all__ = ["async_sender", "output_part", "output_parts", "sync_sender", "to_send_result"]
