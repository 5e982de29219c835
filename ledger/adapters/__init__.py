"""Provider adapters on httpx that turn every outcome into an observation.

One engine (:class:`HttpAdapter`, and its blocking facade :class:`SyncAdapter`) sends on any route
whose protocol has a registered codec; the four shipped codecs register themselves on import.
``register_secret`` and ``install_log_redaction`` are :mod:`ledger.redaction`'s, and
``attempt_headers`` (with ``ATTEMPT_HEADER``) :mod:`ledger.decide.effects`', for hosts that send
requests themselves.
See ``docs/adapters.md``.
"""

from ledger.adapters import anthropic as anthropic
from ledger.adapters import gemini as gemini
from ledger.adapters import openai as openai
from ledger.adapters import openai_responses as openai_responses
from ledger.adapters.base import HttpAdapter
from ledger.adapters.contract import (
    AdapterResult,
    Codec,
    EventCallback,
    OutputMedia,
    Reset,
    StreamEvent,
    TextDelta,
    ToolCall,
    ToolCallProposal,
    Usage,
    codec_for,
    register_codec,
)
from ledger.adapters.runner import (
    async_sender,
    output_part,
    output_parts,
    sync_sender,
    to_send_result,
)
from ledger.adapters.secrets import (
    EnvSecretProvider,
    SecretProvider,
    StaticSecretProvider,
    env_var_name,
    redact,
)
from ledger.adapters.sync import SyncAdapter
from ledger.adapters.transport import (
    ClientRegistry,
    map_transport_error,
)
from ledger.decide.effects import ATTEMPT_HEADER, attempt_headers
from ledger.redaction import install_log_redaction, register_secret

__all__ = [
    "ATTEMPT_HEADER",
    "AdapterResult",
    "ClientRegistry",
    "Codec",
    "EnvSecretProvider",
    "EventCallback",
    "HttpAdapter",
    "OutputMedia",
    "Reset",
    "SecretProvider",
    "StaticSecretProvider",
    "StreamEvent",
    "SyncAdapter",
    "TextDelta",
    "ToolCall",
    "ToolCallProposal",
    "Usage",
    "anthropic",
    "async_sender",
    "attempt_headers",
    "codec_for",
    "env_var_name",
    "gemini",
    "install_log_redaction",
    "map_transport_error",
    "openai_responses",
    "output_part",
    "output_parts",
    "redact",
    "register_codec",
    "register_secret",
    "sync_sender",
    "to_send_result",
]
