"""The envelope: the complete prepared request, as typed parts with data classes and provenance.

A part's hash covers its canonical encoding (role, content, data class, tool linkage), so a copy
with edited content, or with an extra "authorized" flag, hashes differently and does not inherit
the provenance of the part it was copied from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, field_validator

from ledger.domain.bounds import MAX_TOKENS
from ledger.domain.validation import Id, LedgerModel, Problem, Text
from ledger.domain.values import content_hash

# Data classes the ledger knows; a host may use any other string for classes it registers.
USER_INPUT = "user_input"
MODEL_DERIVED = "model_derived"
TOOL_DESCRIPTION = "tool_description"
TOOL_RESULT = "tool_result"
MEMORY = "memory"
PRIVATE_DOCUMENT = "private_document"
SYSTEM = "system"


def _json_data(value: Any) -> Any:
    """``value`` itself, when it is JSON data (finite numbers; a set, an object or NaN is not).

    Parameters are hashed into the Attempt's envelope hash and sent as JSON.
    """
    try:
        json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise Problem("is not JSON data", "pass only strings, finite numbers, booleans, None, "
                      "lists and mappings with string keys") from None
    return value


class Part(LedgerModel):
    """One part of a prepared request.

    ``data_class``, ``provenance`` and ``tool_call_id`` are identifiers (1 to 200 printable
    characters); ``name`` a short printable text; ``content`` any text.
    """

    role: Literal["system", "user", "assistant", "tool"] = "user"
    content: str
    data_class: Id = USER_INPUT
    # The Attempt id (model output) or tool-call id (tool result) that produced this content.
    provenance: Id | None = None
    tool_call_id: Id | None = None
    name: Text | None = None

    # A plain property, not cached: model_copy(update=...) would carry a cached hash over to an
    # edited copy, which would then pass for the original.
    @property
    def content_hash(self) -> str:
        """``sha256:<hex>`` of role, content, data class and tool linkage (not provenance).

        Provenance is what the hash is checked *against*: the ledger records, per producer,
        the hashes of what it produced, and a part is covered only if its hash is among them.
        """
        return content_hash(
            {
                "role": self.role,
                "content": self.content,
                "data_class": self.data_class,
                "tool_call_id": self.tool_call_id,
                "name": self.name,
            }
        )


class ToolSpec(LedgerModel):
    """A tool the model may call (its description is data too).

    ``name`` is an identifier; ``parameters`` (a JSON schema) must be JSON data.
    """

    name: Id
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)
    data_class: Id = TOOL_DESCRIPTION

    _parameters_are_json = field_validator("parameters")(_json_data)


class Envelope(LedgerModel):
    """The complete request. Its :attr:`hash` is what an Attempt records.

    ``params`` (temperature, top_p, ...) must be JSON data; ``max_output_tokens`` an integer
    from 1 to 10^15, or ``None``.
    """

    parts: list[Part]
    tools: list[ToolSpec] = Field(default_factory=list)
    params: dict[str, Any] = Field(default_factory=dict)  # temperature, top_p, ...
    stream: StrictBool = False
    max_output_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS)

    _params_are_json = field_validator("params")(_json_data)

    @property
    def prefill(self) -> bool:
        """True when the last part is an assistant part the model should continue."""
        return bool(self.parts) and self.parts[-1].role == "assistant"

    @property
    def data_classes(self) -> set[str]:
        """Every data class the request carries (its parts' and its tools')."""
        classes = {p.data_class for p in self.parts}
        classes.update(t.data_class for t in self.tools)
        return classes

    @property
    def hash(self) -> str:
        """``sha256:<hex>`` of the whole request (parts, tools, params, stream, max output)."""
        return self.hash_with([p.content_hash for p in self.parts])

    def hash_with(self, part_hashes: Sequence[str]) -> str:
        """:attr:`hash` from the parts' hashes computed already.

        The retry owner hashes the parts once per turn and checks coverage with the same hashes.
        """
        return content_hash(
            {
                "parts": list(part_hashes),
                "tools": [t.model_dump(mode="json") for t in self.tools],
                "params": self.params,
                "stream": self.stream,
                "max_output_tokens": self.max_output_tokens,
            }
        )


__all__ = [
    "MEMORY",
    "MODEL_DERIVED",
    "PRIVATE_DOCUMENT",
    "SYSTEM",
    "TOOL_DESCRIPTION",
    "TOOL_RESULT",
    "USER_INPUT",
    "Envelope",
    "Part",
    "ToolSpec",
]
