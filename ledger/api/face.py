"""The ledger's operations, written once: :class:`Face`, the base of both public faces.

A method checks its arguments (:mod:`ledger.domain.validation`), asks the pure core what the
write means (:mod:`ledger.decide`: what an admission freezes, what a begin may use, what a settle
records and does to holds, health and groups, all under the Run's *frozen* policy), and hands
the resulting spec to storage: the hot path's store (:class:`~ledger.storage.store.Store`) or,
for admission, reads and administration, :class:`~ledger.storage.runs.RunQueries`. Each applies
it in one transaction. The store is private to the ledger; ops and tools reach it with
:func:`storage_of`.

Every operation is a flow (:mod:`ledger.storage.runner`) decorated with
:class:`~ledger.api.calls.op`: :class:`SyncFace` (:class:`~ledger.Ledger`'s base) performs it on
the blocking runner, :class:`AsyncFace` (:class:`~ledger.AsyncLedger`'s) awaits it on the asyncio
one (on SQLite, the database's own threads), with the same checks and the same transactions. The
cold path's SQLAlchemy reads and writes (admission, reads for people) have only a blocking form:
an AsyncLedger runs those steps in a worker thread.

This module knows no Run session, lease keeper or turn: those build on it
(:mod:`ledger.api.session`, :mod:`ledger.api.lease`, :mod:`ledger.api.turn`), and the public
classes that tie them together live in :mod:`ledger.api.facade`. The two base classes exist so
that those modules can name "a blocking ledger" and "an awaiting one" in their signatures
without importing the module that imports them.
"""
from __future__ import annotations

import copy
import os
import threading
import weakref
from collections.abc import Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Generic, TypeVar, Unpack, cast

from pydantic import SkipValidation, StrictStr

from ledger.api.arguments import (
    AttemptFilters,
    AuditData,
    ClockArg,
    EventKind,
    Events,
    FoldAfter,
    Hash,
    LeaseTtl,
    PartHashList,
    RollupLag,
    RouteRef,
    SendTime,
    SessionOptions,
    Url,
    attempt_query,
    retention_age,
)
from ledger.api.calls import Awaiting, Blocking, Lru, op
from ledger.clock import Clock, SystemClock
from ledger.decide.admission import (
    DEFAULT_ROLE,
    Admission,
    admission_spec,
    admission_terms,
    child_terms,
    continued_child_terms,
    keyless_ids,
    validate_plan,
)
from ledger.decide.begin import begin_spec
from ledger.decide.ending import ENDED
from ledger.decide.health import as_read, canonical_key, probe_key_kind, route_key
from ledger.decide.pricing import resolve_prices
from ledger.decide.settle import check_lease_ttl, settle_spec
from ledger.domain.bounds import (
    DEFAULT_FOLD_AFTER_S,
    DEFAULT_LEASE_MARGIN_S,
    MAX_HEALTH_KEY_LENGTH,
)
from ledger.domain.facts import FailureFact, Observation
from ledger.domain.records import (
    AttemptKind,
    AttemptRecord,
    DebitRecord,
    EventRecord,
    FrozenRun,
    Lease,
    LeaseArg,
    Outcome,
    Page,
    Retention,
    Rollup,
    RunRecord,
    RunStatus,
    run_live,
    to_micros,
)
from ledger.domain.specs import GroupUpdate, ReceiptSpec
from ledger.domain.validation import (
    As,
    Evidence,
    Flag,
    HealthKey,
    HealthKeyList,
    Id,
    IdList,
    Money,
    NewId,
    Reason,
    Secrets,
    Text,
    Time,
    Tokens,
    amount_in_range,
    checked,
    duration,
    instance,
    integers,
    one_of,
    text,
)
from ledger.domain.values import (
    Budget,
    Grant,
    GroupMode,
    GroupProjection,
    Health,
    Route,
    new_id,
)
from ledger.errors import (
    AdmissionConflict,
    DatabaseUnavailable,
    InvalidArgument,
    LedgerError,
    NotFound,
)
from ledger.forking import in_child, renew_in_child
from ledger.policy.model import FROZEN, Policy
from ledger.storage.runner import Flow, UnderWay, Workers, blocking

if TYPE_CHECKING:
    from ledger.decide.effects import TurnSnapshot
    from ledger.storage.store import Store

SessionT = TypeVar("SessionT")  # a Run session: RunSession or AsyncRunSession
OpenedT = TypeVar("OpenedT")  # an opened ledger: Ledger, or an _Opening of an AsyncLedger

DEFAULT_LEASE_TTL_S = 30.0
# What an operator's evidence may settle an unknown Attempt as.
_FINAL = (Outcome.SUCCEEDED, Outcome.FAILED, Outcome.NOT_SENT)


#: Provenance kinds only the ledger writes: an Attempt's output at its settle, a tool call the
#: integrations renamed. A host recording one would vouch for a model's output.
LEDGER_PROVENANCE_KINDS = frozenset({"model_output", "tool_call"})


def _within(part: int | None, field: str, total: int | None, of: str) -> None:
    """Refuse a part of a token total that exceeds the total (when both are given).

    Cached tokens are a part of the prompt's, reasoning tokens of the completion's.
    """
    if part is not None and total is not None and part > total:
        raise InvalidArgument(f"{field} ({part}) exceeds {of} ({total}); it counts a part of "
                              f"{of}, so pass at most {total}", field=field)


def _used_nothing(said: str, usage: Mapping[str, object]) -> None:
    """Refuse usage or a cost given for a call that never left (recorded ``not_sent``).

    ``said``: how the caller said so (``outcome not_sent``, a ``before_send`` failure). Such a
    call used and cost nothing; its figures would count in ``costs`` and the token metrics.
    """
    for name, value in usage.items():
        if value is not None:
            raise InvalidArgument(
                f"{name} given with {said}: a not_sent call never left and used nothing, so "
                "it has no usage or cost; drop it, or settle as succeeded or failed if the "
                "request was sent", field=name)


def _resolve_policy(policy: Policy | str | Mapping[str, Any] | None) -> Policy:
    from ledger.policy import DEFAULT_PRESET, PRESETS
    from ledger.policy.load import load_policy, shared_preset, validate_policy

    if policy is None or (isinstance(policy, str) and policy in PRESETS):
        # The one parse every admission shares: admission only freezes and hashes it, and no
        # caller is handed it (preset() and load_policy() give copies).
        return shared_preset(policy or DEFAULT_PRESET)
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str | os.PathLike):
        return load_policy(policy)
    # A mapping, or anything else: the loader's validation names the field path and the fix.
    return validate_policy(policy)


def _policy_hash(policy: Policy) -> str:
    from ledger.policy.load import policy_hash

    return policy_hash(policy)


# The executor ids of the ledgers open in this process, per database (storage.database_key: a
# SQLite file by its resolved path, a PostgreSQL database by its URL normalized). Two ledgers
# on one database under one id would each take the other's leases for their own
# (acquire_lease hands an executor its own live lease back, under the same fence), which each
# ledger's registry of open Run sessions cannot see: a Run session on each would run turns
# under one fence, and the first to leave would end the Run under the other's. Ledgers on
# other databases never meet each other's leases. Weak, as that registry is: a ledger dropped
# without close() stops holding its id once it is collected.
_executors: weakref.WeakValueDictionary[tuple[str, str], Face[Any, Any]] = \
    weakref.WeakValueDictionary()
_executors_lock = threading.Lock()


@in_child
def _forked_executors() -> None:
    # Another thread of the parent may have held it at the fork; the table itself is renewed
    # by each ledger (Face._forked), which takes a new id there.
    global _executors_lock
    _executors_lock = threading.Lock()


def _executor_in_use(executor_id: str, where: str) -> InvalidArgument:
    return InvalidArgument(
        f"executor_id {executor_id!r} is already the executor of another ledger open in this "
        f"process on {where}: the two would each take the other's Run leases for their own "
        "(an executor's own lease comes back to it under the same fence), so a Run session on "
        "each would run turns under one fence and the first to leave would end the Run under "
        "the other's turns. Give each ledger its own executor_id (the default is a new unique "
        "one), share the open ledger (its Run sessions may run at once, from threads or "
        "tasks; AsyncLedger(ledger) shares it with async code), or close it first",
        field="executor_id", problem="executor_in_use", executor_id=executor_id)


def check_executor_free(executor_id: str | None, url: str) -> None:
    """Refuse an ``executor_id`` a ledger open in this process holds on the database ``url``.

    ``InvalidArgument`` (``problem="executor_in_use"``), before anything is opened for it. A
    URL that cannot be parsed is left to the open, which names its fault.
    """
    if executor_id is None:
        return
    from ledger.storage import database_key

    try:
        where = database_key(url)
    except LedgerError:
        return
    if _executors.get((executor_id, where)) is not None:
        raise _executor_in_use(executor_id, where)


def release_executor(ledger: Face[Any, Any]) -> None:
    """A closed ledger gives up its executor id on its database in this process."""
    key = (ledger.executor_id, ledger._database)
    with _executors_lock:
        if _executors.get(key) is ledger:
            del _executors[key]


#: How long a ledger's close waits for the Run sessions entering on it (then a WARNING): an
#: entry may wait for SQLite's busy timeout (30 s) behind another process's write lock.
CLOSE_WAITS_ENTRIES_S = 5.0


