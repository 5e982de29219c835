"""Every error the ledger raises, under one root.

The tree::

    LedgerError
    ├── ConfigError                     bad input from a file or an argument
    │   ├── PolicyError                 a policy file that does not validate (file, field path, fix)
    │   ├── InvalidArgument             API misuse: a negative budget, a missing field, ...
    │   │   │                           (names the field; also a ValueError)
    │   │   └── ArgumentMismatch        a call that fits no signature: an unknown keyword, a
    │   │                               missing or extra argument (also a TypeError)
    │   └── DatabaseSetupError          the database is not set up for this URL: no such database
    │       │                           or role, credentials or pg_hba refused, no privilege, a
    │       │                           schema older than the code (names the fix; retrying
    │       │                           will not help)
    │       └── DatabaseReadOnly        the role (its session, the database, the file) may not
    │                                   write: a reader's role used for a write (also a
    │                                   StorageError, read_only=True)
    ├── StorageError                    the database could not do what was asked
    │   ├── DatabaseUnavailable         the server is down or went away, the file is busy
    │   │                               (retry-safe)
    │   └── SchemaTooNew                the database was migrated by a newer ledger
    ├── NotFound                        an unknown run id, attempt id, ...
    ├── Conflict                        a write that contradicts what is already recorded
    │   ├── AdmissionConflict           same run id, different frozen content (names the fields)
    │   ├── SettleConflict              a settled attempt settled again with different content
    │   └── InvalidState                the record is not in a state that allows this write
    ├── FencedOut                       a stale executor (old fence) tried to write
    │   └── LeaseLost                   the lease lapsed (expired or released): acquire again
    ├── LeaseHeld                       another live executor holds the run's lease
    ├── Refused                         a bounded resource said no; nothing was sent
    │   ├── BudgetExceeded              the hold would overdraw the run's cost or token budget
    │   ├── AllowanceExhausted          no model call or retry permission left
    │   ├── CapacityUnavailable         the capacity group had no slot within the wait bound
    │   └── CandidateSkipped            the selector passed a route over (reason, fix)
    │       └── PreflightRefused        capability, role or disclosure check failed
    ├── ProviderError                   an adapter could not produce a result (carries the fact)
    └── FailoverExhausted (ExceptionGroup as well)
                                        the run stopped: every attempt's error + the stop reason

Every error carries structured fields (``.fields``) and a message that says what to do; the
message has passed :func:`ledger.redaction.redact`, so no known secret or key shape is in it.
Causes are chained with ``raise ... from``.

Every error pickles with its fields, its ``__cause__`` and its ``__notes__``. A cause that does
not survive pickling (an exception holding a socket, or one whose class needs arguments its
pickle does not carry, such as ``httpx.HTTPStatusError``) crosses as a stand-in: an exception
of the same module and class name and the same (redacted) text, which is not an instance of
the original class; the ledger error itself never becomes unpicklable because of its cause.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ledger.redaction import redact


class LedgerError(Exception):
    """Root of every error raised by the ledger."""

    def __init__(self, message: str, **fields: Any) -> None:
        # Exception text reaches logs and tracebacks: it passes the one redaction step.
        message = redact(message)
        super().__init__(message)
        self.message = message
        self.fields: dict[str, Any] = fields

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> Any:
        # Subclasses take keyword-only arguments, which Exception's default pickling (the
        # positional ``args`` only) cannot pass back: rebuild from the state instead, so every
        # error crosses a process boundary (multiprocessing, a task queue) intact. The state
        # holds the notes; the cause is not in it, and Exception's pickling drops it.
        return (_rebuild, (type(self), self.message, dict(self.__dict__), _chain(self)))


def _rebuild(cls: type[LedgerError], message: str, state: dict[str, Any],
             chain: tuple[BaseException | None, bool] | None = None) -> LedgerError:
    err = cls.__new__(cls, message)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    _relink(err, chain)
    return err


class _StandIn(Exception):
    """A cause that did not survive pickling, as its module, class name and text.

    Its class is made per (module, name) by :func:`_stand_in_class`, so ``type(cause).__name__``
    and ``__module__`` still say what the original was.
    """

    def __reduce__(self) -> Any:
        return (_stand_in, (type(self).__module__, type(self).__qualname__, str(self)))


@functools.lru_cache(maxsize=256)
def _stand_in_class(module: str, name: str) -> type[_StandIn]:
    return type(name, (_StandIn,), {"__module__": module, "__qualname__": name})


def _stand_in(module: str, name: str, text: str) -> _StandIn:
    return _stand_in_class(module, name)(text)


def _portable(exc: BaseException) -> BaseException:
    """``exc``, if a pickle of it loads back; else its stand-in.

    Only a round trip tells: some exceptions dump fine and fail on loading (a class whose
    constructor requires arguments its pickle does not pass back).
    """
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        # The text leaves the process now: it passes the one redaction step like a message.
        return _stand_in(type(exc).__module__, type(exc).__qualname__, redact(str(exc)))
    return exc


def _chain(err: BaseException) -> tuple[BaseException | None, bool]:
    """What an exception's pickle leaves out: its cause and whether it hides its context."""
    cause = err.__cause__
    return (None if cause is None else _portable(cause)), err.__suppress_context__


