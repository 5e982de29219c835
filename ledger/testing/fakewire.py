"""What the fake provider checks in a request, and the images and documents it received.

A real provider refuses a request whose image is not base64, whose document has no file name,
or whose reasoning item another account wrote; so does the fake, with a 400 in the protocol's
own error shape, so a codec that sends something a provider would refuse fails its tests.
Reasoning it checks as each provider does: a Responses-API reasoning item, an Anthropic
``thinking`` block (its ``signature``) or ``redacted_thinking`` block, a Gemini
``thoughtSignature`` must be one the fake wrote for the requested model (and, for a thinking
block, its text unchanged; for a signature, on the part it was written for); with Anthropic's
``thinking`` enabled, the last assistant message that holds ``tool_use`` must start with its
thinking block; for a Gemini thinking model (a request with ``generationConfig.thinkingConfig``,
or a ``gemini-3`` model), each ``model`` turn of the current turn that calls functions must
carry the signature on its first ``functionCall`` part. Tool results as chat completions and
Anthropic check them: an assistant message's ``tool_calls`` answered by a ``tool`` message each,
with nothing between (a user message with a tool's file included); a ``tool_use`` answered by
a ``tool_result`` in the next message, whose ``tool_result`` blocks come before any other.
A Responses ``function_call`` with no ``function_call_output`` after it, the conversation going
on, is refused ("No tool output found for function call ..."; the output may come anywhere
after its call, which the API finds by ``call_id``), and so is a Gemini turn that calls
functions followed by one without a ``functionResponse`` for each. A result that answers no
call before it is refused as each API does: a chat completions ``tool`` message whose
``tool_call_id`` is none of the assistant message's before it, an Anthropic ``tool_result``
whose ``tool_use_id`` is no ``tool_use`` of the message before, a Responses
``function_call_output`` whose ``call_id`` no ``function_call`` before it has, a Gemini turn
with a ``functionResponse`` that does not follow a turn that calls functions. A second result
of one call is refused as each does: "Duplicate value for 'tool_call_id'" (two tool messages of
one id after an assistant message), "each tool_use must have a single result", "Duplicate
function_call_output for call_id" (an id a later ``function_call`` reuses too: the Responses
API counts a call_id's outputs in the whole input), and on Gemini by the count of the responses.
Two ``tool_use`` blocks of one id anywhere in an Anthropic request are refused ("`tool_use` ids
must be unique").
Anthropic's empty text blocks are refused ("text content blocks must be non-empty"); the files
in a ``tool_result``'s content and in a Responses ``function_call_output``'s ``output`` list
are checked and received as any other.
Standard library only, like the fake.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, replace
from typing import Any

_IMAGES = ("image/png", "image/jpeg", "image/gif", "image/webp")
# Gemini reads no GIF (its image docs list PNG, JPEG, WEBP, HEIC and HEIF).
_GEMINI_IMAGES = tuple(t for t in _IMAGES if t != "image/gif")
_DOCUMENTS = ("application/pdf", "text/plain")
_SIGNATURES = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff",
               "image/gif": b"GIF8", "application/pdf": b"%PDF-"}


@dataclass(frozen=True)
class ReceivedMedia:
    """One image or document a request carried, as the provider would read it.

    ``data`` holds the decoded bytes (a plain-text document's UTF-8 text too), ``url`` the
    link the provider would fetch; ``filename`` the name sent with a file, if any; ``role``
    the role of the message (or Gemini turn: ``user``, ``model``) that carried it, ``tool``
    for one in a Responses ``function_call_output``.
    """

    media_type: str
    data: bytes | None = None
    url: str | None = None
    filename: str | None = None
    role: str | None = None


class BadRequest(ValueError):
    """A request a real provider would refuse with a 400; the message says why."""


def reasoning_secret(model: str | None, text: str) -> str:
    """The fake's "encrypted" reasoning: readable back only by the same model."""
    return f"enc:{model}:" + base64.b64encode(text.encode()).decode()


def thought_signature(model: str | None, part: str, text: str) -> str:
    """The fake's Gemini thought signature for the answer's ``part``.

    ``part`` is a function's name or ``text``: the signature is readable back only by the
    same model, on a part of that name.
    """
    return reasoning_secret(model, f"{part}|{text}")


def _signed_for(signature: Any, model: str | None) -> str | None:
    """What the fake signed in ``signature`` for ``model``, or ``None``: not its own."""
    prefix = f"enc:{model}:"
    if not isinstance(signature, str) or not signature.startswith(prefix):
        return None
    try:
        return base64.b64decode(signature[len(prefix):], validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None


def _b64(value: Any, where: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{where} must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where} is not valid base64") from None


def _fits(media_type: str, data: bytes, where: str) -> None:
    sig = _SIGNATURES.get(media_type)
    if sig is not None and not data.startswith(sig) and not (
            media_type == "application/pdf" and sig in data[:1024]):
        raise BadRequest(f"{where}: the data is not {media_type}")
    if media_type == "image/webp" and not (data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
        raise BadRequest(f"{where}: the data is not image/webp")
    if media_type.startswith("text/"):
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"{where}: the text is not UTF-8") from None


def _data_url(value: Any, where: str, kinds: tuple[str, ...]) -> ReceivedMedia:
    """A ``data:`` URL (decoded) or an ``https://`` link."""
    if not isinstance(value, str):
        raise BadRequest(f"{where} must be a string URL")
    if value.startswith("https://"):
        return ReceivedMedia(media_type="", url=value)
    if not value.startswith("data:") or ";base64," not in value:
        raise BadRequest(f"{where} must be an https:// URL or data:<type>;base64,<data>")
    head, _, payload = value.partition(";base64,")
    media_type = head[5:]
    if media_type not in kinds:
        raise BadRequest(f"{where}: unsupported media type {media_type!r}")
    data = _b64(payload, where)
    _fits(media_type, data, where)
    return ReceivedMedia(media_type=media_type, data=data)


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a list")
    return value


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{where} must be an object")
    return value


def check(protocol: str | None, body: bytes, model: str | None) -> list[ReceivedMedia]:
    """The media of a request body, once it passes the protocol's checks.

    Raises:
        BadRequest: something a real provider would refuse.
    """
    try:
        obj = json.loads(body) if body else None
    except ValueError:
        raise BadRequest("the body is not JSON") from None
    if not isinstance(obj, dict):
        raise BadRequest("the body is not a JSON object")
    if protocol == "openai":
        return _openai(obj)
    if protocol == "openai_responses":
        return _responses(obj, model)
    if protocol == "anthropic":
        return _anthropic(obj, model)
    if protocol == "gemini":
        return _gemini(obj, model)
    return []


def _openai_tool_answers(messages: list[Any]) -> None:
    """Each assistant message's ``tool_calls`` answered by the ``tool`` messages right after it.

    As chat completions checks it: nothing else may come between (a user message with a
    tool's file included), and a ``tool`` message answers one of the calls before it.
    """
    pending: list[str] = []
    asked: set[str] = set()
    answered: dict[str, int] = {}  # the tool messages of the assistant message before: id -> i
    answering = False
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role == "tool":
            if not answering:
                raise BadRequest(f"Invalid parameter: messages with role 'tool' must be a "
                                 f"response to a preceeding message with 'tool_calls' "
                                 f"(messages[{i}]).")
            call_id = msg.get("tool_call_id")
            if call_id not in asked:
                raise BadRequest(f"Invalid parameter: 'tool_call_id' of {call_id!r} not found "
                                 f"in 'tool_calls' of previous message (messages[{i}]).")
            if call_id in answered:
                # Two tool messages of one id, whether the calls repeat the id or not.
                raise BadRequest(f"Invalid parameter: Duplicate value for 'tool_call_id' of "
                                 f"{call_id!r} in messages[{answered[call_id]}] and "
                                 f"messages[{i}].")
            answered[str(call_id)] = i
            pending.remove(call_id)
            continue
        if pending:
            raise BadRequest("An assistant message with 'tool_calls' must be followed by tool "
                             "messages responding to each 'tool_call_id'. The following "
                             f"tool_call_ids did not have response messages: "
                             f"{', '.join(pending)} (messages[{i}] comes first)")
        calls = msg.get("tool_calls") if role == "assistant" else None
        answering = bool(calls)
        pending = [str(c.get("id")) for c in calls or [] if isinstance(c, dict)]
        asked = set(pending)
        answered = {}
    if pending:
        raise BadRequest("An assistant message with 'tool_calls' must be followed by tool "
                         "messages responding to each 'tool_call_id'. The following "
                         f"tool_call_ids did not have response messages: {', '.join(pending)}")


def _openai(obj: dict[str, Any]) -> list[ReceivedMedia]:
    media: list[ReceivedMedia] = []
    messages = _list(obj.get("messages"), "messages")
    for i, raw in enumerate(messages):
        _obj(raw, f"messages[{i}]")
    _openai_tool_answers(messages)
    for i, raw in enumerate(messages):
        msg = _obj(raw, f"messages[{i}]")
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        role = msg.get("role")
        for j, rc in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            item = _obj(rc, where)
            kind = item.get("type")
            if kind in ("image_url", "file") and role != "user":
                raise BadRequest(f"Invalid 'messages[{i}]'. Image URLs and files are only "
                                 f"allowed for messages with role 'user', but this message "
                                 f"with role {role!r} contains one.")
            if kind == "text":
                if not isinstance(item.get("text"), str):
                    raise BadRequest(f"{where}.text must be a string")
            elif kind == "image_url":
                url = _obj(item.get("image_url"), f"{where}.image_url").get("url")
                media.append(replace(_data_url(url, f"{where}.image_url.url", _IMAGES),
                                     role=role))
            elif kind == "file":
                file = _obj(item.get("file"), f"{where}.file")
                if not isinstance(file.get("filename"), str) or not file["filename"]:
                    raise BadRequest(f"{where}.file.filename is required with file_data")
                got = _data_url(file.get("file_data"), f"{where}.file.file_data",
                                ("application/pdf",))
                if got.url is not None:
                    raise BadRequest(f"{where}.file.file_data must be a data: URL (chat "
                                     "completions fetches no file)")
                media.append(ReceivedMedia(got.media_type, got.data, None, file["filename"],
                                           role))
            else:
                raise BadRequest(f"{where}: unknown content type {kind!r}")
    return media


def _responses(obj: dict[str, Any], model: str | None) -> list[ReceivedMedia]:
    if obj.get("previous_response_id") is not None:
        raise BadRequest("previous_response_id: no response is stored here (store=false)")
    media: list[ReceivedMedia] = []
    pending: list[str] = []  # function calls no output after them answers
    called: set[str] = set()  # the call_id of each function_call so far
    answered: set[str] = set()  # the call_id of each call an output answers already
    items = _list(obj.get("input"), "input")
    # The API pairs an output with its call by call_id, wherever it stands after the call.
    output_at = {raw.get("call_id"): i for i, raw in enumerate(items)
                 if isinstance(raw, dict) and raw.get("type") == "function_call_output"}
    for i, raw in enumerate(items):
        where = f"input[{i}]"
        item = _obj(raw, where)
        kind = item.get("type", "message")
        if pending and kind not in ("function_call", "function_call_output", "reasoning"):
            # The conversation goes on while a call has no output.
            raise BadRequest(f"No tool output found for function call {pending[0]}.")
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{where}.role is not a message role")
            content = item.get("content")
            if isinstance(content, str):
                continue
            for j, rc in enumerate(_list(content, f"{where}.content")):
                media.extend(replace(m, role=item["role"]) for m in _responses_content(
                    _obj(rc, f"{where}.content[{j}]"), f"{where}.content[{j}]", item["role"]))
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise BadRequest(f"{where}.{key} is required")
            # A call_id used again is no new call: its second output is a duplicate.
            called.add(item["call_id"])
            if output_at.get(item["call_id"], -1) < i:
                pending.append(item["call_id"])
            try:
                json.loads(item["arguments"])
            except ValueError:
                raise BadRequest(f"{where}.arguments is not JSON") from None
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str | list):
                raise BadRequest(f"{where} needs call_id and output")
            if item["call_id"] not in called:
                raise BadRequest(f"No tool call found for function call output with call_id "
                                 f"{item['call_id']}.")
            if item["call_id"] in answered:
                raise BadRequest(f"Duplicate function_call_output for call_id "
                                 f"{item['call_id']!r}. Each function_call must have exactly "
                                 "one matching function_call_output")
            answered.add(item["call_id"])
            # An output may be input_text, input_image and input_file items.
            for j, rc in enumerate(output if isinstance(output, list) else []):
                media.extend(replace(m, role="tool") for m in _responses_content(
                    _obj(rc, f"{where}.output[{j}]"), f"{where}.output[{j}]", "tool"))
        elif kind == "reasoning":
            secret = item.get("encrypted_content")
            if not isinstance(secret, str) or not secret.startswith(f"enc:{model}:"):
                raise BadRequest(f"{where}: the encrypted content could not be decrypted or "
                                 "verified (it belongs to another model or organization)")
        else:
            raise BadRequest(f"{where}: unknown item type {kind!r}")
    return media


def _responses_content(item: dict[str, Any], where: str, role: str) -> list[ReceivedMedia]:
    kind = item.get("type")
    if role == "assistant" and kind not in ("output_text", "refusal"):
        raise BadRequest(f"{where}: an assistant message holds output_text, not {kind!r}")
    if kind in ("input_text", "output_text"):
        if not isinstance(item.get("text"), str):
            raise BadRequest(f"{where}.text must be a string")
        return []
    if kind == "input_image":
        return [_data_url(item.get("image_url"), f"{where}.image_url", _IMAGES)]
    if kind == "input_file":
        sources = [k for k in ("file_data", "file_url", "file_id") if item.get(k) is not None]
        if len(sources) != 1:
            raise BadRequest(f"{where}: give exactly one of file_data, file_url, file_id")
        if "file_url" in sources:
            url = item["file_url"]
            if not isinstance(url, str) or not url.startswith("https://"):
                raise BadRequest(f"{where}.file_url must be an https:// URL")
            return [ReceivedMedia(media_type="", url=url)]
        if "file_data" in sources:
            if not isinstance(item.get("filename"), str) or not item["filename"]:
                raise BadRequest(f"{where}.filename is required with file_data")
            got = _data_url(item["file_data"], f"{where}.file_data", _DOCUMENTS)
            return [ReceivedMedia(got.media_type, got.data, None, item["filename"])]
        return []
    raise BadRequest(f"{where}: unknown content type {kind!r}")


def _anthropic_thinking(block: dict[str, Any], where: str, role: Any,
                        model: str | None) -> None:
    """A ``thinking`` / ``redacted_thinking`` block must be one the fake wrote, unchanged."""
    kind = block.get("type")
    if role != "assistant":
        raise BadRequest(f"{where}: {kind} blocks belong in assistant messages")
    if kind == "thinking":
        text = block.get("thinking")
        if not isinstance(text, str) or block.get("signature") != reasoning_secret(model, text):
            raise BadRequest(f"{where}: Invalid `signature` in `thinking` block")
    elif _signed_for(block.get("data"), model) is None:
        raise BadRequest(f"{where}: Invalid `data` in `redacted_thinking` block")


def _anthropic_tool_turn(messages: list[Any], obj: dict[str, Any]) -> None:
    """With thinking enabled, the last assistant message that uses tools opens with thinking."""
    thinking = obj.get("thinking")
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return
    for i in range(len(messages) - 1, -1, -1):
        msg = messages[i]
        if not isinstance(msg, dict) or msg.get("role") != "assistant":
            continue
        content = msg.get("content")
        if not isinstance(content, list) or not any(
                isinstance(b, dict) and b.get("type") == "tool_use" for b in content):
            return
        first = content[0].get("type") if isinstance(content[0], dict) else None
        if first not in ("thinking", "redacted_thinking"):
            raise BadRequest(
                f"messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, but "
                f"found `{first}`. When `thinking` is enabled, a final `assistant` message must "
                "start with a thinking block (preceeding the lastmost set of `tool_use` and "
                "`tool_result` blocks). We recommend you include thinking blocks from previous "
                "turns. To avoid this requirement, disable `thinking`.")
        return


def _anthropic_tool_results(messages: list[Any]) -> None:
    """Each ``tool_use`` answered by the next message, whose ``tool_result`` blocks open it.

    As the Messages API checks it: a ``tool_result`` block after any other block of its
    message is refused (a tool's file included), and so is one that answers no ``tool_use``
    of the message before.
    """
    used: set[Any] = set()  # every tool_use id so far, in any message
    for i, msg in enumerate(messages):
        content = msg.get("content")
        blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
        for j, block in enumerate(blocks):
            if block.get("type") == "tool_use":
                if block.get("id") in used:
                    raise BadRequest(f"messages.{i}.content.{j}: `tool_use` ids must be unique")
                used.add(block.get("id"))
        before = messages[i - 1].get("content") if i > 0 else None
        asked = {b.get("id") for b in before if isinstance(b, dict)
                 and b.get("type") == "tool_use"} if (
            isinstance(before, list) and messages[i - 1].get("role") == "assistant") else set()
        answered = set()
        others = False
        for j, block in enumerate(blocks):
            if block.get("type") != "tool_result":
                others = True
                continue
            if others:
                raise BadRequest(f"messages.{i}.content.{j}: tool_result blocks must come "
                                 "first in the user message, before any other block")
            if block.get("tool_use_id") not in asked:
                raise BadRequest(f"messages.{i}.content.{j}: unexpected `tool_use_id` found in "
                                 "`tool_result` blocks: each `tool_result` block must have a "
                                 "corresponding `tool_use` block in the previous message.")
            if block["tool_use_id"] in answered:
                raise BadRequest(f"messages.{i}.content.{j}: each tool_use must have a single "
                                 "result. Found multiple `tool_result` blocks with id: "
                                 f"{block['tool_use_id']}")
            answered.add(block["tool_use_id"])
        if asked and answered != asked:
            missing = ", ".join(sorted(str(x) for x in asked - answered))
            raise BadRequest(f"messages.{i}: `tool_use` ids were found without `tool_result` "
                             f"blocks immediately after: {missing}. Each `tool_use` block must "
                             "have a corresponding `tool_result` block in the next message.")


def _anthropic(obj: dict[str, Any], model: str | None) -> list[ReceivedMedia]:
    media: list[ReceivedMedia] = []
    messages = _list(obj.get("messages"), "messages")
    for i, raw in enumerate(messages):
        _obj(raw, f"messages[{i}]")
    _anthropic_tool_results(messages)
    for i, raw in enumerate(messages):
        msg = _obj(raw, f"messages[{i}]")
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for j, rb in enumerate(content):
            where = f"messages.{i}.content.{j}"
            block = _obj(rb, where)
            kind = block.get("type")
            if kind in ("thinking", "redacted_thinking"):
                _anthropic_thinking(block, where, msg.get("role"), model)
                continue
            if kind == "tool_result" and isinstance(block.get("content"), list):
                # A tool's result may be text, image and document blocks.
                for k, rn in enumerate(block["content"]):
                    inner = f"{where}.content.{k}"
                    nested = _obj(rn, inner)
                    if nested.get("type") not in ("text", "image", "document"):
                        raise BadRequest(f"{inner}.type: {nested.get('type')!r} is not valid in "
                                         "a tool_result (text, image or document)")
                    media.extend(_anthropic_block(nested, inner, msg.get("role")))
                continue
            media.extend(_anthropic_block(block, where, msg.get("role")))
    _anthropic_tool_turn(messages, obj)
    return media


def _anthropic_block(block: dict[str, Any], where: str, role: Any) -> list[ReceivedMedia]:
    """The media of a text, image or document block, checked as the Messages API does."""
    kind = block.get("type")
    if kind == "text" and block.get("text") == "":
        raise BadRequest(f"{where}: text content blocks must be non-empty")
    if kind not in ("image", "document"):
        return []
    if role != "user":
        raise BadRequest(f"{where}: {kind} blocks belong in user messages")
    source = _obj(block.get("source"), f"{where}.source")
    stype = source.get("type")
    allowed = _IMAGES if kind == "image" else ("application/pdf",)
    if stype == "base64":
        mt = source.get("media_type")
        if not isinstance(mt, str) or mt not in allowed:
            raise BadRequest(f"{where}.source.media_type: {mt!r} is not one of "
                             f"{', '.join(allowed)}")
        data = _b64(source.get("data"), f"{where}.source.data")
        _fits(mt, data, where)
        return [ReceivedMedia(mt, data, None, block.get("title"), "user")]
    if stype == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url.startswith("https://"):
            raise BadRequest(f"{where}.source.url must be an https:// URL")
        return [ReceivedMedia("", None, url, block.get("title"), "user")]
    if stype == "text" and kind == "document":
        text = source.get("data")
        if source.get("media_type") != "text/plain" or not isinstance(text, str):
            raise BadRequest(f"{where}.source: a text source is text/plain data")
        return [ReceivedMedia("text/plain", text.encode(), None, block.get("title"), "user")]
    raise BadRequest(f"{where}.source.type: {stype!r} is not valid here")


def _gemini_signature(part: dict[str, Any], where: str, role: str,
                      model: str | None) -> None:
    """A ``thoughtSignature`` must be one the fake wrote for this model and this part."""
    signature = part.get("thoughtSignature", part.get("thought_signature"))
    if signature is None:
        return
    call = part.get("functionCall", part.get("function_call"))
    name = call.get("name") if isinstance(call, dict) else "text" if "text" in part else None
    signed = _signed_for(signature, model)
    if role != "model" or name is None or signed is None or not signed.startswith(
            f"{name}|"):
        raise BadRequest(f"{where}: Unable to verify thought signature (it was not written "
                         "for this model and this part)")


def _gemini_thinking(obj: dict[str, Any], model: str | None) -> bool:
    config = obj.get("generationConfig")
    return (isinstance(config, dict) and config.get("thinkingConfig") is not None) or (
        (model or "").removeprefix("models/").startswith("gemini-3"))


def _gemini_current_turn(contents: list[Any]) -> None:
    """Each model turn since the last user text calls functions with its signature first."""
    start = 0
    for i, content in enumerate(contents):
        parts = content.get("parts") if isinstance(content, dict) else None
        if isinstance(content, dict) and content.get("role", "user") == "user" and isinstance(
                parts, list) and any(isinstance(p, dict) and "functionResponse" not in p
                                     and "function_response" not in p for p in parts):
            start = i
    for i in range(start, len(contents)):
        content = contents[i]
        if content.get("role") != "model":
            continue
        for j, part in enumerate(content.get("parts") or []):
            call = part.get("functionCall", part.get("function_call"))
            if not isinstance(call, dict):
                continue
            if "thoughtSignature" not in part and "thought_signature" not in part:
                raise BadRequest(
                    "Function call is missing a thought_signature in functionCall parts. This "
                    "is required for tools to work correctly. Additional data, function call "
                    f"`default_api:{call.get('name')}` , position {j + 1} of contents[{i}]. "
                    "Please refer to https://ai.google.dev/gemini-api/docs/thought-signatures")
            break  # only the first call of a step carries it


def _gemini_count(content: Any, *keys: str) -> int:
    """How many parts of ``content`` hold one of ``keys`` (either spelling of a field)."""
    parts = content.get("parts") if isinstance(content, dict) else None
    return sum(1 for p in parts or [] if isinstance(p, dict) and any(k in p for k in keys))


def _gemini_responses(contents: list[Any]) -> None:
    """A turn that calls functions is followed, if at all, by a response to each call.

    And a turn that responds follows a turn that calls.
    """
    for i, content in enumerate(contents):
        if _gemini_count(content, "functionResponse", "function_response") and (
                i == 0 or not _gemini_count(contents[i - 1], "functionCall", "function_call")):
            raise BadRequest("Please ensure that function response turn comes immediately after "
                             "a function call turn.")
    for i in range(len(contents) - 1):
        calls = _gemini_count(contents[i], "functionCall", "function_call")
        if calls and _gemini_count(contents[i + 1], "functionResponse",
                                   "function_response") != calls:
            raise BadRequest("Please ensure that the number of function response parts is "
                             "equal to the number of function call parts of the function call "
                             "turn.")


def _gemini(obj: dict[str, Any], model: str | None) -> list[ReceivedMedia]:
    media: list[ReceivedMedia] = []
    contents = _list(obj.get("contents"), "contents")
    for i, raw in enumerate(contents):
        content = _obj(raw, f"contents[{i}]")
        role = content.get("role", "user")
        if role not in ("user", "model"):
            raise BadRequest(f"contents[{i}].role: please use a valid role: user, model")
        for j, rp in enumerate(_list(content.get("parts"), f"contents[{i}].parts")):
            where = f"contents[{i}].parts[{j}]"
            part = _obj(rp, where)
            _gemini_signature(part, where, role, model)
            inline = part.get("inline_data", part.get("inlineData"))
            if inline is not None:
                inline = _obj(inline, f"{where}.inline_data")
                mt = inline.get("mime_type", inline.get("mimeType"))
                if mt not in _GEMINI_IMAGES + _DOCUMENTS:
                    raise BadRequest(f"{where}.inline_data.mime_type: unsupported {mt!r}")
                data = _b64(inline.get("data"), f"{where}.inline_data.data")
                _fits(mt, data, where)
                media.append(ReceivedMedia(mt, data, role=role))
            file_data = part.get("file_data", part.get("fileData"))
            if file_data is not None:
                file_data = _obj(file_data, f"{where}.file_data")
                uri = file_data.get("file_uri", file_data.get("fileUri"))
                mt = file_data.get("mime_type", file_data.get("mimeType"))
                if not isinstance(uri, str) or not uri.startswith("https://"):
                    raise BadRequest(f"{where}.file_data.file_uri must be an https:// URI")
                if mt not in _GEMINI_IMAGES + _DOCUMENTS:
                    raise BadRequest(f"{where}.file_data.mime_type: unsupported {mt!r}")
                media.append(ReceivedMedia(mt, None, uri, role=role))
    _gemini_responses(contents)
    if _gemini_thinking(obj, model):
        _gemini_current_turn(contents)
    return media


__all__ = ["BadRequest", "ReceivedMedia", "check", "reasoning_secret", "thought_signature"]
