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
    from ledger.api import (
        AsyncLedger,
        Ledger,
    )
    from ledger.clock import (
        Clock,
        ManualClock,
        Sleeper,
        SystemClock,
        SystemSleeper,
    )
    from ledger.core.classify import classify
    from ledger.core.envelope import (
        Envelope,
        Part,
        ToolSpec,
    )
    from ledger.core.facts import (
        Category,
        CooldownEffect,
        FailureFact,
        Observation,
        Phase,
        Protocol,
        Scope,
        Source,
        Transport,
    )
    from ledger.errors import (
        AdmissionConflict,
        AllowanceExhausted,
        BudgetExceeded,
        CapacityUnavailable,
        ConfigError,
        Conflict,
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
    from ledger.model import (
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
    from ledger.policy.load import (
        load_policy,
        policy_hash,
        preset,
    )
    from ledger.policy.model import Policy
    from ledger.records import (
        AttemptKind,
        AttemptRecord,
        AttemptState,
        DebitState,
        Lease,
        Outcome,
        Page,
        RunRecord,
        RunStatus,
    )
    from ledger.run import (
        Dispatch,
        Notice,
        RunResult,
        SendResult,
        aexecute,
        execute,
    )
    from ledger.session import AsyncRunSession, RunSession

# Public name -> the module that defines it.
_LAZY: dict[str, str] = {
    "AdmissionConflict": "ledger.errors",
    "AllowanceExhausted": "ledger.errors",
    "AsyncLedger": "ledger.api",
    "AttemptKind": "ledger.records",
    "AttemptRecord": "ledger.records",
    "AttemptState": "ledger.records",
    "Budget": "ledger.model",
    "BudgetExceeded": "ledger.errors",
    "Capabilities": "ledger.model",
    "CapacityUnavailable": "ledger.errors",
    "Category": "ledger.core.facts",
    "Clock": "ledger.clock",
    "ConfigError": "ledger.errors",
    "Conflict": "ledger.errors",
    "CooldownEffect": "ledger.core.facts",
    "DatabaseUnavailable": "ledger.errors",
    "DebitState": "ledger.records",
    "Dispatch": "ledger.run",
    "Envelope": "ledger.core.envelope",
    "FailoverExhausted": "ledger.errors",
    "FailureFact": "ledger.core.facts",
    "FencedOut": "ledger.errors",
    "Grant": "ledger.model",
    "GroupMode": "ledger.model",
    "GroupProjection": "ledger.model",
    "Health": "ledger.model",
    "InvalidArgument": "ledger.errors",
    "InvalidState": "ledger.errors",
    "Lease": "ledger.records",
    "LeaseHeld": "ledger.errors",
    "LeaseLost": "ledger.errors",
    "Ledger": "ledger.api",
    "LedgerError": "ledger.errors",
    "ManualClock": "ledger.clock",
    "NotFound": "ledger.errors",
    "Notice": "ledger.run",
    "Observation": "ledger.core.facts",
    "Outcome": "ledger.records",
    "Page": "ledger.records",
    "Part": "ledger.core.envelope",
    "PartialOutput": "ledger.errors",
    "Phase": "ledger.core.facts",
    "Policy": "ledger.policy.model",
    "PolicyError": "ledger.errors",
    "PreflightRefused": "ledger.errors",
    "Price": "ledger.model",
    "Profile": "ledger.model",
    "ProfileType": "ledger.model",
    "Protocol": "ledger.core.facts",
    "ProviderError": "ledger.errors",
    "Refused": "ledger.errors",
    "Route": "ledger.model",
    "RunRecord": "ledger.records",
    "RunResult": "ledger.run",
    "RunSession": "ledger.session",
    "AsyncRunSession": "ledger.session",
    "RunStatus": "ledger.records",
    "SchemaTooNew": "ledger.errors",
    "Scope": "ledger.core.facts",
    "SendResult": "ledger.run",
    "SettleConflict": "ledger.errors",
    "Sleeper": "ledger.clock",
    "Source": "ledger.core.facts",
    "StorageError": "ledger.errors",
    "SystemClock": "ledger.clock",
    "SystemSleeper": "ledger.clock",
    "ToolSpec": "ledger.core.envelope",
    "Transport": "ledger.core.facts",
    "aexecute": "ledger.run",
    "classify": "ledger.core.classify",
    "execute": "ledger.run",
    "load_policy": "ledger.policy.load",
    "policy_hash": "ledger.policy.load",
    "preset": "ledger.policy.load",
}

__all__ = [
    "AdmissionConflict",
    "AllowanceExhausted",
    "AsyncLedger",
    "AsyncRunSession",
    "AttemptKind",
    "AttemptRecord",
    "AttemptState",
    "Budget",
    "BudgetExceeded",
    "Capabilities",
    "CapacityUnavailable",
    "Category",
    "Clock",
    "ConfigError",
    "Conflict",
    "CooldownEffect",
    "DatabaseUnavailable",
    "DebitState",
    "Dispatch",
    "Envelope",
    "FailoverExhausted",
    "FailureFact",
    "FencedOut",
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
    "Protocol",
    "ProviderError",
    "Refused",
    "Route",
    "RunRecord",
    "RunResult",
    "RunSession",
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
        # ``import ledger; ledger.audit.Audit``: submodules load on first use, as they did when
        # the root imported them eagerly.
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'ledger' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