class Entries:
    """The Run sessions entering on one ledger, counted so that its close can wait for them.

    From the close on, no session enters (:mod:`ledger.api.session`). A session counted here had
    not yet found the ledger closing when its entry began; its entry ends by checking again
    under the same lock, so it either is open before the close looks for open sessions (and the
    close gives its lease up) or finds the close begun and gives back what it took, while the
    database is still there to take it.
    """

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._under_way = UnderWay(lock)
        #: Whether the ledger's close has begun (read and set under the lock).
        self.closing = False
        #: The writers of sessions' remembered exits still trying (``ExitWriter``).
        self._exits: set[Any] = set()

    def begun(self) -> None:
        """One more entry under way (called under the lock, once ``closing`` was read)."""
        self._under_way.begun()

    def ended_one(self) -> None:
        """An entry under way ended, whichever way (takes the lock)."""
        self._under_way.ended_one()

    def close(self) -> None:
        """The ledger's close has begun: no session enters from now on."""
        with self._lock:
            self.closing = True

    def exit_writer(self, writer: Any) -> bool:
        """Count ``writer`` (a session's remembered exit being tried) until it ends.

        ``False``, counting nothing, once the close has begun: the close writes the exit.
        """
        with self._lock:
            if self.closing:
                return False
            self._exits.add(writer)
            return True

    def exit_written(self, writer: Any) -> None:
        """``writer`` ended, whichever way."""
        with self._lock:
            self._exits.discard(writer)

    def take_exit_writers(self) -> list[Any]:
        """The exit writers still trying, for the close to stop (after :meth:`close`)."""
        with self._lock:
            return list(self._exits)

    def ended(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no entry is under way; whether none is."""
        return self._under_way.ended(timeout_s)


class Face(Generic[SessionT, OpenedT]):
    """What :class:`Ledger` and :class:`AsyncLedger` share: every operation, written once.

    Each public operation is a flow (:mod:`ledger.storage.runner`) decorated with :class:`op`:
    the two faces differ only in how they perform it (``awaiting``), blocking or awaited, and
    in what :meth:`run` and :meth:`open` give (``SessionT``, ``OpenedT``).
    """

    #: Whether this face awaits its operations (AsyncLedger) or blocks on them (Ledger).
    awaiting: ClassVar[bool]

    # Private: applications use the ledger's methods; ops and tools reach the store
    # deliberately, through storage_of(), and the audit its reads through reads_of().
    _store: Store
    _replica: Store | None = None  # a read replica's (read_url=), for the audit's reads

    # ``store`` is not validated: its class is SQLAlchemy's side of the ledger, which a type
    # checker imports and ``import ledger`` does not.
    @checked
    def __init__(self, store: SkipValidation[Any], clock: ClockArg | None = None,
                 executor_id: Id | None = None) -> None:
        self._store = store
        self._runner = self._store.runner
        # The cold path's queries (SQLAlchemy), loaded when a ledger is made, not imported;
        # recovery's and retention's when an operator closes a Run or drops history.
        from ledger.storage.runs import RunQueries

        self._runs = RunQueries(store.context)
        self.clock: Clock = clock or SystemClock()
        self.executor_id = executor_id or new_id("exec")
        # A default id is this process's own, and a forked child takes a new one; one the
        # host passed is its promise to make it differ per process, and is kept.
        self._own_executor_id = executor_id is None
        from ledger.storage import database_key

        # The database, not the URL's spelling: a path and its sqlite:/// URL are one.
        self._database = database_key(store.context.where)
        key = (self.executor_id, self._database)
        with _executors_lock:
            if _executors.get(key) is not None:
                raise _executor_in_use(*key)
            _executors[key] = self
        # Per Run, what never changes once it is admitted, read once: its frozen Run, and what
        # its decisions read besides its live row (its ancestors up to its root, for
        # provenance; its groups and its health keys). A Run session's exit drops its Run's
        # entries (_drop_cached); the sizes bound what operations outside a session leave.
        self._frozen_runs: Lru[str, FrozenRun] = Lru(1024)
        self._reads: Lru[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = Lru(1024)
        # Parsed policies by their hash, which names their content: every Run frozen under one
        # policy (a preset's Runs) shares one parse, some 30 KB. Sharing is safe because the
        # ledger never changes a policy (a frozen model, whose lists and dicts no decision
        # writes) and hands every caller a copy of its own (run_policy, turn_snapshot).
        self._policies: Lru[str, Policy] = Lru(32)
        # What a settle must know of an Attempt before its transaction (its Run, route and
        # profile choose the health rows it reads), as this ledger's begin recorded it: fixed
        # once the Attempt exists, so a settle of an Attempt begun here reads nothing first.
        # Kept until the Attempt is settled here, or its Run's last session exits.
        self._begun: Lru[str, tuple[str, str, str | None, float]] = Lru(4096)
        # The Run sessions open (or entering) on this ledger, by Run id: a second session of
        # one Run would get this executor's own lease back under the same fence, and the
        # first to leave would end the Run under the other (ledger.api.session). Weak: a
        # session dropped without leaving its block does not keep its Run refused. Shared
        # with an AsyncLedger over this ledger (its ``sync``), whose executor id is the same.
        self._open_sessions: weakref.WeakValueDictionary[str, Any] = \
            weakref.WeakValueDictionary()
        self._open_sessions_lock = threading.Lock()  # sessions entered on several threads
        # The sessions still entering, which the ledger's close waits for (a shared object, so
        # an AsyncLedger over this ledger counts and closes with it).
        self._entries = Entries(self._open_sessions_lock)
        renew_in_child(self)

    def _forked(self) -> None:
        """In a forked child (:mod:`ledger.forking`): what is the parent's, let go of.

        A new default executor id, for the parent's leases are not this process's; the
        parent's Run sessions forgotten (their keepers and turns are the parent's threads);
        new locks, which the parent's threads may have held at the fork. The store renews
        its connections and threads itself.
        """
        old = (self.executor_id, self._database)
        if self._own_executor_id:
            self.executor_id = new_id("exec")
        if _executors.get(old) is self:
            del _executors[old]
            _executors[(self.executor_id, self._database)] = self
        for cache in (self._frozen_runs, self._reads, self._policies, self._begun):
            cache.forked()
        self._begun.drop_where(lambda _: True)  # Attempts the parent began: it settles them
        closing = self._entries.closing
        self._open_sessions = weakref.WeakValueDictionary()
        self._open_sessions_lock = threading.Lock()
        self._entries = Entries(self._open_sessions_lock)
        self._entries.closing = closing

    @property
    def backend(self) -> str:
        """The database backend: ``"sqlite"`` or ``"postgresql"``."""
        return self._store.backend

    @property
    def lease_margin_s(self) -> float:
        """How long before its end a lease stops starting work, in seconds.

        Set by :meth:`open` (``lease_margin_s=``): a lease's ``ttl_s`` must be longer, and a
        keeper renews before it.
        """
        return self._store.lease_margin_s

    def now(self) -> float:
        """The ledger clock's time, in epoch seconds."""
        return self.clock.now()

    # -- opening, and Run sessions ---------------------------------------------------------

    @classmethod
    @checked
    def open(cls, url: Url, *, clock: ClockArg | None = None, executor_id: Id | None = None,
             migrate_schema: Flag = True,
             lease_margin_s: Annotated[float, duration(60.0)] = DEFAULT_LEASE_MARGIN_S,
             read_url: Url | None = None) -> OpenedT:
        """Open (creating or upgrading the schema) a ledger at a SQLite path or a URL.

        ``Ledger.open(url)`` returns the open :class:`Ledger`; ``await AsyncLedger.open(url)``
        (or ``async with AsyncLedger.open(url) as led:``, which closes it when the block ends)
        the :class:`AsyncLedger`, opened (and migrated) in a worker thread; it is a coroutine,
        so ``asyncio.run(AsyncLedger.open(url))`` and ``asyncio.create_task`` take it too.

        Args:
            url: A SQLite file path (``"ledger.db"``) or a PostgreSQL URL
                (``postgresql+psycopg://user@host/db``; needs the ``postgres`` extra). A
                SQLite file that does not exist, or holds no table, is made a ledger; one
                that holds another application's tables is refused, untouched (a ledger
                keeps a file of its own). A PostgreSQL database may hold other tables: the
                ledger's go beside them (``docs/postgresql.md``). SQLite's in-memory
                database, in any spelling (``:memory:``, ``sqlite:///:memory:``,
                ``file::memory:``, ``sqlite:///file:NAME?mode=memory&uri=true``, the ``memdb``
                VFS), is refused: the ledger's connections and processes share one file. So
                is a ``file:`` URI filename (``sqlite:///file:ledger.db``): pass the path.
            clock: Where the ledger reads time (default :class:`~ledger.SystemClock`; tests
                pass a :class:`~ledger.ManualClock`).
            executor_id: This process's name as a lease holder (default: a new unique id).
                One open ledger's per database in this process (see Raises); across
                processes and hosts, keep it unique yourself (``docs/operations.md``,
                "Leases and fences").
            migrate_schema: Create or upgrade the schema first (``False`` for a read-only
                role, or when migrations run separately: then a schema older or newer than
                this package's is refused at open, see Raises).
            lease_margin_s: How long before its end a lease stops starting work, from 0 to
                60 s: the clock skew between hosts the ledger tolerates
                (``docs/operations.md``).
            read_url: A PostgreSQL URL of a read replica of the same database (a hot standby;
                several servers may be named, a standby is preferred): the audit
                (:class:`~ledger.ops.audit.Audit`, the dashboard, the command line's reports)
                reads there, in read-only sessions. Every write and every read of the ledger's
                own methods (a turn's, a Run session's, recovery's) stays on ``url``
                (``docs/high-availability.md``). Nothing connects to it until the first audit
                read.

        Returns:
            The open ledger; :meth:`close` it (or use it as a ``with`` block).

        Raises:
            InvalidArgument: a URL that is not a string, cannot be parsed or names another
                backend, a SQLite URL naming no file, an in-memory database or a ``file:``
                URI filename (``field="url"``),
                a PostgreSQL URL without psycopg installed, a ``clock`` without
                ``now()``, a malformed ``executor_id``, ``lease_margin_s`` out of range; a
                ``read_url`` (``field="read_url"``) that cannot be parsed or is not
                PostgreSQL's, or given with a SQLite ledger; an ``executor_id`` another ledger
                open in this process holds on the same database
                (``problem="executor_in_use"``, before anything is opened: the two would share
                every lease; give each its own, or close the other first).
            DatabaseSetupError: the database is not set up for this URL, which no retry
                fixes: the database or role does not exist, the server refused the
                credentials, the role may not connect or migrate, a missing SQLite folder, a
                SQLite file that holds another application's tables or is not a SQLite
                database (``problem="not_a_ledger"``; checked when migrating, before anything
                is written), opened with ``migrate_schema=False`` on a schema older than this
                package's (``problem="schema_outdated"``: run ``failover-ledger db init URL``)
                (the message names the fix; ``docs/postgresql.md``).
            DatabaseUnavailable: the database cannot be reached (a server that is down or
                went away, a file another process keeps busy): retry once it is back.
            SchemaTooNew: the database was migrated by a newer ledger (with or without
                ``migrate_schema``).

        Example:
            >>> with Ledger.open("ledger.db") as led:  # doctest: +SKIP
            ...     print(led.backend)
            sqlite
        """
        return cls._open(url, clock=clock, executor_id=executor_id,
                         migrate_schema=migrate_schema, lease_margin_s=lease_margin_s,
                         read_url=read_url)

    @classmethod
    def _open(cls, url: str, *, clock: Clock | None, executor_id: str | None,
              migrate_schema: bool, lease_margin_s: float, read_url: str | None) -> OpenedT:
        """Open this kind of ledger on validated arguments (each public class says how)."""
        raise NotImplementedError

    @checked
    def run(self, run_id: NewId, **options: Unpack[SessionOptions]) -> SessionT:
        """A Run held in a ``with`` block: a :class:`~ledger.RunSession`.

        On an :class:`AsyncLedger`, an ``async with`` block: an
        :class:`~ledger.AsyncRunSession`. Entering checks that every route's key can be
        resolved (its ``api_key_env``, or each credential profile through the adapter's secret
        provider), then admits the Run (or resumes it, for the same id and content) and takes
        its lease, kept renewed in the background; leaving finishes it and releases the lease.
        See :mod:`ledger.api.session`. Nothing is written until the block is entered, nor when
        a key is missing.

        Args:
            run_id: The Run's id.
            **options: The Run's terms, as :meth:`admit_run` takes them (``plan``, ``budget``,
                ``grant``, ``policy``, ``role``, ``parent``, ``tenant``, ``labels``,
                ``deadline``, ``selected_route``, ``keyless_ok``: a Run session's
                :meth:`~ledger.RunSession.child` passes ``parent`` for you), and the session's
                ``lease_ttl_s``, ``adapter`` and ``secrets``
                (:class:`~ledger.api.arguments.SessionOptions`). ``keyless_ok=True`` suits a
                host whose turns all pass their own ``send``.

        Returns:
            The session, to use as ``with led.run(...) as run:`` (``async with`` on an
            AsyncLedger).

        Raises:
            InvalidArgument: a malformed ``run_id`` or admission argument, a ``lease_ttl_s``
                out of range, an ``adapter`` of the other kind, ``secrets`` with ``adapter``;
                on entering, a route whose key cannot be resolved (nothing is recorded), and
                the errors of :meth:`admit_run` and :meth:`acquire_lease`.
            LeaseHeld: (entering) besides another executor's live lease, a session of the
                same Run open on this ledger (``fields["problem"] == "session_open"``): one
                session per Run per ledger at a time; share it between threads or tasks, or
                leave its block first. Nothing is recorded.

        Example:
            >>> with led.run("task-1", plan=routes, budget=budget) as run:  # doctest: +SKIP
            ...     answer = run.turn(Envelope(parts=[Part(content="Hello")]))
        """
        return self._session(run_id, options)

    def _session(self, run_id: str, options: SessionOptions) -> SessionT:
        """This kind's Run session on validated arguments (each public class says which)."""
        raise NotImplementedError

    # -- runs -----------------------------------------------------------------------------

    @op
    def admit_run(self, run_id: NewId, *, secrets: Secrets | None = None,
                  **admission: Unpack[Admission]) -> Flow[RunRecord]:
        """Admit a Run, freezing plan, grant, budget and policy. Idempotent per content.

        Admitting the same id again with the same content returns the first record (content
        is compared normalised: ``1`` and ``"1.00"`` are one budget). Admitted again without a
        ``policy``, a Run keeps the policy it was frozen with, even one the default preset of
        the library version that admitted it differed from (a later version may add a policy
        field, which changes the preset's hash). Nothing is sent: a Run starts when an Attempt
        is begun under its lease.

        Keys are checked before anything is recorded, where the routes name their key source:
        a route without credential profiles whose ``api_key_env`` is not set in this process's
        environment is refused, and with ``secrets`` every credential profile's secret is looked
        up through it too (a Run session passes its adapter's provider). A host that sends with
        its own secrets names no ``api_key_env`` and passes no ``secrets``, and nothing is
        checked for it.

        Args:
            run_id: The Run's id (1 to 200 printable characters, not ``.`` or ``..``).
            secrets: The :class:`~ledger.adapters.SecretProvider` the Run's sender resolves
                credential profiles with; when given, every profile's key is checked too.
            **admission: The Run's terms (:class:`~ledger.decide.admission.Admission`):
                ``plan`` and ``budget``, and optionally ``grant``, ``policy``, ``role``,
                ``parent`` (a parent's live lease, for a Child Run), ``tenant``, ``labels``,
                ``deadline``, ``selected_route``, ``keyless_ok``.

        Returns:
            The :class:`~ledger.RunRecord` as admitted (or as first admitted).

        Raises:
            InvalidArgument: an argument is wrong (an empty plan, duplicate route ids, a
                ``selected_route`` not in the plan, a Child broader than its parent in route,
                recipient, data class, role or policy, of another tenant, with a deadline
                after its parent's, ...), naming the field; or a route's key cannot be
                resolved (the route, the variable or profile, and the fixes:
                provide the key, or name the route in ``keyless_ok``); nothing is recorded.
            PolicyError: ``policy`` does not validate (a file, a name or a mapping).
            AdmissionConflict: ``run_id`` was admitted before with different content
                (``differing`` names the fields).
            NotFound: ``parent`` names a Run that does not exist.
            BudgetExceeded: a Child asks for more cost or tokens than its parent has left
                (:class:`~ledger.errors.AllowanceExhausted` for calls and retries).
            LeaseLost: the parent's lease lapsed (``FencedOut``: the parent was taken over).
            DatabaseUnavailable: the database did not answer (``fields["operation"] ==
                "admit"``). One whose connection was lost after the ``COMMIT`` was sent is
                admitted again at once (the same content is the same Run) and returns as if
                nothing happened; only when that fails too is it raised, with
                ``resolved=False``. For a Child (``parent``) it is then remembered
                (``deferred=True``): as soon as the database answers again (the parent's next
                write, its lease keeper, ``close()``), a Child that landed and that no lease
                has held since is ended ``failed`` and its carve given back to the parent, so
                admit the next Child under a new id. Any other ``DatabaseUnavailable`` wrote
                nothing (``resolved=True, landed=False``): retrying is safe.

        Example:
            >>> rec = led.admit_run("task-1", plan=[primary, backup],  # doctest: +SKIP
            ...                     budget={"max_calls": 6, "max_retries": 4, "max_cost": "0.50"},
            ...                     policy="goclaw", tenant="acme")
            >>> rec.selected_route, rec.policy_hash  # doctest: +SKIP
        """
        plan = list(admission["plan"])
        validate_plan(plan)
        keyless = keyless_ids(admission.get("keyless_ok", ()), plan)
        parent, policy = admission.get("parent"), admission.get("policy")
        prec = (yield from self._frozen(parent.run_id)) if parent is not None else None
        # Unpriced routes get the price table's price, frozen with the plan (ledger.decide.pricing);
        # a child's take its parent's frozen price.
        plan = resolve_prices(plan, cast(Budget, admission["budget"]), at=self.now(),
                              inherited=prec.plan if prec is not None else ())
        # A Child given no policy inherits its parent's; a root Run's None is the default preset.
        inherit = policy is None and prec is not None
        parent_policy = (yield from self._policy(prec.run_id)) if prec is not None else None
        pol, grant = admission_terms(
            plan, cast(Grant | None, admission.get("grant")), admission.get("role", DEFAULT_ROLE),
            None if inherit else _resolve_policy(policy), policy_hash=_policy_hash, parent=prec,
            parent_policy=parent_policy)
        # A Child's tenant, labels and deadline are its parent's (its own only narrowing them),
        # but one frozen before that rule, on terms it no longer allows (another tenant, a later
        # deadline, labels too many with its parent's), is continued as it was (invariant 5).
        terms = admission
        if prec is not None:
            earlier = yield from self._continued_child(run_id, prec, admission)
            terms = earlier if earlier is not None else child_terms(prec, admission)
        spec = admission_spec(run_id, terms, plan=plan, grant=grant, policy=pol,
                              policy_hash=_policy_hash(pol))
        # The last check before the write: every argument is known good, so a missing key is
        # the one thing this refusal is about. (The adapters, and httpx with them, are loaded
        # only for a plan that names a key source.)
        if secrets is not None or any(r.api_key_env for r in plan):
            from ledger.adapters.secrets import check_keys

            check_keys(plan, secrets, keyless_ok=keyless)
        try:
            rec, _created = yield from self._store.admit(spec, self.clock.now)
        except AdmissionConflict as e:
            if policy is not None or inherit or e.differing != ["policy_hash"]:
                raise
            # No policy was asked for: a Run admitted before keeps the one it was frozen with
            # (invariant 5). The default preset's hash moves when a version of the library
            # adds a policy field, and a Run admitted by the version before is continued.
            rec = yield from blocking(lambda: self._runs.get_run(run_id))
        return rec

    @op
    def get_run(self, run_id: Id) -> Flow[RunRecord]:
        """The Run as it stands now (frozen parts and live counters).

        Raises:
            NotFound: no Run has this id.
        """
        return (yield from blocking(lambda: self._runs.get_run(run_id)))

    @op
    def children(self, run_id: Id) -> Flow[list[RunRecord]]:
        """The Child Runs admitted under ``run_id``, oldest first (none for an unknown id)."""
        return (yield from blocking(lambda: self._runs.children(run_id)))

    @op
    def frozen_run(self, run_id: Id) -> Flow[FrozenRun]:
        """What the Run froze at admission, read once and cached: it never changes.

        Plan, grant, budget, policy, role, parent, deadline: a
        :class:`~ledger.domain.records.FrozenRun`.
        Its live counters are :meth:`get_run`'s. Each call returns a copy of its own: changing
        its lists or mappings (the policy's JSON, the labels, the plan) changes nothing the
        Run decides by.

        Raises:
            NotFound: no Run has this id.
        """
        # The cache is what the turns read (the policy is parsed from it): never handed out.
        return copy.deepcopy((yield from self._frozen(run_id)))

    def _continued_child(self, run_id: str, parent: FrozenRun,
                         admission: Admission) -> Flow[Admission | None]:
        """:func:`continued_child_terms` of the Run ``run_id`` if it exists, else ``None``.

        A read by key for each Child admitted (a cold path; the parent's was read already).
        """
        try:
            frozen = yield from self._frozen(run_id)
        except NotFound:
            return None
        return continued_child_terms(frozen, parent, admission)

    def _frozen(self, run_id: str) -> Flow[FrozenRun]:
        """:meth:`frozen_run`, for a ``run_id`` already checked."""
        frozen = self._frozen_runs.get(run_id)
        if frozen is None:
            rec = yield from blocking(lambda: self._runs.get_run(run_id))
            frozen = rec.frozen
            self._frozen_runs.put(run_id, frozen)
        return frozen

    @op
    def run_policy(self, run_id: Id) -> Flow[Policy]:
        """The policy snapshot the run froze at admission (parsed once per policy, cached).

        Each call returns a copy of its own: changing it changes nothing the Run decides by.

        Raises:
            NotFound: no Run has this id.
        """
        from ledger.policy.load import own_copy

        return own_copy((yield from self._policy(run_id)))

    def _policy(self, run_id: str) -> Flow[Policy]:
        """:meth:`run_policy`, for a ``run_id`` already checked: shared, never to be changed."""
        frozen = yield from self._frozen(run_id)
        pol = self._policies.get(frozen.policy_hash)
        if pol is None:
            pol = Policy.model_validate(frozen.policy, context=FROZEN)
            self._policies.put(frozen.policy_hash, pol)
        return pol

    def _drop_cached(self, run_id: str) -> None:
        """The Run session of ``run_id`` open on this ledger has exited: drop its cached entries.

        A long-lived process serves one Run after another, and what it read for a Run it no
        longer holds would otherwise stay until 1,024 later Runs pushed it out. They are
        caches: a later read of the Run reads it again. One session of a Run is open on a
        ledger at a time (``_open_sessions``), so its exit is the last use of them.
        """
        self._frozen_runs.drop(run_id)
        self._reads.drop(run_id)
        self._begun.drop_where(lambda begun: begun[0] == run_id)

    @op
    def close_run(self, run_id: Id, *, status: Annotated[RunStatus | str, one_of(RunStatus, ENDED)],
                  reason: Reason = "closed by an operator: nobody will resume it",
                  by: Id | None = None) -> Flow[RunRecord]:
        """End a Run nobody will resume (e.g. recovered after a crash and left ``running``).

        It takes the Run over itself, under a fresh fence (so an executor that wakes up later
        can write nothing more), ends it with ``status``, records a ``close`` event (who, why,
        the fence, the unknown Attempts that keep their holds) and releases the lease, in one
        transaction. Attempts still ``dispatching`` become ``unknown``, as recovery marks them;
        every ``unknown`` Attempt keeps its hold until it is settled. A Run its block ended is
        not closed yet (the same id would continue it): closing it with the status it ended
        with records the close. Closing a closed Run again with the same status changes
        nothing (the same call again is safe). A closed Run is never resumed: its lease is not
        taken again (``InvalidState``), so no session, ``execute`` or ``begin_attempt`` starts
        an Attempt on it. A Child Run gives back what it has left to its parent, as
        :meth:`finish_run` does.

        Args:
            run_id: The Run.
            status: ``failed``, ``cancelled``, ``stopped`` or ``succeeded`` (a
                :class:`~ledger.RunStatus` or its value); ``succeeded`` only when the Run's
                last turn was served.
            reason: Why, kept in the ``close`` event (at most 200 printable characters, not
                blank; default: "closed by an operator: nobody will resume it").
            by: Who closes it, kept in the ``close`` event as ``by`` (default: this ledger's
                ``executor_id``).

        Returns:
            The Run as closed (:class:`~ledger.RunRecord`).

        Raises:
            InvalidArgument: ``status`` is not a status a Run ends in (``field="status"``,
                the choices listed), ``reason`` is blank or not a short text, or ``by`` is
                not an identifier.
            NotFound: no Run has this id.
            LeaseHeld: a live executor holds the Run: it is being worked on (nothing changed).
            InvalidState: the Run already ended with another status, or ``succeeded`` was
                asked of a Run whose last turn was not served (nothing changed).
            DatabaseUnavailable: on PostgreSQL, the Run's row stayed locked for 10 s by
                another session's transaction (an executor paused or stuck mid-write;
                ``fields["run_id"]``, ``fields["contention"] == "55P03"``): nothing changed;
                close it again once that transaction ends.

        Example:
            >>> led.close_run("task-7", status="failed",  # doctest: +SKIP
            ...               reason="host crashed; the user retried as task-8")
        """
        from ledger.storage.recovery import RecoveryQueries

        st = RunStatus(status)
        who = self.executor_id if by is None else by
        queries = RecoveryQueries(self._store.context)
        rec, _changed = yield from blocking(
            lambda: queries.close_run(run_id, new_id("close"), st, reason, self.clock.now,
                                      by=who))
        return rec

    @op
    def finish_run(self, lease: LeaseArg,
                   status: Annotated[RunStatus | str, one_of(RunStatus, ENDED)]) -> Flow[None]:
        """Record the Run's end; its lease stays until :meth:`release_lease`.

        A Child Run gives back to its parent, in the same transaction, what it has left (its
        budget less what it posted, what its Attempts still hold and what it carved for its
        own Children): the parent may spend it, the Child never again (its ``returned_*``).

        Args:
            lease: The Run's live lease.
            status: ``succeeded``, ``failed``, ``stopped`` or ``cancelled`` (a
                :class:`~ledger.RunStatus` or its value).

        Raises:
            InvalidArgument: ``status`` is not one a Run ends in.
            LeaseLost: the lease lapsed (``FencedOut``: the Run was taken over).
            NotFound: the lease's Run does not exist.
        """
        yield from self._store.finish_run(lease, RunStatus(status), self.clock.now)

    # -- leases ---------------------------------------------------------------------------

    @op
    def acquire_lease(self, run_id: Id, *, ttl_s: LeaseTtl = DEFAULT_LEASE_TTL_S,
                      executor_id: Id | None = None) -> Flow[Lease]:
        """Take the Run's lease for ``ttl_s`` seconds: the right to write for it.

        One's own unexpired lease is renewed under the same fence; otherwise the fence moves
        on, so every write of an earlier holder is refused from now on. Keep it with
        :meth:`renew_lease` or a :class:`~ledger.api.lease.LeaseKeeper`.

        Args:
            run_id: The Run.
            ttl_s: How long the lease lasts unless renewed (above the lease margin, at most
                86 400 s).
            executor_id: Who takes it (default: this ledger's ``executor_id``).

        Returns:
            The :class:`~ledger.Lease` (run id, executor, fence, expiry).

        Raises:
            LeaseHeld: another executor holds an unexpired lease on the Run.
            InvalidState: the Run was closed (:meth:`close_run`, or recovery past its
                deadline): a closed Run is never resumed; or it ended and was admitted before
                a retention's cut-off (:meth:`drop_history`), so its history may be gone:
                it is not continued (``fields["cutoff"]``; admit a new Run). Nothing changed.
            NotFound: no Run has this id.
            InvalidArgument: ``ttl_s`` is not above the lease margin or above 86 400 s.

        Example:
            >>> lease = led.acquire_lease("task-1", ttl_s=30)  # doctest: +SKIP
            >>> lease.fence, lease.expires_at - led.now()  # doctest: +SKIP
            (1, 30.0)
        """
        check_lease_ttl(ttl_s, self._store.lease_margin_s, field="ttl_s",
                        fix="use a longer ttl_s")
        executor = self.executor_id if executor_id is None else executor_id
        return (yield from self._store.acquire_lease(run_id, executor, ttl_s, self.clock.now))

    @op
    def renew_lease(self, lease: LeaseArg, *, ttl_s: LeaseTtl = DEFAULT_LEASE_TTL_S
                    ) -> Flow[Lease]:
        """Extend a live lease by ``ttl_s`` from now, under the same fence.

        Args:
            lease: The lease as last granted or renewed.
            ttl_s: The new time left: above the lease margin (:attr:`lease_margin_s`), as
                :meth:`acquire_lease` takes it, and at most 86 400 s.

        Returns:
            The renewed :class:`~ledger.Lease`.

        Raises:
            LeaseLost: the lease lapsed (expired or released): acquire it again.
            FencedOut: another executor took the Run over.
            InvalidArgument: ``ttl_s`` is not above the lease margin or above 86 400 s (a
                lease renewed so short would be lost at the next write). Nothing changed.
        """
        check_lease_ttl(ttl_s, self._store.lease_margin_s, field="ttl_s",
                        fix="use a longer ttl_s")
        return (yield from self._store.renew_lease(lease, ttl_s, self.clock.now))

    @op
    def release_lease(self, lease: LeaseArg) -> Flow[None]:
        """Give the lease up. Releasing an already released lease does nothing.

        Args:
            lease: The Run's lease.

        Raises:
            InvalidState: Attempts of the Run are still in flight: settle them (or
                :meth:`mark_unknown`) first.
            LeaseLost: the lease is no longer live; there is nothing of it to release.
            FencedOut: another executor took the Run over.
        """
        yield from self._store.release_lease(lease, self.clock.now)

    @op
    def reserve_retry(self, lease: LeaseArg, data: AuditData | None = None) -> Flow[int]:
        """Take one bounded retry permission from the run; returns how many are left.

        The retry owner takes them inside :meth:`begin_attempt` (``take_retry``) instead; this
        is for a host that drives retries itself.

        Args:
            lease: The Run's live lease.
            data: Recorded with the permission as a ``retry_permission`` audit event (e.g. the
                route and cause); a mapping with string keys of JSON data.

        Raises:
            AllowanceExhausted: the Run has no retry permission left.
            LeaseLost: the lease lapsed (``FencedOut``: the Run was taken over).
        """
        return (yield from self._store.reserve_retry(lease, self.clock.now, data))

    # -- attempts -------------------------------------------------------------------------

    @op
    def begin_attempt(
        self,
        lease: LeaseArg,
        *,
        route: RouteRef,
        envelope_hash: Hash,
        reserve: Money,
        reserve_tokens: Tokens = 0,
        turn_id: Id = "turn-1",
        profile_id: Id | None = None,
        kind: Annotated[AttemptKind | str, one_of(AttemptKind)] = AttemptKind.FIRST,
        attempt_id: NewId | None = None,
        events: Events = (),
        take_retry: Flag = False,
    ) -> Flow[AttemptRecord]:
        """Record an Attempt (debit held, capacity slot taken) before its request is sent.

        One transaction checks the live lease, the Run's allowances and budget, and the
        capacity group's admission; a refusal by the group is recorded (a ``rejected``
        Attempt, its hold voided) and then raised. Retrying with the same ``attempt_id`` and
        arguments, also after acquiring the lease again, is the same write. The retry owner
        (:func:`ledger.execute`) calls this for every Attempt it makes.

        It sees the envelope's hash only, so it checks no disclosure (invariant 7): a host
        that calls it directly runs preflight first and sends nothing it refuses,
        ``preflight(route, envelope, grant=frozen.grant, role=frozen.role,
        provenance=led.provenance(run_id)).require()``
        (:func:`ledger.decide.preflight.preflight`, ``frozen`` from :meth:`frozen_run`),
        as the retry owner does for every candidate.

        Args:
            lease: The Run's live lease.
            route: The route to use: an id of the Run's frozen plan, or the frozen
                :class:`~ledger.Route` itself.
            envelope_hash: The request's hash (``Envelope.hash``), recorded with the Attempt.
            reserve: The cost hold (a Decimal, an int or a decimal string), posted or voided
                at settle.
            reserve_tokens: The token hold, checked against the Run's ``max_tokens``.
            turn_id: The logical turn the Attempt serves.
            profile_id: The credential profile it uses (one of the route's), if any.
            kind: Why it is made: ``first``, ``retry``, ``failover`` or ``probe``.
            attempt_id: Its id (default: a new one); pass one to make a retried begin the
                same write.
            events: Audit events written in the same transaction, as ``(kind, data)`` pairs
                (the retry owner writes the selector's decision this way); each data a mapping
                with string keys of JSON data.
            take_retry: Take one retry permission in the same transaction (every further
                Attempt of a turn does).

        Returns:
            The :class:`~ledger.AttemptRecord`, ``dispatching``. Its ``created_at`` is the
            time of the decision; in a limited group on PostgreSQL, the time its slot was
            taken (the clock read again after the claim, the lease judged live at it).

        Raises:
            InvalidArgument: a route not in the Run's frozen plan (or differing from its
                snapshot), a profile that is not the route's, or another wrong argument.
            AllowanceExhausted: no model call (or, with ``take_retry``, no retry permission)
                is left.
            BudgetExceeded: the hold would overdraw the Run's cost or token budget.
            CapacityUnavailable: the capacity group refused it (the rejection is recorded).
            Conflict: ``attempt_id`` is already recorded with different content.
            LeaseLost: the lease lapsed (``FencedOut``: the Run was taken over).
            NotFound: the lease's Run does not exist.
        """
        run = yield from self._frozen(lease.run_id)
        spec = begin_spec(
            run, lease, route=route, profile_id=profile_id, envelope_hash=envelope_hash,
            reserve_micros=to_micros(reserve), reserve_tokens=reserve_tokens, turn_id=turn_id,
            kind=AttemptKind(kind), attempt_id=attempt_id or new_id("att"),
            events=cast(list[tuple[str, dict[str, Any]]], events), take_retry=take_retry)
        try:
            rec = yield from self._store.begin_attempt(spec, self.clock.now)
        except DatabaseUnavailable as e:
            if e.fields.get("commit") == "unknown":
                # "Safe to retry" holds for the same write only: a begin retried under a new
                # id is another Attempt, and this one may have landed and stay dispatching.
                e.add_note(f"retry the begin with attempt_id={spec.attempt_id!r} (the same "
                           "write, idempotent); under a new id this one, if it landed, stays "
                           "dispatching with its hold")
            raise
        assert isinstance(rec, AttemptRecord)  # a begin without queue_until never queues
        self._begun.put(rec.attempt_id,
                        (rec.run_id, rec.route_id, rec.profile_id, rec.created_at))
        return rec

    @op
    def settle_attempt(
        self,
        lease: LeaseArg,
        attempt_id: Id,
        *,
        outcome: Annotated[Outcome | str, one_of(Outcome)],
        fact: Annotated[FailureFact | Mapping[str, Any] | None, As(FailureFact | None)] = None,
        observation: Annotated[Observation | Mapping[str, Any] | None,
                               As(Observation | None)] = None,
        prompt_tokens: Tokens | None = None,
        completion_tokens: Tokens | None = None,
        cost: Money | None = None,
        effective_output: Flag | None = None,
        tool_started: Flag | None = None,
        model_reported: Text | None = None,
        output_hash: Hash | None = None,
        events: Events = (),
        provenance_hashes: PartHashList = (),
        repeat: Flag = False,
        cached_tokens: Tokens | None = None,
        reasoning_tokens: Tokens | None = None,
        first_byte_s: SendTime | None = None,
        first_token_s: SendTime | None = None,
    ) -> Flow[AttemptRecord]:
        """Record an Attempt's outcome; health and group facts update in the same transaction.

        A settled Attempt is never rewritten: the same settle again returns it, a different one
        is refused. The settle is accepted under the fence the Attempt was begun with even after
        the lease expired (the outcome is the truth); once the Run was taken over it is refused
        and kept as a ``late_receipt`` event.

        Args:
            lease: The lease the Attempt was begun under.
            attempt_id: The Attempt.
            outcome: ``succeeded``, ``failed`` (with a ``fact`` or an ``observation`` to
                classify), ``unknown`` (sent, no receipt: the hold stays) or ``not_sent``
                (provably never left: the hold is voided and the call given back; a failure
                whose phase is ``before_send`` is recorded as not sent).
            fact: The classified failure (a :class:`~ledger.FailureFact`).
            observation: Raw evidence to classify under the Run's policy instead of a fact.
            prompt_tokens: Usage the provider reported (``None``: not reported; none with
                ``not_sent``, which used nothing).
            completion_tokens: Likewise.
            cost: The cost of the call, posted (at most the hold); ``None``: the whole hold is
                posted, even when tokens are given (this settle does not price them: pass
                e.g. ``route.cost(prompt_tokens, completion_tokens)``; a Run session's turns
                and ``settle_unknown`` price the usage themselves).
            effective_output: Whether output reached the caller (default: the fact's).
            tool_started: Whether the host started a tool it proposed (default: the fact's).
            model_reported: The model the provider says served it (on a failure, the one it
                named before failing); covered by the settle hash like the rest of the receipt.
            output_hash: The answer's content hash.
            events: Audit events written in the same transaction, as ``(kind, data)`` pairs
                (data: JSON data, a mapping with string keys).
            provenance_hashes: The hashes of the answer's parts (each its
                ``Part.content_hash``, ``sha256:`` and 64 hex digits), recorded as this Attempt's
                provenance (so the next turn may carry them) by a ``succeeded`` settle. This
                is the only way to record them: :meth:`record_provenance` refuses an Attempt's
                id, so nothing is added once the Attempt is settled.
            repeat: The Attempt was a same-route retry of a failure this request already
                counted in health, so its failure restarts the key's window without counting
                again (unless the policy's ``health.count_same_route_retries`` says every try
                counts).
            cached_tokens: The part of ``prompt_tokens`` the provider served from its cache,
                where it reports it (at most ``prompt_tokens``).
            reasoning_tokens: The part of ``completion_tokens`` spent reasoning, where the
                provider reports it (at most ``completion_tokens``).
            first_byte_s: Seconds from the begin to the response's first byte, by the
                ledger's clock (a send's ``progress.first_byte_at`` minus the Attempt's
                ``created_at``); kept within the latency the settle records.
            first_token_s: Seconds from the begin to a stream's first content (not before
                ``first_byte_s``).

        The settle records the Attempt's ``latency_s``: from its begin to this settle, by the
        ledger's clock.

        Returns:
            The settled :class:`~ledger.AttemptRecord`.

        Raises:
            InvalidArgument: ``failed`` without a fact or observation, ``succeeded`` with
                one, usage or a cost for a call recorded ``not_sent`` (it used nothing), event
                data that is not JSON data, a provenance hash that is not a part's content
                hash, or another wrong argument. Nothing was written.
            NotFound: the Attempt does not exist, or is not one of the lease's Run.
            SettleConflict: it was settled before with different content (an ``unknown``
                one is settled with evidence by :meth:`settle_unknown`).
            InvalidState: it was rejected before dispatch: there is nothing to settle.
            FencedOut: the Run was taken over since the Attempt began (the outcome is kept as
                a late receipt).
        """
        usage: dict[str, object] = {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "cached_tokens": cached_tokens, "reasoning_tokens": reasoning_tokens, "cost": cost}
        if outcome is Outcome.NOT_SENT:
            _used_nothing("outcome not_sent", usage)
        _within(cached_tokens, "cached_tokens", prompt_tokens, "prompt_tokens")
        _within(reasoning_tokens, "reasoning_tokens", completion_tokens, "completion_tokens")
        if first_byte_s is not None and first_token_s is not None and first_token_s < first_byte_s:
            raise InvalidArgument(
                f"first_token_s ({first_token_s:g}) is before first_byte_s ({first_byte_s:g}); "
                "content comes after the response's first byte: pass times measured from the "
                "begin", field="first_token_s")
        # The Attempt's route and profile decide which health rows its outcome touches, and its
        # begin's time whether its failure is one of an outage already counted: as this ledger
        # began it, or read (an Attempt begun by another process or ledger).
        begun = self._begun.get(attempt_id)
        if begun is None:
            att = yield from self._store.attempt(attempt_id)
            begun = (att.run_id, att.route_id, att.profile_id, att.created_at)
        run_id, route_id, profile_id, began_at = begun
        if run_id != lease.run_id:
            raise NotFound(f"attempt {attempt_id!r} does not belong to run {lease.run_id!r}",
                           attempt_id=attempt_id, run_id=lease.run_id)
        run = yield from self._frozen(lease.run_id)
        policy = yield from self._policy(lease.run_id)
        spec = settle_spec(
            policy, run.route(route_id), profile_id, lease, attempt_id,
            outcome=Outcome(outcome), fact=cast(FailureFact | None, fact),
            observation=cast(Observation | None, observation), now=self.now(),
            effective_output=effective_output, tool_started=tool_started,
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            cost_micros=None if cost is None else to_micros(cost),
            model_reported=model_reported, output_hash=output_hash,
            events=cast(list[tuple[str, dict[str, Any]]], events),
            provenance=tuple(provenance_hashes), repeat=repeat, cached_tokens=cached_tokens,
            reasoning_tokens=reasoning_tokens, first_byte_s=first_byte_s,
            first_token_s=first_token_s, began_at=began_at)
        if spec.outcome is Outcome.NOT_SENT and outcome is not Outcome.NOT_SENT:
            # A failure that never left (phase before_send, or an observation of a request not
            # sent) is recorded as not sent, and used nothing either.
            _used_nothing("a failure that never left (phase before_send, recorded as not_sent)",
                          usage)
        rec = yield from self._store.settle_attempt(lease.run_id, spec, self.clock.now)
        # Settled: nothing asks for it again but a repeated settle, which reads it.
        self._begun.drop(attempt_id)
        return rec

    @op
    def mark_unknown(self, lease: LeaseArg, attempt_id: Id,
                     reason: StrictStr) -> Flow[AttemptRecord]:
        """Settle a dispatched Attempt as unknown (sent, no receipt): its hold stays.

        For a graceful shutdown with a call still out. An Attempt already settled is returned
        as it is. Unknown Attempts are never sent again, by anyone.

        Args:
            lease: The lease the Attempt was begun under.
            attempt_id: The Attempt.
            reason: Why no receipt came (kept in the ``unknown`` event, at most 200
                characters).

        Returns:
            The Attempt as recorded.

        Raises:
            NotFound: the Attempt is not one of the lease's Run.
            FencedOut: the Run was taken over, or the Attempt was begun under another fence
                (recovery marks it).
        """
        return (yield from self._store.mark_unknown(lease, attempt_id, self.clock.now,
                                                    reason[:200]))

    @op
    def settle_unknown(self, attempt_id: Id, *,
                       outcome: Annotated[Outcome | str, one_of(Outcome, _FINAL)],
                       prompt_tokens: Tokens | None = None, completion_tokens: Tokens | None = None,
                       cost: Money | None = None, note: Evidence,
                       by: Id | None = None) -> Flow[AttemptRecord]:
        """Settle an ``unknown`` Attempt with evidence: an operator's late receipt.

        An unknown Attempt (sent, no receipt) keeps its hold until someone knows better, e.g.
        from the provider's usage console or billing export. This records that evidence: the
        Attempt's state moves from ``unknown`` to ``outcome`` exactly once, its hold is posted
        (``succeeded``/``failed``: the evidenced cost, at most the hold, the rest released;
        without a cost or usage the whole hold) or voided (``not_sent``: it never ran, and the
        model call is given back), the Run's counters follow, and a ``late_receipt`` event
        (``applied``) keeps who, what, why and the previous state beside the Attempt. Its
        recorded fact, output flags and route health are left as observed.

        No lease is needed: the Run may be closed, or held by nobody. It cannot race a live
        executor, because only an ``unknown`` Attempt is accepted (an executor never writes
        to one again) and the write runs under the Run's row lock.

        Args:
            attempt_id: The unknown Attempt (``failover-ledger attempts --open`` lists them).
            outcome: What the evidence shows: ``succeeded``, ``failed`` or ``not_sent``.
            prompt_tokens: The prompt tokens the provider billed, if known. The evidence
                replaces the usage whole: what an unknown Attempt carried of a cut-off answer
                (its tokens, cached and reasoning parts included) is not kept.
            completion_tokens: The completion tokens it billed, if known.
            cost: What it cost (a Decimal, int or decimal string); default: the usage at the
                Attempt's frozen route price, or the whole hold when no usage is given.
            note: Why, for the audit (the evidence: a console link, a ticket): required, at
                most 500 characters, not blank.
            by: Who records it (default: this ledger's ``executor_id``).

        Returns:
            The Attempt as settled now.

        Raises:
            InvalidArgument: ``outcome`` is not one of the three; a count or cost that is
                negative or absurd (over 10^15 tokens, over 10^12), or usage with
                ``not_sent``; a ``note`` missing, blank or not short printable text; a ``by``
                that is not an identifier.
            NotFound: no Attempt has this id.
            InvalidState: the Attempt is not ``unknown`` (its state is named): settled
                Attempts are never rewritten, and one still dispatching is its executor's.

        Example:
            >>> led.settle_unknown("att-9f2c", outcome="succeeded", prompt_tokens=812,
            ...     completion_tokens=240, note="provider console, req 7a1")  # doctest: +SKIP
        """
        amount = None if cost is None else Decimal(cost)
        who = self.executor_id if by is None else by
        if outcome is Outcome.NOT_SENT:
            for name, value in (("prompt_tokens", prompt_tokens),
                                ("completion_tokens", completion_tokens), ("cost", amount)):
                if value is not None:
                    raise InvalidArgument(
                        f"{name} given with outcome not_sent: a request that never ran used and "
                        "cost nothing; drop it, or settle as succeeded or failed", field=name)
        if amount is None and (prompt_tokens is not None or completion_tokens is not None):
            att = yield from self._store.attempt(attempt_id)
            route = (yield from self._frozen(att.run_id)).route(att.route_id)
            priced = route.cost(prompt_tokens or 0, completion_tokens or 0)
            if not amount_in_range(priced):
                raise InvalidArgument(
                    f"the usage costs {priced} at the price of route {route.id!r}, beyond any "
                    "amount the ledger records; check the token counts, or pass cost=",
                    field="completion_tokens" if completion_tokens else "prompt_tokens")
            amount = priced
        spec = ReceiptSpec(attempt_id=attempt_id, outcome=Outcome(outcome),
                           prompt_tokens=prompt_tokens,
                           completion_tokens=completion_tokens,
                           cost_micros=None if amount is None else to_micros(amount),
                           by=who, note=note)
        return (yield from blocking(lambda: self._runs.settle_unknown(spec, self.clock.now)))

    @op
    def turn_snapshot(self, run_id: Id, refs: IdList = ()) -> Flow[TurnSnapshot]:
        """Everything one routing decision reads, in one read transaction.

        The Run as it stands, its frozen policy, its groups' projections, its routes' and
        profiles' health, and the provenance of ``refs`` recorded anywhere in the Run's tree
        (see :meth:`provenance`): every content hash any Run of the tree recorded for each
        (a second read, of the whole tree, once ``refs`` is not empty; a turn reads it only
        for a ref the Run and its ancestors did not record with the content it carries).

        Args:
            run_id: The Run.
            refs: The producer references (``Part.provenance``) whose recorded hashes the
                decision's disclosure check needs: those of parts that need provenance (a turn
                passes no reference of an exempt part, the user's own input or system text).

        Returns:
            A :class:`~ledger.decide.effects.TurnSnapshot`. Its ``policy`` is a copy of its
            own: changing it changes nothing any Run decides by.

        Raises:
            NotFound: no Run has this id.
        """
        from dataclasses import replace

        from ledger.policy.load import own_copy

        snap = yield from self._snapshot(run_id, tuple(refs))
        # The turns' snapshot carries the policy every Run frozen under it shares.
        return replace(snap, policy=own_copy(snap.policy))

    def _snapshot(self, run_id: str, refs: tuple[str, ...], turn_id: str | None = None,
                  carried: tuple[tuple[str, str], ...] | None = None) -> Flow[TurnSnapshot]:
        """:meth:`turn_snapshot` of arguments the turn loop made itself (not checked again).

        ``carried``: the turn's (ref, content hash) pairs (``None``: every ref's whole tree).
        """
        frozen = yield from self._frozen(run_id)
        policy = yield from self._policy(run_id)
        reads = self._reads.get(run_id)
        if reads is None:
            chain = [run_id]
            anc = frozen
            while anc.parent_run_id is not None:
                chain.append(anc.parent_run_id)
                anc = yield from self._frozen(anc.parent_run_id)
            groups = sorted({r.group for r in frozen.plan})
            keys = sorted({route_key(r, policy) for r in frozen.plan}
                          | {p.id for r in frozen.plan for p in r.profiles})
            reads = (tuple(chain), tuple(groups), tuple(keys))
            self._reads.put(run_id, reads)
        chain_, groups_, keys_ = reads
        snap = yield from self._store.turn_snapshot(run_id, groups_, keys_, chain_, refs,
                                                    self.clock.now, turn_id, carried)
        # Imported here: the turn's effects are no part of a ledger opened only to read.
        from ledger.decide.effects import TurnSnapshot

        health = {k: as_read(h, snap.now) for k, h in snap.health.items()}
        return TurnSnapshot(run=run_live(frozen, snap.run), policy=policy, groups=snap.groups,
                            health=health, provenance=snap.provenance, now=snap.now,
                            unreceipted=snap.unreceipted)

    # -- groups, health, provenance, events -------------------------------------------------

    @op
    def configure_group(self, group: Id, *, max_in_flight: Annotated[int, integers(1)] | None
                        ) -> Flow[None]:
        """Set a capacity group's concurrency limit, creating the group if it is new.

        Args:
            group: The group id (``Route.group``).
            max_in_flight: How many Attempts of live leases may be in flight at once in the
                group, across every process (``None``: unlimited).

        Raises:
            InvalidArgument: ``max_in_flight`` below 1 (or not an integer).
        """
        now = self.now()
        yield from blocking(lambda: self._runs.configure_group(group, max_in_flight, now))

    @op
    def set_group_state(self, group: Id, mode: Annotated[GroupMode | str, one_of(GroupMode)], *,
                        until: Time | None, reason: Text = "operator") -> Flow[None]:
        """Set a group's mode by hand (an operator's cooldown or outage notice).

        Args:
            group: The group id.
            mode: ``open``, ``cooldown`` or ``unavailable`` (a :class:`~ledger.GroupMode`).
            until: When the mode ends (epoch seconds; ``None``: until changed again).
            reason: Why, for the audit and the dashboard.

        Raises:
            InvalidArgument: an unknown ``mode``, an ``until`` that is not a usable time.
        """
        upd, now = GroupUpdate(GroupMode(mode), until, reason), self.now()
        yield from blocking(lambda: self._runs.set_group_mode(group, upd, now))

    @op
    def clear_cooldown(self, key: HealthKey, *, reason: Reason, by: Id | None = None,
                       group: Flag = False) -> Flow[EventRecord]:
        """Clear a cooldown at an operator's word: the key is available again at once.

        A route, credential profile or ``provider:<name>`` health key (``group=False``) is
        made available and its counters start again from zero (cooldown, disable, error and
        failure counts, failures below the cooling threshold; when it was last used, failed
        and probed stays). A capacity group (``group=True``) is opened: its mode ``open``, its
        waiting floor and reason gone. In the same transaction a ``clear_cooldown`` event (of
        no Run) records who, why and what was cleared; ``Audit.actions`` lists it. Runs
        already admitted read the cleared state at their next turn; the next failure counts
        from one again.

        Args:
            key: The health key (``failover-ledger health`` lists them), or the group id with
                ``group=True``.
            reason: Why (kept in the event; at most 200 printable characters, not blank).
            by: Who clears it (default: this ledger's ``executor_id``).
            group: ``key`` names a capacity group.

        Returns:
            The ``clear_cooldown`` event as recorded (its ``data``: ``key``, ``kind``,
            ``by``, ``reason`` and ``previous``, what was cleared).

        Raises:
            InvalidArgument: ``key`` is not a health key (1 to 609 printable characters) or
                ``by`` not an identifier, ``reason`` is blank or not a short text, ``group``
                is not a bool.
            NotFound: no health is recorded for ``key`` (it never failed), or no such group.
            InvalidState: there is nothing to clear: the key is available and counts no
                failure, or the group is open (nothing recorded).

        Example:
            >>> led.clear_cooldown("openai-gpt", reason="provider says the incident is over",
            ...                    by="alice")  # doctest: +SKIP
        """
        who = self.executor_id if by is None else by
        clock = self.clock.now
        if group:
            return (yield from blocking(lambda: self._runs.clear_group(key, who, reason, clock)))
        return (yield from blocking(lambda: self._runs.clear_health(key, who, reason, clock)))

    @op
    def drop_history(self, older_than: Annotated[float, retention_age], *,
                     reason: Reason = "retention", by: Id | None = None,
                     dry_run: Flag = False) -> Flow[Retention]:
        """Drop the history of finished Runs older than ``older_than`` seconds (retention).

        On PostgreSQL, whose history is partitioned by month, each partition of ``attempts``
        and ``events`` whose month ended at least ``older_than`` ago is dropped
        whole; on SQLite the same rows are deleted one by one. Never the rows of a *held*
        Run: one still live (``admitted`` or ``running``), an ended one whose lease is live
        by the ledger clock (a session resumed it), or one with an Attempt still ``unknown``
        or ``dispatching`` (on PostgreSQL a partition holding any such row stays whole, and
        the report says why). Operators' action events are never dropped. Runs,
        debits and provenance stay. In the same transaction a ``retention`` event (of no
        Run) records who, why, the cut-off and what went (partitions and rows);
        ``Audit.actions`` lists it. On SQLite the rows go in slices of at most 5,000
        attempts (with the events of their time), oldest first, each its own transaction
        with its own event, and the write lock is let go between them, so the ledger's
        writers wait for one slice, not the whole run; the report sums the slices and
        ``event`` is the last slice's. On PostgreSQL the coming months' partitions are created
        first. A run with nothing to drop still records its event. Two runs at once take
        turns (on PostgreSQL an advisory lock, on SQLite the write lock): the second plans from
        what the first left, so it drops nothing more and carries nothing twice.

        Args:
            older_than: Age in seconds, from 86 400 (one day) to 3 153 600 000 (36 500 days):
                history from before the ledger clock's now less this goes.
            reason: Why, kept in the event (at most 200 printable characters, not blank).
            by: Who runs it, kept in the event (default: this ledger's ``executor_id``).
            dry_run: Only report what would go; nothing is dropped or recorded. It only
                reads (on PostgreSQL plain ``SELECT`` statements, on SQLite a read
                transaction that waits for no writer): a role that may only read the
                ledger's tables, or a process that may only read the SQLite file, may run it.

        Returns:
            The :class:`~ledger.domain.records.Retention` report (``dropped``, ``kept``, the
            ``event`` recorded).

        Raises:
            InvalidArgument: ``older_than`` is not a number of seconds from a day to 36 500
                days (``field="older_than"``), ``reason`` or ``by`` is not a short text.
            DatabaseUnavailable: a table stayed locked longer than the retention's lock
                timeout, or another retention run held the retention lock that long
                (``fields["contention"] == "55P03"``); or, on PostgreSQL, a session resumed
                an ended Run of a partition about to go after it was checked
                (``fields["contention"] == "40001"``); nothing was dropped (run it again).
            DatabaseSetupError: on PostgreSQL, a role that does not own the ledger's tables
                (``problem="schema_privilege"``; the message names the owner to run it as),
                unless ``dry_run``; nothing was dropped or recorded.

        Example:
            >>> led.drop_history(90 * 86400, by="alice", dry_run=True)  # doctest: +SKIP
        """
        from ledger.storage.retention import RetentionQueries

        who = self.executor_id if by is None else by
        return (yield from blocking(lambda: RetentionQueries(self._store.context).run(
            older_than, self.clock.now, by=who, reason=reason, dry_run=dry_run)))

    @op
    def roll_up(self, *, lag: RollupLag = 300.0,
                max_hours: Annotated[int, integers(1)] | None = None,
                fold_after: FoldAfter | None = DEFAULT_FOLD_AFTER_S) -> Flow[Rollup]:
        """Roll up the history's finished hours, for the audit's totals (a job: cron it).

        Run it every few minutes (``failover-ledger rollup`` from cron, or a scheduler).

        For each hour (``[3600*h, 3600*(h+1))`` of the attempts' ``created_at``) that ended
        at least ``lag`` seconds before the ledger clock's now and is not rolled up, writes
        the sums over its attempts not in flight by route, group, provider, tenant and labels, in
        one transaction per hour, oldest first (hours without attempts are marked in
        batches). ``Audit.costs`` (but by run) then reads those sums for the rolled hours
        inside its window instead of their attempts, and reads the rest (the window's
        edges, hours not rolled, attempts still ``dispatching``) as before:
        the answers are the same, cheaper. Any later write to an
        attempt of a rolled hour (a late settle or begin, an operator's resolution, retention)
        undoes that hour's roll-up in the same transaction, and the next roll-up redoes it.

        Then each UTC day that ended at least ``fold_after`` ago and whose hours are all rolled
        is folded: its hours' sums become one set of rows for the day, so that reads over the
        whole history (``/metrics``, the totals since the start) read one set per old day
        instead of 24 and stay nearly flat as the history grows. A window or bucket that
        holds only part of a folded day reads that day from the attempts; a write to an
        attempt of the day undoes the whole day, which the next roll-ups redo.

        Args:
            lag: How long after its end an hour is rolled up, in seconds (default 300: an
                hour still being settled would be rolled and undone again); at most 7 days
                (:data:`~ledger.domain.bounds.MAX_LAG_S`: a longer one only leaves the sums
                unwritten, and is a slip of the unit), as ``failover-ledger rollup --lag``.
            max_hours: Roll up at most this many hours in this call (the oldest; the rest
                are ``pending`` in the report). Default: every hour due.
            fold_after: How long after its end a day is folded, in seconds (default 8 days:
                the dashboard's charts of up to a week count in buckets of hours); at most
                366 days (:data:`~ledger.domain.bounds.MAX_FOLD_AFTER_S`, as ``rollup
                --fold-after``); ``None``: fold nothing.

        Returns:
            The :class:`~ledger.domain.records.Rollup` report.

        Raises:
            InvalidArgument: ``lag`` is not seconds from 0 to 7 days, ``fold_after`` not
                seconds from 0 to 366 days (nor ``None``), ``max_hours`` not an integer of at
                least 1.

        Example:
            >>> led.roll_up()  # doctest: +SKIP
            Rollup(hours=24, rows=13968, pending=0, until=1796000400.0, days=1)
        """
        from ledger.storage.rollups import RollupQueries

        return (yield from blocking(lambda: RollupQueries(self._store.context).roll(
            self.clock.now, lag_s=lag, max_hours=max_hours, fold_after_s=fold_after)))

    @op
    def group_projections(self, groups: IdList | None = None
                          ) -> Flow[dict[str, GroupProjection]]:
        """Admission's view of the named capacity groups (``None``: every known group).

        A group nobody configured or reported on is absent (it is open and unlimited).
        """
        wanted, now = None if groups is None else list(groups), self.now()
        return (yield from blocking(lambda: self._runs.group_projections(wanted, now)))

    @op
    def health(self, keys: HealthKeyList | None = None) -> Flow[dict[str, Health]]:
        """Health rows as they stand now: counters past their reset time read as reset.

        Args:
            keys: The keys to read (route ids, profile ids, ``provider:<name>``); ``None``:
                every row. A key with no row (never failed) is absent. A provider's row is
                stored (and returned) under its name case-folded, ``provider:openai``;
                ``provider:OpenAI`` reads it too.
        """
        wanted, now = None if keys is None else list(keys), self.now()
        rows = yield from blocking(lambda: self._runs.health(wanted))
        return {k: as_read(h, now) for k, h in rows.items()}

    @op
    def claim_probe(self, route: Annotated[Route, instance(Route, "a ledger.Route",
                                                           "pass a ledger.Route")],
                    interval_s: Annotated[float, duration()], *, key: HealthKey | None = None,
                    ttl_s: Annotated[float, duration(positive=True)] | None = None,
                    max_keys: Annotated[int, integers(1)] | None = None) -> Flow[bool]:
        """Take the cluster-wide probe slot of ``route``: True for one caller per interval.

        A claim taken also bounds the probe state: times ``ttl_s`` old are forgotten and at
        most ``max_keys`` keys keep one (GoClaw's probe state TTL and key limit).

        Args:
            route: The cooling route to probe.
            interval_s: The least time between two probes of the key.
            key: The health key the probe state lives under (default: the route id; the
                retry owner passes the policy's key, e.g. ``provider:<name>``, whose name is
                matched case-insensitively: one probe slot per provider).
            ttl_s: Probe times at least this old are forgotten (``None``: kept).
            max_keys: At most this many keys keep a probe time (``None``: no limit).

        Returns:
            Whether this caller got the slot (and so may send the probe).

        Raises:
            InvalidArgument: ``key`` is not a health key, or a ``provider:<name>`` whose name
                folds longer than any route's key (its ``field`` is ``key``).
        """
        # A provider key spelled as the route's provider is: the row its settles write.
        k = route.id if key is None or key == route.id else canonical_key(key)
        if len(k) > MAX_HEALTH_KEY_LENGTH:
            # Folding lengthened it past any key a route's health is kept under (a provider
            # name longer than a Route takes): no row could hold it.
            raise InvalidArgument(f"key (provider:<name>, {len(key or '')} characters) folds to "
                                  f"{len(k)}, more than the {MAX_HEALTH_KEY_LENGTH} of any "
                                  "route's health key; pass provider:<the route's provider> "
                                  "or a key `failover-ledger health` lists", field="key")
        return (yield from self._store.claim_probe(k, route.provider, self.now(), interval_s,
                                                   kind=probe_key_kind(route, k), ttl_s=ttl_s,
                                                   max_keys=max_keys))

    @op
    def record_compaction(self, lease: LeaseArg) -> Flow[int]:
        """Record that the host compacted the Run's session (its context was summarised).

        Under a policy with ``profiles.sticky`` the auto-pinned credential profile is dropped:
        the next turn chooses again (Fased: the pinned profile is reused until "a compaction
        completes (compaction count increments)"). A user pin is kept.

        Args:
            lease: The Run's live lease.

        Returns:
            The Run's compaction count.

        Raises:
            LeaseLost: the lease lapsed (``FencedOut``: the Run was taken over).
        """
        return (yield from self._store.record_compaction(lease, self.clock.now))

    @op
    def record_provenance(self, lease: LeaseArg, ref: Id, content_hash: Hash,
                          kind: Annotated[str, text(16, empty=False, fix="pass a non-empty "
                                                    "kind such as 'memory'")] = "tool_result"
                          ) -> Flow[None]:
        """Record that ``ref`` (a tool-call id, a document's id, ...) produced ``content_hash``.

        A later part with ``provenance=ref`` and this exact content is then covered for
        disclosure preflight anywhere in this Run's tree (see :meth:`provenance`), for the
        recipients each Run's grant approves for its class.

        This is how a host vouches for what it brings: a tool's result it ran itself, a
        user's upload, a memory. A model's output is not among them: the ledger records
        it when the Attempt settles (the retry owner's settle, or :meth:`settle_attempt`'s
        ``provenance_hashes``, once), and a settled Attempt is never added to. So ``kind``
        may not be ``model_output`` nor ``tool_call``, and ``ref`` may not be the id of any
        Attempt, of this Run or another (checked in the write's transaction).

        The ledger is given a hash, not the part, so it cannot tell an assistant part's hash
        from a document's: a host that records the hash of a ``role="assistant"`` part under
        a ref of its own covers that part, as it covers anything it records. The ledger's
        guarantee for model output is that the parts a turn returned (``result.parts``) are
        covered as they are, and an edited copy under their Attempt's id is not.

        Args:
            lease: The Run's live lease.
            ref: The producer reference (a tool-call id, a memory or document id); not an
                Attempt id.
            content_hash: The content's ``Part.content_hash``.
            kind: What produced it (``tool_result``, ``document``, ``memory``, or a kind of
                the host's own; at most 16 characters; not ``model_output`` nor
                ``tool_call``, which only the ledger records).

        Raises:
            InvalidArgument: ``kind`` is one only the ledger records (``field="kind"``), or
                ``ref`` is an Attempt id (``field="ref"``). Nothing was written.
            LeaseLost: the lease lapsed (``FencedOut``: the Run was taken over).
        """
        if kind in LEDGER_PROVENANCE_KINDS:
            raise InvalidArgument(
                f"kind {kind!r} is recorded only by the ledger: a model's output is recorded "
                "when its Attempt settles (the retry owner's settle, or settle_attempt("
                "provenance_hashes=...)), never afterwards; carry the parts a turn returned "
                "as they are, and record what the host brings with a kind of its own "
                "('tool_result', 'document', 'memory')", field="kind")
        yield from self._store.record_provenance(lease, ref, content_hash, kind, self.clock.now)

    @op
    def _record_tool_call(self, lease: LeaseArg, attempt_id: Id, content_hash: Hash
                          ) -> Flow[None]:
        """Record a tool call the integrations renamed as its Attempt's output.

        ``attempt_id`` must be an Attempt of the lease's Run. The renamed call is the model's
        proposal under a Run-unique id: the output the settle recorded, as a part with
        another hash. Not for hosts (:meth:`record_provenance` refuses Attempt ids).
        """
        yield from self._store.record_provenance(lease, attempt_id, content_hash, "tool_call",
                                                 self.clock.now, own_attempt=True)

    @op
    def provenance(self, run_id: Id, *, tree: Flag = True) -> Flow[dict[str, set[str]]]:
        """The provenance a part carried in this Run's turns is judged by: ref -> content hashes.

        By default that is what the ledger recorded anywhere in the Run's tree: its root Run
        and every descendant of the root (the Run itself, its parent and ancestors, its
        Children and their siblings). One agent task spans the tree, so a child's answer
        (``result.parts``) is covered in its parent's next turn and, passed on by the parent,
        in a sibling's. A ref several Runs of the tree recorded with different content (a
        tool-call id a provider reused) holds every one of those hashes, and a part with any
        of them is covered in every Run of the tree. Coverage only says the ledger recorded
        that exact content; each turn's grant still decides which recipients may receive its
        class. A Run of another tree records nothing that covers this one.

        Args:
            run_id: The Run.
            tree: ``False``: only what this Run and its ancestors recorded (the tool calls it
                may adopt: :meth:`~ledger.api.session.RunSession.adopt_tool_calls`).

        Raises:
            NotFound: no Run has this id.
        """
        if tree:
            root = yield from self._root(run_id)
            return (yield from blocking(lambda: self._runs.tree_provenance(root)))
        ids = [run_id]
        run = yield from self._frozen(run_id)
        while run.parent_run_id is not None:
            ids.append(run.parent_run_id)
            run = yield from self._frozen(run.parent_run_id)
        return (yield from blocking(lambda: self._runs.provenance(ids)))

    def _root(self, run_id: str) -> Flow[str]:
        """The root of ``run_id``'s tree (itself for a Run with no parent).

        Read once per ancestor, then from the frozen Runs kept: a Run's parent never changes.
        """
        run = yield from self._frozen(run_id)
        root = run_id
        while run.parent_run_id is not None:
            root = run.parent_run_id
            run = yield from self._frozen(root)
        return root

    @op
    def append_event(self, lease: LeaseArg, kind: EventKind, data: AuditData,
                     attempt_id: Id | None = None) -> Flow[None]:
        """Append an audit event to the Run.

        Args:
            lease: The Run's live lease.
            kind: The event's kind (a short name such as ``note``, at most 32 characters).
            data: Its data: a mapping with string keys of JSON data (strings, finite numbers,
                booleans, None, lists, such mappings), stored as JSON (redacted).
            attempt_id: The Attempt it is about, if any.

        Raises:
            LeaseLost: the lease lapsed (``FencedOut``: the Run was taken over).
        """
        yield from self._store.append_event(lease, attempt_id, kind, dict(data), self.clock.now)

    @op
    def events(self, run_id: Id, kinds: list[EventKind] | None = None
               ) -> Flow[list[EventRecord]]:
        """The Run's audit events in order, optionally only those of the given kinds.

        Args:
            run_id: The Run (an unknown id has none).
            kinds: Only events of these kinds (e.g. ``["stop", "move"]``); ``None``: all.
        """
        return (yield from blocking(lambda: self._runs.events(run_id, kinds)))

    # -- reads ----------------------------------------------------------------------------

    @op
    def get_attempt(self, attempt_id: Id) -> Flow[AttemptRecord]:
        """One Attempt, under its original route.

        Raises:
            NotFound: no Attempt has this id.
        """
        return (yield from self._store.attempt(attempt_id))

    @op
    def timeline(self, run_id: Id) -> Flow[list[AttemptRecord]]:
        """The run's Attempts in order, each under its original route.

        Raises:
            NotFound: no Run has this id.
        """
        return (yield from blocking(lambda: self._runs.timeline(run_id)))

    @op
    def attempts(self, /, **filters: Unpack[AttemptFilters]) -> Flow[Page[AttemptRecord]]:
        """Attempts across Runs, newest first, one page at a time.

        Args:
            **filters: Any of ``route`` and ``group`` (ids), ``state`` (an
                :class:`~ledger.AttemptState`), ``category`` (a :class:`~ledger.Category`),
                ``since`` and ``until`` (epoch seconds: created at or after, and before),
                ``limit`` (1 to 10 000, default 100) and ``cursor`` (a page's
                ``next_cursor``).

        Returns:
            A :class:`~ledger.Page`; pass its ``next_cursor`` back for the next one.

        Raises:
            ArgumentMismatch: an unknown filter (the message names the closest one).
            InvalidArgument: a filter's value is wrong, ``until`` is before ``since``, or the
                cursor is not one a page gave.

        Example:
            >>> page = led.attempts(state="unknown", limit=50)  # doctest: +SKIP
            >>> while page.next_cursor:  # doctest: +SKIP
            ...     page = led.attempts(state="unknown", limit=50, cursor=page.next_cursor)
        """
        query = attempt_query(filters)  # refused here, before the read is scheduled
        return (yield from blocking(lambda: self._runs.attempts(**query)))

    @op
    def debit(self, debit_id: Id) -> Flow[DebitRecord]:
        """One debit (an Attempt's budget hold; its id is ``AttemptRecord.debit_id``).

        Raises:
            NotFound: no debit has this id.
        """
        return (yield from blocking(lambda: self._runs.debit(debit_id)))