def _relink(err: BaseException, chain: tuple[BaseException | None, bool] | None) -> None:
    if chain is not None:  # None: pickled by a version that did not carry it
        err.__cause__, err.__suppress_context__ = chain


class ConfigError(LedgerError):
    """Bad configuration or arguments."""


class PolicyError(ConfigError):
    """A policy file or object that does not validate.

    ``file`` is the source path (or ``None``), ``errors`` a list of ``(field_path, problem, fix)``.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        errors: Sequence[tuple[str, str, str]] = (),
        **fields: Any,
    ) -> None:
        super().__init__(message, file=file, errors=list(errors), **fields)
        self.file = file
        self.errors = list(errors)


class InvalidArgument(ConfigError, ValueError):
    """API misuse: a value that can never be valid, with the field and the fix.

    ``field`` is the argument or the dotted field path (``plan[0].group``,
    ``budget.max_cost``); the message says what to pass instead; ``errors`` lists every problem
    found as ``(field_path, problem, fix)`` when a model reported several. Nothing was written.
    It is also a ``ValueError``, as pydantic's validation error (which it replaces) was, so code
    that caught that keeps working.
    """

    def __init__(self, message: str, *, field: str | None = None,
                 errors: Sequence[tuple[str, str, str]] = (), **fields: Any) -> None:
        found = list(errors) or ([(field, message, "")] if field is not None else [])
        super().__init__(message, field=field, errors=found, **fields)
        self.field = field
        self.errors = found


class ArgumentMismatch(InvalidArgument, TypeError):
    """A call of a public function that does not fit its signature.

    An unknown keyword (a typo), a missing required argument, too many positional ones.
    ``field`` names the argument; the message lists a close match. It is also a ``TypeError``,
    as Python's own error for such a call is. Nothing ran: the function's body was not entered.
    """


class DatabaseSetupError(ConfigError):
    """The database server answered, and its answer is a set-up problem retrying will not fix.

    The database or the role the URL names does not exist, the server refused the credentials
    (a wrong password, no ``pg_hba.conf`` entry for this host), the role may not log in, may
    not connect to the database, may not create it (``failover-ledger db init``) or may not
    create or change the ledger's tables; for SQLite, the file's folder does not exist, this
    process may not write it, the path is a directory, or the file is another application's
    database (tables, but not the ledger's) or no SQLite database at all, which the ledger
    will not add its schema to. The command line says the same where ``--db`` holds no ledger
    for a command that opens an existing one (every command but ``db init``, ``demo`` and
    ``generate``): a SQLite file that does not exist (``database_missing``), a database without
    the ledger's tables (``schema_outdated``), another application's file
    (``not_a_ledger``). Nothing was written. ``fields``:
    ``url`` (without its password), ``problem`` (one of ``database_missing``, ``role_missing``,
    ``login_refused``, ``auth_failed``, ``password_missing``, ``hba_rejected``,
    ``connect_privilege``, ``connections_disabled``, ``createdb_privilege``,
    ``schema_privilege``, ``schema_outdated``, ``schema_missing``, ``folder_missing``,
    ``folder_read_only``,
    ``not_a_file``, ``not_a_ledger``; :class:`DatabaseReadOnly`'s ``read_only`` and
    ``write_privilege``) and
    ``database`` / ``role`` where known. ``schema_outdated``: the database was opened with
    ``migrate_schema=False`` before a process of this version migrated it: its revision is
    older (refused at open), or a table or column this ledger uses is missing (refused by the
    statement) (``failover-ledger db init URL`` is the fix).
    The message names the fix (``docs/postgresql.md``).
    A server that is down or unreachable is :class:`DatabaseUnavailable` instead.
    """


class StorageError(LedgerError):
    """The database failed to perform an operation."""


class DatabaseUnavailable(StorageError):
    """The database could not be reached or opened. Safe to retry once it is back.

    ``fields``: ``url`` (without its password); ``commit="unknown"`` when the error came after
    a write's ``COMMIT`` was sent and is not the server's answer to a statement of it (the
    connection lost, the session terminated, also before the driver saw the connection close):
    it may have landed. A write of the hot path also
    says which it was and what became of it: ``operation`` (``begin``, ``settle``, ``finish``,
    ``release``, ``renew``, ``acquire``), ``resolved`` (whether its outcome is now certain:
    a lost acknowledgement is resolved under the Run's row lock before this is raised) and
    ``landed`` (``True``/``False`` when known; a resolved begin that landed was settled
    ``not_sent``), with ``run_id`` and ``attempt_id`` where they apply.
    ``fields["standby"]`` is ``True`` when the server reached was a standby that refused a
    write (a failover under way): nothing was written and the connection was dropped.
    ``fields["contention"]`` is the SQLSTATE when the server was there and another
    transaction was in the way (PostgreSQL: ``40P01`` a deadlock, ``40001`` a serialization
    failure, ``55P03`` a lock not granted within the lock timeout): the transaction was rolled
    back, nothing of it was recorded, and the message says so and when to retry.
    ``fields["partition"]`` names a month's partition of the history (``attempts_p202601``)
    that a statement named and found dropped (by a retention run) since it listed it: run it
    again, it plans from what is left.
    ``fields["schema_changed"]`` is ``True`` when a migration changed the type of a column a
    statement returns after the connection had prepared it (PostgreSQL: ``cached plan must
    not change result type``): the transaction was rolled back, and a retry goes through (the
    hot path runs a transaction again once by itself, from its start, on the connection once
    it let go of what it prepared; the cold path prepares nothing).
    """


class DatabaseReadOnly(DatabaseSetupError, StorageError):
    """The database refused a write because it is read-only to this connection.

    The role may not write (its sessions are read-only, ``ALTER ROLE ... SET
    default_transaction_read_only = on``, as an auditor's role is: ``docs/auditor-role.md``;
    or the database's or the URL's ``options`` make them so), it lacks the privilege on a
    ledger table (it was granted ``SELECT`` only), or the SQLite file is read-only to this
    process. The server that refused is the primary: a standby's refusal during a failover is
    :class:`DatabaseUnavailable` (``standby=True``) instead, which a retry gets past. Nothing
    was written, and retrying will not help: the message names the fix, to write with the
    role that writes the ledger (the one that runs ``failover-ledger db init``) or to use this
    one only to read. ``fields``: ``url`` (without its password), ``problem``
    (``read_only``: the session, database or file is read-only; ``write_privilege``: the role
    lacks the privilege, which is also what a read of a table the role was not granted
    ``SELECT`` on is told as), ``role`` and ``database`` where known, and ``read_only=True``.

    A set-up problem, so a :class:`DatabaseSetupError` (the command line exits with 2, the
    dashboard answers 403); also a :class:`StorageError`, which it was before it had a class
    of its own, so code that caught that and read ``fields["read_only"]`` keeps working.
    """


class SchemaTooNew(StorageError):
    """The database schema is newer than this code understands."""


class NotFound(LedgerError):
    """An identifier that the ledger does not know."""


class Conflict(LedgerError):
    """A write that contradicts a write already recorded."""


class AdmissionConflict(Conflict):
    """A run id admitted before with different frozen content; ``differing`` names the fields."""

    def __init__(self, message: str, *, run_id: str, differing: Sequence[str], **fields: Any):
        super().__init__(message, run_id=run_id, differing=list(differing), **fields)
        self.run_id = run_id
        self.differing = list(differing)


class SettleConflict(Conflict):
    """An attempt already settled with different content."""


class InvalidState(Conflict):
    """The record is not in a state that allows this write."""


class FencedOut(LedgerError):
    """A write carried a fence older than the run's current fence: this executor lost the run."""


class LeaseLost(FencedOut):
    """The lease is no longer live: it expired, or it was released.

    Nothing it starts is written; acquire the lease again (which bumps the fence) before doing
    more work.
    """


class LeaseHeld(LedgerError):
    """Another executor holds an unexpired lease on the run.

    ``holder`` and ``expires_at`` name the lease. Entering a Run session is refused so too when
    a session of the same Run is open on this ledger (``problem="session_open"``, ``holder``
    this ledger's executor): the two would share one lease.
    """


class Refused(LedgerError):
    """A bounded resource refused; nothing was sent.

    ``route`` names the candidate route it concerns, when it concerns one (a turn's stop
    holds one error per candidate).
    """

    def __init__(self, message: str, *, route: str | None = None, **fields: Any) -> None:
        super().__init__(message, route=route, **fields)
        self.route = route


class BudgetExceeded(Refused):
    """The debit hold would overdraw the run's cost (or token) budget."""


class AllowanceExhausted(Refused):
    """The run has no model-call allowance or retry permission left."""


class CapacityUnavailable(Refused):
    """The capacity group could not admit the attempt within the deadline."""


class CandidateSkipped(Refused):
    """The selector passed a candidate route over for this turn; nothing was sent to it.

    ``route`` is the candidate, ``reason`` the selector's skip reason (``route_cooldown``,
    ``same_group_unavailable``, ``disclosure``, ...), ``detail`` what exactly, and ``fix``
    what would make it eligible where the host can act (empty otherwise). A turn's stop
    (:class:`FailoverExhausted`) holds one for every candidate it never tried.
    """

    def __init__(self, message: str, *, route: str | None = None, reason: str = "",
                 detail: str = "", fix: str = "", **fields: Any) -> None:
        super().__init__(message, route=route, reason=reason, detail=detail, fix=fix, **fields)
        self.reason = reason
        self.detail = detail
        self.fix = fix


class PreflightRefused(CandidateSkipped):
    """The request may not be sent to that route (capability, role or disclosure).

    Raised by :meth:`ledger.decide.preflight.PreflightResult.require`. The retry owner does not
    raise it: its selector passes such a route over (a skip named after the failed check), and
    a stop holds it for that candidate.
    """


class ProviderError(LedgerError):
    """A provider call failed.

    ``fact`` is the structured failure fact (:class:`~ledger.domain.facts.FailureFact`),
    ``attempt_id`` and ``route`` name the Attempt; ``fields["fact"]`` holds the same fact as JSON
    for logs. A Run's turn words its message so one log line says why: provider and model, the
    category, the HTTP status (or transport kind and phase), the provider's code and its
    message, redacted and cut to 200 characters (``acme/large: unknown (HTTP 200, code
    server_error): The model failed to generate a response.``).
    """

    def __init__(self, message: str, *, fact: Any = None, attempt_id: str | None = None,
                 route: str | None = None, **fields: Any) -> None:
        as_json = fact.to_json() if hasattr(fact, "to_json") else fact
        super().__init__(message, attempt_id=attempt_id, route=route, fact=as_json, **fields)
        self.fact = fact
        self.attempt_id = attempt_id
        self.route = route


@dataclass(frozen=True)
class PartialOutput:
    """Output the caller was already shown when its attempt failed and the turn stopped.

    ``text`` as delivered, by ``attempt_id`` on ``route`` (seed 003 section 7); it is
    :attr:`FailoverExhausted.partial`.
    """

    text: str
    attempt_id: str
    route: str


class FailoverExhausted(LedgerError, ExceptionGroup):
    """The run stopped without a result.

    ``reason`` is the stop reason (the selector's, ``retry_allowance``, ``call_allowance`` or
    ``budget``); ``exceptions`` every attempt's error in order, then a
    :class:`CandidateSkipped` for every candidate that was passed over and never tried, each
    with its ``route``; ``attempts`` the attempt ids; ``detail`` and ``skipped`` (the
    candidates passed over, with their reasons) explain the stop; ``partial`` is the output the
    caller was already shown, when there was some. Its message names every candidate: how it
    failed, or why it was skipped and the fix where there is one.
    """

    def __new__(
        cls,
        message: str,
        exceptions: Sequence[Exception],
        *,
        reason: str,
        attempts: Sequence[str] = (),
        detail: str = "",
        skipped: Sequence[Any] = (),
        partial: PartialOutput | None = None,
        **fields: Any,
    ) -> FailoverExhausted:
        """Build the group: an ExceptionGroup takes its message and errors in ``__new__``."""
        excs = list(exceptions) or [LedgerError(f"no attempt was made: {reason}")]
        self = ExceptionGroup.__new__(cls, redact(message), excs)
        return self

    def __init__(
        self,
        message: str,
        exceptions: Sequence[Exception],
        *,
        reason: str,
        attempts: Sequence[str] = (),
        detail: str = "",
        skipped: Sequence[Any] = (),
        partial: PartialOutput | None = None,
        **fields: Any,
    ) -> None:
        excs = list(exceptions) or [LedgerError(f"no attempt was made: {reason}")]
        ExceptionGroup.__init__(self, redact(message), excs)
        self.reason = reason
        self.attempts = list(attempts)
        self.detail = detail
        self.skipped = list(skipped)
        self.partial = partial
        self.fields = {"reason": reason, "attempts": list(attempts), "detail": detail,
                       "skipped": list(skipped), **fields}
        if partial is not None:
            self.fields["partial"] = partial

    def __str__(self) -> str:
        return self.message

    def _kwargs(self) -> dict[str, Any]:
        extra = {k: v for k, v in self.fields.items()
                 if k not in ("reason", "attempts", "detail", "skipped", "partial")}
        return {"reason": self.reason, "attempts": self.attempts, "detail": self.detail,
                "skipped": self.skipped, "partial": self.partial, **extra}

    def derive(self, excs: Sequence[Exception]) -> FailoverExhausted:  # type: ignore[override]
        """The same stop with only ``excs`` (``except*`` splits the group this way).

        Each part keeps every fact about the stop: reason, attempts, detail, skipped, partial,
        and its class (a subclass, such as the LangChain integration's ``LedgerStop``, keeps
        its own attributes; one with another constructor overrides this).
        """
        return type(self)(self.message, list(excs), **self._kwargs())

    def __reduce__(self) -> Any:
        # Rebuilt through the constructor (an ExceptionGroup takes its members in __new__);
        # the notes, the cause and the class go along, as the constructor takes none of them.
        state = {"__notes__": list(self.__notes__)} if hasattr(self, "__notes__") else {}
        return (_rebuild_failover, (self.message, [_portable(e) for e in self.exceptions],
                                    self._kwargs(), type(self), state, _chain(self)))


def _rebuild_failover(message: str, excs: list[Exception], kwargs: dict[str, Any],
                      cls: type[FailoverExhausted] | None = None,
                      state: dict[str, Any] | None = None,
                      chain: tuple[BaseException | None, bool] | None = None
                      ) -> FailoverExhausted:
    # The defaults read a pickle an earlier version wrote (message, members and kwargs only).
    err = (cls or FailoverExhausted)(message, excs, **kwargs)
    err.__dict__.update(state or {})
    _relink(err, chain)
    return err


__all__ = [
    "AdmissionConflict",
    "AllowanceExhausted",
    "ArgumentMismatch",
    "BudgetExceeded",
    "CandidateSkipped",
    "CapacityUnavailable",
    "ConfigError",
    "Conflict",
    "DatabaseReadOnly",
    "DatabaseSetupError",
    "DatabaseUnavailable",
    "FailoverExhausted",
    "FencedOut",
    "InvalidArgument",
    "InvalidState",
    "LeaseHeld",
    "LeaseLost",
    "LedgerError",
    "NotFound",
    "PartialOutput",
    "PolicyError",
    "PreflightRefused",
    "ProviderError",
    "Refused",
    "SchemaTooNew",
    "SettleConflict",
    "StorageError",
]
