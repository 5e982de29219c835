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
    from ledger.api.facade import AsyncLedger as AsyncLedger
    from ledger.api.facade import Ledger as Ledger
    from ledger.api.session import AsyncRunSession as AsyncRunSession
    from ledger.api.session import RunSession as RunSession
    from ledger.api.turn import Dispatch as Dispatch
    from ledger.api.turn import Notice as Notice
    from ledger.api.turn import RunResult as RunResult
    from ledger.api.turn import SendResult as SendResult
    from ledger.api.turn import aexecute as aexecute
    from ledger.api.turn import execute as execute
    from ledger.clock import Clock as Clock
    from ledger.clock import ManualClock as ManualClock
    from ledger.clock import Sleeper as Sleeper
    from ledger.clock import SystemClock as SystemClock
    from ledger.clock import SystemSleeper as SystemSleeper
    from ledger.clock import WakeableSleeper as WakeableSleeper
    from ledger.decide.classify import classify as classify
    from ledger.domain.envelope import Envelope as Envelope
    from ledger.domain.envelope import Part as Part
    from ledger.domain.envelope import PartHashes as PartHashes
    from ledger.domain.envelope import ToolSpec as ToolSpec
    from ledger.domain.facts import Category as Category
    from ledger.domain.facts import CooldownEffect as CooldownEffect
    from ledger.domain.facts import FailureFact as FailureFact
    from ledger.domain.facts import Observation as Observation
    from ledger.domain.facts import Phase as Phase
    from ledger.domain.facts import Scope as Scope
    from ledger.domain.facts import Source as Source
    from ledger.domain.facts import Transport as Transport
    from ledger.domain.facts import WireProtocol as WireProtocol
    from ledger.domain.records import AttemptKind as AttemptKind
    from ledger.domain.records import AttemptRecord as AttemptRecord
    from ledger.domain.records import AttemptState as AttemptState
    from ledger.domain.records import DebitState as DebitState
    from ledger.domain.records import FrozenRun as FrozenRun
    from ledger.domain.records import Lease as Lease
    from ledger.domain.records import Outcome as Outcome
    from ledger.domain.records import Page as Page
    from ledger.domain.records import RunRecord as RunRecord
    from ledger.domain.records import RunState as RunState
    from ledger.domain.records import RunStatus as RunStatus
    from ledger.domain.values import Budget as Budget
    from ledger.domain.values import Capabilities as Capabilities
    from ledger.domain.values import Grant as Grant
    from ledger.domain.values import GroupMode as GroupMode
    from ledger.domain.values import GroupProjection as GroupProjection
    from ledger.domain.values import Health as Health
    from ledger.domain.values import Price as Price
    from ledger.domain.values import Profile as Profile
    from ledger.domain.values import ProfileType as ProfileType
    from ledger.domain.values import Route as Route
    from ledger.errors import AdmissionConflict as AdmissionConflict
    from ledger.errors import AllowanceExhausted as AllowanceExhausted
    from ledger.errors import ArgumentMismatch as ArgumentMismatch
    from ledger.errors import BudgetExceeded as BudgetExceeded
    from ledger.errors import CandidateSkipped as CandidateSkipped
    from ledger.errors import CapacityUnavailable as CapacityUnavailable
    from ledger.errors import ConfigError as ConfigError
    from ledger.errors import Conflict as Conflict
    from ledger.errors import DatabaseReadOnly as DatabaseReadOnly
    from ledger.errors import DatabaseSetupError as DatabaseSetupError
    from ledger.errors import DatabaseUnavailable as DatabaseUnavailable
    from ledger.errors import FailoverExhausted as FailoverExhausted
    from ledger.errors import FencedOut as FencedOut
    from ledger.errors import InvalidArgument as InvalidArgument
    from ledger.errors import InvalidState as InvalidState
    from ledger.errors import LeaseHeld as LeaseHeld
    from ledger.errors import LeaseLost as LeaseLost
    from ledger.errors import LedgerError as LedgerError
    from ledger.errors import NotFound as NotFound
    from ledger.errors import PartialOutput as PartialOutput
    from ledger.errors import PolicyError as PolicyError
    from ledger.errors import PreflightRefused as PreflightRefused
    from ledger.errors import ProviderError as ProviderError
    from ledger.errors import Refused as Refused
    from ledger.errors import SchemaTooNew as SchemaTooNew
    from ledger.errors import SettleConflict as SettleConflict
    from ledger.errors import StorageError as StorageError
    from ledger.policy.load import load_policy as load_policy
    from ledger.policy.load import policy_hash as policy_hash
    from ledger.policy.load import preset as preset
    from ledger.policy.model import Policy as Policy

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
    "DatabaseReadOnly": "ledger.errors",
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
    "PartHashes": "ledger.domain.envelope",
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

# Every name the root serves; spelled once, in the table above (the type checkers' imports
# are held to it by tests/test_startup.py).
__all__ = sorted([*_LAZY, "__version__"])


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