class SyncFace(Blocking, Face[SessionT, OpenedT]):
    """A face that blocks on its operations: :class:`~ledger.Ledger`'s base.

    What a blocking Run session, lease keeper or :func:`~ledger.execute` takes.
    """


class AsyncFace(Awaiting, Face[SessionT, OpenedT]):
    """A face that awaits its operations: :class:`~ledger.AsyncLedger`'s base.

    What an awaiting Run session, lease keeper or :func:`~ledger.aexecute` takes.
    """

    def _workers(self) -> Workers:
        return self._store.workers


@checked
def storage_of(ledger: Annotated[Face[Any, Any], instance(
        Face, "a Ledger or an AsyncLedger", "pass a ledger.Ledger or a ledger.AsyncLedger")]
               ) -> Store:
    """The store under ``ledger`` (:class:`~ledger.storage.store.Store`).

    The one deliberate way for the ledger's own operations and tools (recovery,
    reconciliation, the audit, ``generate``, the benchmarks, the command line) to reach the
    database: its flows, and its ``context``, on which they build the query objects they need
    (:class:`~ledger.storage.recovery.RecoveryQueries`,
    :class:`~ledger.storage.audit.AuditQueries`, ...). Applications use the ledger's methods:
    the store takes its arguments as already checked and writes without the facade's rules.

    Args:
        ledger: A :class:`Ledger` or an :class:`AsyncLedger` (the store of its ``sync``).

    Returns:
        The store the ledger was opened on.

    Raises:
        InvalidArgument: ``ledger`` is neither a :class:`Ledger` nor an :class:`AsyncLedger`.
    """
    return ledger._store


@checked
def reads_of(ledger: Annotated[Face[Any, Any], instance(
        Face, "a Ledger or an AsyncLedger", "pass a ledger.Ledger or a ledger.AsyncLedger")]
             ) -> Store:
    """The store the audit reads ``ledger`` from (its read replica's, or its own).

    Its read replica's when it was opened with ``read_url=``, else its own
    (:func:`storage_of`).

    Only reads for people go there (the audit, the dashboard, the command line's reports): a
    replica may lag the primary, and its sessions are read-only. The ledger's own methods,
    every write and a turn's reads, use :func:`storage_of`'s store.

    Args:
        ledger: A :class:`Ledger` or an :class:`AsyncLedger`.

    Returns:
        The store to read from.

    Raises:
        InvalidArgument: ``ledger`` is neither a :class:`Ledger` nor an :class:`AsyncLedger`.
    """
    return ledger._replica if ledger._replica is not None else ledger._store


__all__ = ["AsyncFace", "Face", "SyncFace", "reads_of", "storage_of"]
