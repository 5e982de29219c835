"""ledger: a durable run/attempt ledger that makes LLM model failover safe.

Public API re-exported here; see ``docs/`` for the guide. The package root is lazy (PEP 562):
``import ledger`` loads nothing heavy (no SQLAlchemy, httpx or pydantic models), and each name
is imported from its module on first use, so the command line starts fast and a host pays only
for what it touches. ``from ledger import X`` works for every name in ``__all__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ledger.api.facade import (
        AsyncLedger,
        Ledger,
    )
    from ledger.api.session import AsyncRunSession, RunSession
    from ledger.api.turn import (
        Dispatch,
        Notice,
        RunResult,
        SendResult,
        aexecute,
        execute,
    )
    from ledger.clock import (
        Clock,
        ManualClock,
        Sleeper,
        SystemClock,
        SystemSleeper,
        WakeableSleeper,
    )
    from ledger.decide.classify import classify
    from ledger.domain.envelope import (
        Envelope,
        Part,
        ToolSpec,
    )
    from ledger.domain.facts import (
        Category,
        CooldownEffect,
        FailureFact,
        Observation,
        Phase,
        Scope,
        Source,
        Transport,
        WireProtocol,
    )
    from ledger.domain.records import (
        AttemptKind,
        AttemptRecord,
        AttemptState,
        DebitState,
        FrozenRun,
        Lease,
        Outcome,
        Page,
        RunRecord,
        RunState,
        RunStatus,
    )
    from ledger.domain.values import (
        Budget,
        Capabilities,
        Grant,
        GroupMode,
        GroupProjection,
        Health,
        Price,
        Profile,
        ProfileType,
        Route,
    )
    from ledger.errors import (
        AdmissionConflict,
        AllowanceExhausted,
        ArgumentMismatch,
        BudgetExceeded,
        CandidateSkipped,
        CapacityUnavailable,
        ConfigError,
        Conflict,
        DatabaseSetupError,
        DatabaseUnavailable,
        FailoverExhausted,
        FencedOut,
        InvalidArgument,
        InvalidState,
        LeaseHeld,
        LeaseLost,
        LedgerError,
        NotFound,
        PartialOutput,
        PolicyError,
        PreflightRefused,
        ProviderError,
        Refused,
        SchemaTooNew,
        SettleConflict,
        StorageError,
    )
    from ledger.policy.load import (
        load_policy,
        policy_hash,
        preset,
    )
    from ledger.policy.model import Policy

# Public name -> the module that defines it.
_LAZY: dict[str, str] = {
    "AdmissionConflict": "ledger.errors",
    "AllowanceExhausted": "ledger.errors",
    "ArgumentMismatch": "ledger.errors",
    "AsyncLedger": "ledger.api.facade",
    "AttemptKind": "ledger.domain.records",
    "AttemptRecord": "ledger.domain.records",
    "AttemptState": "ledger.domain.records",
    "Budget": "ledger.domain.values",
    "BudgetExceeded": "ledger.errors",
    "Capabilities": "ledger.domain.values",
    "CandidateSkipped": "ledger.errors",
    "CapacityUnavailable": "ledger.errors",
    "Category": "ledger.domain.facts",
    "Clock": "ledger.clock",
    "ConfigError": "ledger.errors",
    "Conflict": "ledger.errors",
    "CooldownEffect": "ledger.domain.facts",
    "DatabaseSetupError": "ledger.errors",
    "DatabaseUnavailable": "ledger.errors",
    "DebitState": "ledger.domain.records",
    "Dispatch": "ledger.api.turn",
    "Envelope": "ledger.domain.envelope",
    "FailoverExhausted": "ledger.errors",
    "FailureFact": "ledger.domain.facts",
    "FencedOut": "ledger.errors",
    "Grant": "ledger.domain.values",
    "GroupMode": "ledger.domain.values",
    "GroupProjection": "ledger.domain.values",
    "Health": "ledger.domain.values",
    "InvalidArgument": "ledger.errors",
    "InvalidState": "ledger.errors",
    "Lease": "ledger.domain.records",
    "LeaseHeld": "ledger.errors",
    "LeaseLost": "ledger.errors",
    "Ledger": "ledger.api.facade",
    "LedgerError": "ledger.errors",
    "ManualClock": "ledger.clock",
    "NotFound": "ledger.errors",
    "Notice": "ledger.api.turn",
    "Observation": "ledger.domain.facts",
    "Outcome": "ledger.domain.records",
    "Page": "ledger.domain.records",
    "Part": "ledger.domain.envelope",
    "PartialOutput": "ledger.errors",
    "Phase": "ledger.domain.facts",
    "Policy": "ledger.policy.model",
    "PolicyError": "ledger.errors",
    "PreflightRefused": "ledger.errors",
    "Price": "ledger.domain.values",
    "Profile": "ledger.domain.values",
    "ProfileType": "ledger.domain.values",
    "WireProtocol": "ledger.domain.facts",
    "ProviderError": "ledger.errors",
    "Refused": "ledger.errors",
    "Route": "ledger.domain.values",
    "RunRecord": "ledger.domain.records",
    "FrozenRun": "ledger.domain.records",
    "RunState": "ledger.domain.records",
    "RunResult": "ledger.api.turn",
    "RunSession": "ledger.api.session",
    "AsyncRunSession": "ledger.api.session",
    "RunStatus": "ledger.domain.records",
    "SchemaTooNew": "ledger.errors",
    "Scope": "ledger.domain.facts",
    "SendResult": "ledger.api.turn",
    "SettleConflict": "ledger.errors",
    "Sleeper": "ledger.clock",
    "Source": "ledger.domain.facts",
    "StorageError": "ledger.errors",
    "SystemClock": "ledger.clock",
    "SystemSleeper": "ledger.clock",
    "WakeableSleeper": "ledger.clock",
    "ToolSpec": "ledger.domain.envelope",
    "Transport": "ledger.domain.facts",
    "aexecute": "ledger.api.turn",
    "classify": "ledger.decide.classify",
    "execute": "ledger.api.turn",
    "load_policy": "ledger.policy.load",
    "policy_hash": "ledger.policy.load",
    "preset": "ledger.policy.load",
}

__all__ = [
    "AdmissionConflict",
    "AllowanceExhausted",
    "ArgumentMismatch",
    "AsyncLedger",
    "AsyncRunSession",
    "AttemptKind",
    "AttemptRecord",
    "AttemptState",
    "Budget",
    "BudgetExceeded",
    "CandidateSkipped",
    "Capabilities",
    "CapacityUnavailable",
    "Category",
    "Clock",
    "ConfigError",
    "Conflict",
    "CooldownEffect",
    "DatabaseSetupError",
    "DatabaseUnavailable",
    "DebitState",
    "Dispatch",
    "Envelope",
    "FailoverExhausted",
    "FailureFact",
    "FencedOut",
    "FrozenRun",
    "Grant",
    "GroupMode",
    "GroupProjection",
    "Health",
    "InvalidArgument",
    "InvalidState",
    "Lease",
    "LeaseHeld",
    "LeaseLost",
    "Ledger",
    "LedgerError",
    "ManualClock",
    "NotFound",
    "Notice",
    "Observation",
    "Outcome",
    "Page",
    "Part",
    "PartialOutput",
    "Phase",
    "Policy",
    "PolicyError",
    "PreflightRefused",
    "Price",
    "Profile",
    "ProfileType",
    "ProviderError",
    "Refused",
    "Route",
    "RunRecord",
    "RunResult",
    "RunSession",
    "RunState",
    "RunStatus",
    "SchemaTooNew",
    "Scope",
    "SendResult",
    "SettleConflict",
    "Sleeper",
    "Source",
    "StorageError",
    "SystemClock",
    "SystemSleeper",
    "ToolSpec",
    "Transport",
    "WakeableSleeper",
    "WireProtocol",
    "__version__",
    "aexecute",
    "classify",
    "execute",
    "load_policy",
    "policy_hash",
    "preset",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    if not name.startswith("_"):
        # ``import ledger; ledger.ops.audit.Audit``: submodules load on first use, as they did when
        # the root imported them eagerly.
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'ledger' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
