"""Named fault points: places in the write path where a test can make the process die.

A point costs one module-level ``None`` check when nothing is armed. Arm points either with the
environment variable ``LEDGER_FAULTS="name[,name...]"`` (read once, at import; each named point
then kills the process with SIGKILL when reached) or in-process with :func:`arm`, whose action
is ``"kill"`` (SIGKILL), ``"raise"`` (:class:`FaultInjected`), or any callable.

``name@N`` in ``LEDGER_FAULTS`` fires on the N-th time the point is reached (1-based), so a
worker can be killed in the middle of a sequence of calls rather than at its first.

A name that is not one of :data:`KNOWN_POINTS`, an ``@N`` that is not an integer of at least 1,
or an action that is neither ``"kill"``, ``"raise"`` nor a callable is
:class:`~ledger.errors.InvalidArgument` naming it and the fix (for ``LEDGER_FAULTS``, when the
variable is read, with its name): a misspelt point would be armed and never reached, and a
crash test would pass without crashing.

Points in the ledger:

``begin.before_commit`` / ``begin.after_commit``
    inside :meth:`ledger.storage.store.Store.begin_attempt`: the last statement of the
    transaction, and right after the commit before the record is returned (a commit whose
    acknowledgement is lost).
``settle.before_commit`` / ``settle.after_commit``
    the same two places in :meth:`ledger.storage.store.Store.settle_attempt`.
``dispatch.before_send`` / ``dispatch.after_send``
    for the driver that sends the request (the retry owner, or a host using the low-level API):
    after begin returned and before the request leaves, and after the response arrived and
    before settle is called.
``acquire.before_commit`` / ``acquire.after_commit``
    inside :meth:`ledger.storage.store.Store.acquire_lease` taking a lease anew: before its
    statements are sent (an acquisition that takes nothing), and right after the lease's commit,
    before the lease is returned (an acquisition whose acknowledgement is lost, or which an
    interruption cut short).
``finish.before_commit`` / ``finish.after_commit``
    inside the transaction that finishes a Run (:meth:`ledger.Ledger.finish_run`, a Run
    session's exit): before its statements are sent, and right after its commit (a finish
    whose acknowledgement is lost, or which an interruption cut short).
``recover.before_commit`` / ``recover.after_commit``
    inside the takeover of one run by :func:`ledger.ops.recovery.recover`.
``probe.before_claim``
    in :meth:`ledger.storage.store.Store.claim_probe`, before its transaction: where another
    process may take the probe slot first.
"""

from __future__ import annotations

import difflib
import os
import signal
import threading
from collections.abc import Callable
from typing import Literal

from ledger.errors import InvalidArgument
from ledger.forking import in_child

#: The environment variable that arms points for a whole process (read once, at import).
ENV = "LEDGER_FAULTS"

Action = Literal["kill", "raise"] | Callable[[str], None]

KNOWN_POINTS = (
    "begin.before_commit",
    "begin.after_commit",
    "settle.before_commit",
    "settle.after_commit",
    "dispatch.before_send",
    "dispatch.after_send",
    "acquire.before_commit",
    "acquire.after_commit",
    "finish.before_commit",
    "finish.after_commit",
    "recover.before_commit",
    "recover.after_commit",
    "probe.before_claim",
)


class FaultInjected(RuntimeError):
    """Raised by a point armed with ``"raise"`` (in-process tests)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"fault point {name!r} fired")
        self.name = name


class _Armed:
    __slots__ = ("action", "hits", "on_hit")

    def __init__(self, action: Action, on_hit: int) -> None:
        self.action = action
        self.on_hit = on_hit
        self.hits = 0


# None when nothing is armed: the whole cost of an unused point is this check.
_ARMED: dict[str, _Armed] | None = None
_lock = threading.Lock()


@in_child
def _forked_lock() -> None:
    # A point armed or hit by another thread of the parent as the fork came held it.
    global _lock
    _lock = threading.Lock()


def point(name: str) -> None:
    """A fault point. Does nothing unless ``name`` is armed."""
    if _ARMED is None:
        return
    _fire(name)


def _fire(name: str) -> None:
    armed = _ARMED
    if armed is None:
        return
    with _lock:
        entry = armed.get(name)
        if entry is None:
            return
        entry.hits += 1
        if entry.hits != entry.on_hit:
            return
    action = entry.action
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise FaultInjected(name)
    elif callable(action):
        action(name)


def _unknown_point(name: object) -> str | None:
    """What is wrong with ``name`` as a point (``None``: it is one)."""
    if name in KNOWN_POINTS:
        return None
    close = difflib.get_close_matches(str(name), KNOWN_POINTS, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"the points are {', '.join(KNOWN_POINTS)}"
    # An unknown name would be armed and never reached: a crash test would pass uncrashed.
    return f"{name!r} is not a fault point; {hint}"


def arm(name: str, action: Action = "raise", *, on_hit: int = 1) -> None:
    """Arm ``name`` in this process: fire ``action`` on the ``on_hit``-th time it is reached.

    Raises:
        InvalidArgument: ``name`` is not one of :data:`KNOWN_POINTS` (``field="name"``),
            ``action`` is neither ``"kill"``, ``"raise"`` nor a callable (``field="action"``),
            or ``on_hit`` is not an integer of at least 1 (``field="on_hit"``).
    """
    global _ARMED
    problem = _unknown_point(name)
    if problem is not None:
        raise InvalidArgument(problem, field="name", name=name)
    if action not in ("kill", "raise") and not callable(action):
        raise InvalidArgument(
            f"fault action {action!r} does nothing; pass 'kill' (SIGKILL), 'raise' "
            "(FaultInjected) or a callable of the point's name", field="action")
    if isinstance(on_hit, bool) or not isinstance(on_hit, int) or on_hit < 1:
        raise InvalidArgument(
            f"on_hit {on_hit!r} is not a count of times the point is reached; pass an "
            "integer of at least 1 (1: the first time)", field="on_hit")
    with _lock:
        new = dict(_ARMED or {})
        new[name] = _Armed(action, on_hit)
        _ARMED = new


def disarm(name: str | None = None) -> None:
    """Disarm one point, or all of them."""
    global _ARMED
    with _lock:
        if name is None or _ARMED is None:
            _ARMED = None
            return
        new = dict(_ARMED)
        new.pop(name, None)
        _ARMED = new or None


def armed() -> dict[str, int]:
    """Armed points and how often each was reached."""
    return {k: v.hits for k, v in (_ARMED or {}).items()}


def _from_env(text: str | None) -> None:
    """Arm the points ``LEDGER_FAULTS`` names; all of them, or (a bad item) none."""
    if not text:
        return
    wanted: list[tuple[str, int]] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, at, nth = item.partition("@")
        problem = _unknown_point(name)
        if problem is None and at and not (nth.isdigit() and int(nth) >= 1):
            problem = (f"in {item!r}, '@{nth}' is not when the point fires; write name@N, "
                       "N an integer of at least 1 (1: the first time it is reached)")
        if problem is not None:
            raise InvalidArgument(f"{ENV}={text!r}: {problem}", field=ENV, item=item)
        wanted.append((name, int(nth) if at else 1))
    for name, on_hit in wanted:
        arm(name, "kill", on_hit=on_hit)


_from_env(os.environ.get(ENV))

__all__ = ["KNOWN_POINTS", "FaultInjected", "arm", "armed", "disarm", "point"]
