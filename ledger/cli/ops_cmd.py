"""Operator commands over the audit API: ``runs``, ``run show``, ``attempts``, ``failovers``,
``costs``, ``health``, ``actions``, ``generate`` and ``dashboard``; and the ones that write, an
operator's deliberate actions: ``run close`` (it ends a Run nobody will resume), ``health
clear`` (it clears a cooldown) and ``retention`` (it drops old history), each recorded with
who (``--by``) and why (``--reason``).

Reading commands open the ledger without migrating it (they never write, so they work through a
read-only role and never create a database by accident). Tables are aligned text by default and
``--json`` prints the typed results as JSON for scripts. Times for people are ISO-8601 UTC or a
distance from now (``in 4 m``, ``12 s ago``); JSON keeps epoch seconds, as the API returns them.
Progress bars go to stderr, only when stderr is a terminal or ``--progress`` is given, so piped
output stays clean.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from ledger.cli.common import PROG, add_who_and_why, operator_name
from ledger.cli.progress import Progress, wanted
from ledger.domain.bounds import DEFAULT_FOLD_AFTER_S, MAX_FOLD_AFTER_S, MAX_LAG_S, MAX_TIME
from ledger.domain.timefmt import data_text, iso, relative, when
from ledger.errors import DatabaseSetupError, InvalidArgument

_REL = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# -- helpers --------------------------------------------------------------------------------


def parse_time(text: str | None, now: float, field: str) -> float | None:
    """``24h``/``30m``/``7d`` ago, an ISO-8601 time (UTC unless it says otherwise), or epoch."""
    if text is None:
        return None
    m = _REL.match(text.strip())
    if m:
        return _in_range(now - float(m.group(1)) * _UNIT[m.group(2)], text, field)
    try:
        return _in_range(float(text), text, field)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidArgument(
            f"--{field} {text!r} is not a time: use 24h, 30m, 7d (ago), an ISO time such as "
            "2026-01-31T18:00 (UTC), or epoch seconds", field=field) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return _in_range(dt.timestamp(), text, field)


def _in_range(t: float, text: str, field: str) -> float:
    """``t``, a time the ledger can hold; else the flag's own refusal (the library's would
    speak of its keyword and of ``clock.now()``)."""
    if not 0 <= t < MAX_TIME:  # NaN and the infinities too
        raise InvalidArgument(
            f"--{field} {text!r} is not a time the ledger holds: epoch seconds between 0 and "
            f"{MAX_TIME:g} (not milliseconds), an ISO time such as 2026-01-31T18:00 (UTC), or "
            "24h, 30m, 7d (ago)", field=field)
    return t


def fmt_time(t: float | None) -> str:
    """An instant as ISO-8601 UTC (``2026-01-31T18:00:05Z``)."""
    return iso(t)


def fmt_until(t: float | None, now: float) -> str:
    """A time a reader acts on: its distance from now and the instant (``in 42 s (...Z)``)."""
    return when(t, now)


def fmt_ahead(t: float | None, now: float) -> str:
    """A time that holds only until it comes (a cooldown, a disable): as :func:`fmt_until`
    while ahead, ``-`` once passed (the row keeps it; a cooldown that ran out is none)."""
    return "-" if t is None or t <= now else when(t, now)


def fmt_event_data(data: Any, now: float) -> str:
    """An event's data as ``key=value`` pairs; times (``until``, ``*_at``) as ISO and relative."""
    return data_text(data, now)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned columns; numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in r]
                                            for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_num(r[i]) for r in cells[1:]) and len(cells) > 1
               for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        parts = [(c.rjust(w) if numeric[i] and n > 0 else c.ljust(w))
                 for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _is_num(s: str) -> bool:
    return bool(re.match(r"^-?\d+(\.\d+)?$", s)) or s == "-"


def _progress(args: argparse.Namespace, label: str) -> Progress:
    return Progress(label, wanted(bool(getattr(args, "progress", False))))


def _emit_json(value: Any) -> None:
    from ledger.ops.audit import to_jsonable

    sys.stdout.write(json.dumps(to_jsonable(value), indent=2, sort_keys=True) + "\n")


def open_reader(url: str, read_url: str | None = None) -> Any:
    """Open a ledger for reading: no migration, no new database, a clear error when absent
    (naming ``db init`` where that is the fix), and not a byte written to a SQLite file that
    holds no ledger.

    Every command but ``db init``, ``demo`` and ``generate`` opens the ledger here, so they
    all answer alike where there is no ledger: a SQLite file that does not exist
    (``problem="database_missing"``), a database without the ledger's tables (an empty file,
    what ``createdb`` makes: ``"schema_outdated"``, as the library's first statement says)
    and a file of another application (``"not_a_ledger"``) are a
    :class:`~ledger.errors.DatabaseSetupError` (exit 2, as a missing PostgreSQL database, an
    older schema and :class:`~ledger.errors.SchemaTooNew` are), never the retry-safe
    :class:`~ledger.errors.DatabaseUnavailable`: no retry will make a ledger appear.
    SQLite's in-memory database, in any spelling (``:memory:``, ``sqlite:///:memory:``,
    ``file::memory:``, ``sqlite:///file:x?mode=memory&uri=true``, ...:
    :func:`~ledger.storage.engine.sqlite_not_a_file`), or a SQLite URL naming no file is
    :class:`~ledger.errors.InvalidArgument` (``field="db"``, exit 2): it lives only inside the
    process that opens it, so no command can read a ledger there.

    ``read_url`` (``--read-url``, ``$LEDGER_READ_URL``): a read replica the audit reads from
    (:meth:`ledger.Ledger.open`); it must hold the ledger too. Nothing connects to ``url``
    while the replica holds a ledger; when the replica shows a set-up problem (no ledger
    tables, a database that does not exist, ...), ``url``'s own problem, if it has one, is
    raised instead: the primary is the one to fix first. A primary that cannot be reached
    then leaves the replica's problem to be raised."""
    from ledger.api.facade import Ledger
    from ledger.api.face import reads_of
    from ledger.storage.audit import AuditQueries
    from ledger.storage.engine import (
        check_sqlite_url,
        database_name,
        file_holds,
        normalize_url,
        not_a_ledger,
        parse,
        redact_url,
        sqlite_not_a_file,
    )

    norm = normalize_url(url)
    if norm.startswith("sqlite"):
        # The URL's file, without its options (``?timeout=5``): not the text after the scheme.
        # Every spelling (``sqlite+pysqlite:///``, ``sqlite://``) is looked at, so each is told
        # of a missing file alike; check_sqlite_url refuses those that name none.
        parsed = parse(url)[1]
        check_sqlite_url(parsed, redact_url(norm))  # before the file is looked at
        path = parsed.database or ""
        not_a_file = sqlite_not_a_file(parsed)
        if not_a_file is not None:
            # SQLite's in-memory database lives and dies inside the process that opens it: no
            # command can read a ledger another process wrote there, and "no ledger at
            # :memory:" sent operators looking for a file of that name.
            raise InvalidArgument(
                f"--db {url!r} names "
                + ("SQLite's in-memory database, which exists only inside the process that "
                   "opens it: no command can read a ledger another process wrote there"
                   if not_a_file != "no file" else "no SQLite file")
                + "; pass --db the path of the ledger's file (such as ./ledger.db) or its "
                "postgresql+psycopg:// URL, or set LEDGER_URL", field="db")
        init = f"{PROG} db init --db {shlex.quote(path)}"
        if not os.path.exists(path):
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                # ``db init`` would refuse next: it creates the file, not its folder.
                init = f"mkdir -p {shlex.quote(folder)} && {init}"
            raise _no_ledger(
                f"no ledger at {path}: the file does not exist; create one with `{init}` (or "
                f"`{PROG} demo` for a sample), or pass --db URL / set LEDGER_URL",
                norm, "database_missing", path)
        # Before any connection: the engine's first one writes (the switch to WAL), and a
        # file that is not a ledger must stay byte for byte as it was.
        holds = file_holds(path)
        if holds == "empty":
            raise _no_ledger(
                f"{path} holds no ledger tables (an empty database); create them with "
                f"`{init}`, or point --db at a ledger database", norm, "schema_outdated", path)
        if holds != "ledger":
            raise _no_ledger(
                f"{path} holds no ledger tables: {not_a_ledger(holds)}; point --db at a "
                f"ledger database (`{PROG} db init --db NEW.db` creates one)", norm,
                "not_a_ledger", path)
    if read_url is not None and norm.startswith("sqlite"):
        # The library's own refusal names its keyword (read_url=), not the flag or variable.
        raise InvalidArgument(
            "--read-url (or LEDGER_READ_URL) names a read replica of a ledger on PostgreSQL; a "
            "SQLite ledger has none (its readers open the same file): drop --read-url, or "
            "unset LEDGER_READ_URL", field="read_url")
    led = Ledger.open(url, migrate_schema=False, read_url=read_url)
    try:
        try:
            present = AuditQueries(reads_of(led).context).schema_present()
        except DatabaseSetupError as e:
            if read_url is None:
                raise
            _primary_first(led, url)
            # The primary holds the ledger: the replica is the one to fix, not with db init.
            where = redact_url(normalize_url(read_url))
            problem = str(e.fields.get("problem") or "")
            # The library's message goes on to offer createdb and db init, which make a
            # database where the replica should be one.
            fact = (f"database {e.fields.get('database')!r} does not exist there"
                    if problem == "database_missing" else str(e).split(";")[0])
            raise _no_ledger(
                f"the read replica {where} (--read-url or LEDGER_READ_URL) cannot be read: "
                f"{fact}; point --read-url at a replica of the ledger's database", where,
                problem or "database_missing", e.fields.get("database")) from e
        if not present:
            if read_url is None:
                raise _no_tables(url)
            _primary_first(led, url)
            where = redact_url(normalize_url(read_url))
            raise _no_ledger(
                f"{where} holds no ledger tables; point --read-url at a replica of the "
                "ledger's database", where, "schema_outdated",
                database_name(parse(read_url)[1]))
    except BaseException:
        led.close()
        raise
    return led


def _primary_first(led: Any, url: str) -> None:
    """Raise ``--db``'s own set-up problem, if it has one, before the replica's.

    Called only once the replica has shown a problem: a replica of a database that does not
    exist, or holds no ledger, holds none either, and ``--db`` is the one to fix first. A
    primary that cannot be reached (away in a failover) leaves the replica's problem to be
    told: nothing connects to ``--db`` while the replica answers, so reading a healthy replica
    never waits on the primary.
    """
    from ledger.api.face import storage_of
    from ledger.errors import DatabaseUnavailable
    from ledger.storage.audit import AuditQueries

    try:
        present = AuditQueries(storage_of(led).context).schema_present()
    except DatabaseUnavailable:
        return
    if not present:
        raise _no_tables(url)


def _no_tables(url: str) -> DatabaseSetupError:
    """``--db`` (a PostgreSQL database: a SQLite file is looked at before it is opened) holds
    no ledger tables."""
    from ledger.storage.engine import database_name, normalize_url, parse, redact_url
    from ledger.storage.failure import init_command

    where = redact_url(normalize_url(url))
    return _no_ledger(
        f"{where} holds no ledger tables; create them with "
        f"{init_command(where, option='--db ')}, or point --db at a ledger database",
        where, "schema_outdated", database_name(parse(url)[1]))


def _no_ledger(message: str, where: str, problem: str, database: str | None
               ) -> DatabaseSetupError:
    """No ledger at ``where``: a set-up problem (exit 2), which retrying will not fix."""
    return DatabaseSetupError(message, url=where, problem=problem, database=database, role=None)


@contextlib.contextmanager
def _loading() -> Iterator[None]:
    """No garbage collection while the audit loads and the ledger opens; what they made is
    frozen after (:func:`gc.freeze`), out of the collector's reach.

    Loading makes some 60,000 objects (classes, functions, SQLAlchemy's and pydantic's
    tables) that live as long as the command, and almost no garbage; the collector, started
    by allocation counts, would walk them again and again, and once more after loading (about
    a tenth of a reporting command). :func:`ledger.cli.main.main` unfreezes them when it was
    called in-process, so a caller's collector gets everything back.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _audit(args: argparse.Namespace) -> Any:
    with _loading():
        from ledger.ops.audit import Audit

        return Audit(open_reader(args.db, getattr(args, "read_url", None)))


def _money(d: Decimal | None) -> str:
    return "-" if d is None else f"{d:.6f}"


def fmt_secs(v: float | None) -> str:
    """A duration in seconds, to the millisecond (``1.204s``); ``-`` when not recorded."""
    return "-" if v is None else f"{v:.3f}s"


def fmt_tokens(a: Any) -> str:
    """An Attempt's tokens in and out, with the cached and reasoning parts where reported
    (``1200/340 (1024 cached, 128 reasoning)``); ``-`` when no usage was recorded."""
    if a.prompt_tokens is None and a.completion_tokens is None:
        return "-"
    text = f"{a.prompt_tokens if a.prompt_tokens is not None else '-'}/" + (
        f"{a.completion_tokens if a.completion_tokens is not None else '-'}")
    parts = [f"{n} {what}" for n, what in ((a.cached_tokens, "cached"),
                                            (a.reasoning_tokens, "reasoning")) if n]
    return text + (f" ({', '.join(parts)})" if parts else "")


def _add_db(p: argparse.ArgumentParser, *, reads: bool = True) -> None:
    # Also accepted after the command; SUPPRESS leaves the global --db / LEDGER_URL alone
    # unless it is given here.
    p.add_argument("--db", default=argparse.SUPPRESS, help="database URL or SQLite path")
    if reads:
        p.add_argument("--read-url", default=argparse.SUPPRESS,
                       help="a read replica to read from (PostgreSQL; default: "
                       "$LEDGER_READ_URL, else --db)")


def _add_common(p: argparse.ArgumentParser, *, paged: bool = True) -> None:
    _add_db(p)
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    if paged:
        p.add_argument("--limit", type=int, default=50, help="rows per page (default 50)")
        p.add_argument("--cursor", default=None,
                       help="next_cursor from the previous page (shown under the table)")


def _add_range(p: argparse.ArgumentParser, default_since: str | None) -> None:
    hint = f" (default {default_since} ago)" if default_since else ""
    p.add_argument("--since", default=default_since,
                   help=f"from this time: 24h, 7d, ISO time or epoch{hint}")
    p.add_argument("--until", default=None, help="up to this time (default: now)")


def _range(args: argparse.Namespace, now: float) -> tuple[float | None, float | None]:
    since = parse_time(args.since, now, "since")
    until = parse_time(args.until, now, "until")
    if since is not None and until is not None and since >= until:
        raise InvalidArgument("--since must be before --until", field="since")
    return since, until


def _footer(page: Any) -> None:
    if not page.items:
        print("(none)")  # the header alone read as a command that did nothing
    if page.next_cursor:
        print(f"\nmore: --cursor '{page.next_cursor}'")


# -- commands -------------------------------------------------------------------------------


def _runs(args: argparse.Namespace) -> int:
    audit = _audit(args)
    try:
        since, until = _range(args, audit.now())
        page = audit.runs(status=args.status, tenant=args.tenant, since=since, until=until,
                          limit=args.limit, cursor=args.cursor)
    finally:
        audit.ledger.close()
    if args.json:
        _emit_json(page)
        return 0
    print(table(["RUN", "STATUS", "TENANT", "SELECTED", "CURRENT", "CALLS", "CHARGED", "HELD",
                 "ADMITTED"],
                [[r.run_id, r.status, r.tenant, r.selected_route, r.current_route,
                  r.calls_used, _money(r.posted), _money(r.reserved), fmt_time(r.created_at)]
                 for r in page.items]))
    _footer(page)
    return 0


def budget_lines(r: Any) -> list[str]:
    """A Run's budget as ``run show`` prints it (``r`` a :class:`~ledger.ops.audit.RunSummary`):
    per bound what it was admitted with, used, held, carved for its Children, gave back to
    its parent, and what is left."""
    def parts(carved: str, returned: str, carved_any: object, returned_any: object) -> str:
        return ((f", carved {carved} for children" if carved_any else "")
                + (f", gave back {returned} to its parent" if returned_any else ""))
    lines = [
        f"cost     {_money(r.max_cost)}: charged {_money(r.posted)}, held {_money(r.reserved)}"
        + parts(_money(r.carved), _money(r.returned), r.carved, r.returned)
        + f"; left {_money(r.cost_left)}",
        f"calls    {r.max_calls}: used {r.calls_used}"
        + parts(str(r.carved_calls), str(r.returned_calls), r.carved_calls, r.returned_calls)
        + f"; left {r.calls_left}",
        f"retries  {r.max_retries}: used {r.retries_used}"
        + parts(str(r.carved_retries), str(r.returned_retries), r.carved_retries,
                r.returned_retries)
        + f"; left {r.retries_left}",
    ]
    if r.max_tokens is not None:
        lines.append(f"tokens   {r.max_tokens}: used {r.tokens_used}, held {r.tokens_reserved}"
                     + parts(str(r.carved_tokens), str(r.returned_tokens), r.carved_tokens,
                             r.returned_tokens)
                     + f"; left {r.tokens_left}")
    return lines


def _run_show(args: argparse.Namespace) -> int:
    audit = _audit(args)
    try:
        tl = audit.timeline(args.run_id)
        now = audit.now()
    finally:
        audit.ledger.close()
    if args.json:
        _emit_json(tl)
        return 0
    r = tl.run
    print(f"run {r.run_id}  status {r.status}  tenant {r.tenant or '-'}  "
          f"labels {json.dumps(r.labels, sort_keys=True)}"
          + (f"  child of {r.parent_run_id}" if r.parent_run_id else ""))
    print(f"selected {r.selected_route}  served {tl.served_route or '-'}  "
          f"failed over: {'yes' if tl.failed_over else 'no'}  "
          f"tokens {r.tokens_used}  "
          f"admitted {fmt_until(r.created_at, now)}")
    for line in budget_lines(r):
        print(line)
    if tl.children:
        print()
        print(table(["CHILD", "STATUS", "CHARGED", "HELD", "BUDGET", "GAVE BACK", "CALLS",
                     "RETRIES"],
                    [[c.run_id, c.status, _money(c.posted), _money(c.reserved),
                      _money(c.max_cost), _money(c.returned),
                      f"{c.calls_used}/{c.max_calls} (back {c.returned_calls})",
                      f"{c.retries_used}/{c.max_retries} (back {c.returned_retries})"]
                     for c in tl.children]))
    print()
    rows = []
    for a in tl.attempts:
        why = "-"
        if a.selection is not None:
            why = a.selection.reason or a.selection.decision or "-"
            if a.selection.skipped:
                why += " (skipped " + ", ".join(f"{s.route}: {s.reason}"
                                                for s in a.selection.skipped) + ")"
        outcome = a.state + (f" {a.category}" if a.category else "") + (
            f" {a.http_status}" if a.http_status else "") + (
            f" {a.reject_reason}" if a.reject_reason else "")
        held = a.posted if a.debit_state == "posted" else a.reserved
        rows.append([a.seq, a.kind, a.route_id, a.profile_id, outcome,
                     f"{a.debit_state} {_money(held)}",
                     _money(a.cost), fmt_secs(a.latency_s), fmt_secs(a.first_byte_s),
                     fmt_secs(a.first_token_s), fmt_tokens(a), why, fmt_time(a.created_at)])
    print(table(["#", "KIND", "ROUTE", "PROFILE", "OUTCOME", "DEBIT", "REPORTED", "LATENCY",
                 "TTFB", "TTFT", "TOKENS IN/OUT", "WHY", "AT"], rows))
    # Waits have their own lines below.
    notes = [(a.seq, e) for a in tl.attempts for e in a.events
             if e.kind not in ("capacity_wait", "wait")]
    if notes:
        print()
        for seq, e in notes:
            print(f"  #{seq} {e.kind}: {fmt_event_data(e.data, now)}")
    seqs = {a.attempt_id: a.seq for a in tl.attempts}
    if tl.waits:
        print()
        for w in tl.waits:
            print(f"  waited {w.waited_s:.1f} s ({w.text}): {w.outcome}"
                  + (f" -> #{seqs[w.attempt_id]}" if w.attempt_id in seqs else "")
                  + f"  {fmt_until(w.at, now)}")
    for line in stop_lines(tl.stops, now):
        print(line)
    for e in tl.run_events:
        if e.kind == "close":  # an operator's (or recovery's) close: who and why
            d = e.data
            print(f"\nclosed {fmt_until(e.created_at, now)} by {d.get('by') or d.get('executor')}"
                  f": {d.get('reason')} ({d.get('previous_status')} -> {d.get('status')})")
    return 0


def open_writer(url: str) -> Any:
    """Open an existing ledger to write to it: never a new database by accident, and never
    migrated (``db init`` alone migrates): an operator's command run by a newly installed
    package must not rewrite tables under the application's feet, nor as a role that is not
    their owner; an older schema is refused naming ``db init``, as the reports refuse it."""
    return open_reader(url)


def _run_close(args: argparse.Namespace) -> int:
    from ledger.errors import NotFound

    led = open_writer(args.db)
    try:
        try:
            before = led.get_run(args.run_id)
        except NotFound:
            # The library's fix ("admit the run first") is a host's; an operator closing a
            # Run mistyped its id.
            raise NotFound(f"unknown run id {args.run_id!r}; nothing was closed: check the id "
                           f"(list runs with `{PROG} runs`)", run_id=args.run_id) from None
        rec = led.close_run(args.run_id, status=args.status, reason=args.reason,
                            by=operator_name() if args.by is None else args.by)
        closes = led.events(args.run_id, ["close"])
    finally:
        led.close()
    # A close always moves the fence on; a Run its block ended keeps its status.
    changed = before.fence != rec.fence
    data = closes[-1].data if closes and changed else {}
    if args.json:
        _emit_json({"run_id": rec.run_id, "status": rec.status.value,
                    "previous_status": before.status.value, "changed": changed,
                    "close": data})
        return 0
    if not changed:
        print(f"run {rec.run_id} was already closed {rec.status.value}; nothing changed")
        return 0
    print(f"closed run {rec.run_id}: {before.status.value} -> {rec.status.value} "
          f"(fence {data.get('previous_fence')} -> {data.get('fence')}, lease released) "
          f"by {data.get('by')}: {data.get('reason')}")
    unknown = data.get("unknown") or []
    if unknown:
        print(f"  {len(unknown)} attempt(s) still dispatching marked unknown: "
              + ", ".join(unknown))
    held = data.get("holds_kept") or []
    if held:
        print(f"  {len(held)} unknown attempt(s) keep their holds until settled: "
              + ", ".join(held))
    return 0


def stop_lines(stops: Sequence[Any], now: float) -> list[str]:
    """Why the run stopped: each ``stop`` event's reason, detail, skipped candidates, errors."""
    out: list[str] = []
    for st in stops:
        out.append("")
        out.append(f"stopped {fmt_until(st.at, now)}: {st.reason}"
                   + (f": {st.detail}" if st.detail else ""))
        if st.candidates:
            out.extend(f"  {line}" for line in st.candidates)
            continue
        for sk in st.skipped:
            out.append(f"  skipped {sk.route}: {sk.reason}" + (f" ({sk.detail})" if sk.detail
                                                               else ""))
        for err in st.errors:
            out.append(f"  error: {err}")
    return out


def _attempts(args: argparse.Namespace) -> int:
    audit = _audit(args)
    try:
        since, until = _range(args, audit.now())
        if args.open:
            opage = audit.open_attempts(since=since, until=until, limit=args.limit,
                                        cursor=args.cursor)
            if args.json:
                _emit_json(opage)
                return 0
            print(table(["ATTEMPT", "RUN", "ROUTE", "STATE", "LEASE", "AT"],
                        [[o.attempt.attempt_id, o.attempt.run_id, o.attempt.route_id,
                          o.attempt.state.value, "live" if o.lease_live else "gone",
                          fmt_time(o.attempt.created_at)] for o in opage.items]))
            _footer(opage)
            return 0
        page = audit.attempts(route=args.route, group=args.group, state=args.state,
                              category=args.category, since=since, until=until,
                              limit=args.limit, cursor=args.cursor)
    finally:
        audit.ledger.close()
    if args.json:
        _emit_json(page)
        return 0
    print(table(["ATTEMPT", "RUN", "#", "ROUTE", "GROUP", "STATE", "DEBIT", "CATEGORY", "HTTP",
                 "COST", "AT"],
                [[a.attempt_id, a.run_id, a.seq, a.route_id, a.group_id, a.state.value,
                  a.debit_state.value if a.debit_state else None, a.category, a.http_status,
                  _money(a.cost), fmt_time(a.created_at)]
                 for a in page.items]))
    _footer(page)
    return 0


def _failovers(args: argparse.Namespace) -> int:
    audit = _audit(args)
    try:
        since, until = _range(args, audit.now())
        page = audit.failovers(since=since, until=until, limit=args.limit, cursor=args.cursor)
    finally:
        audit.ledger.close()
    if args.json:
        _emit_json(page)
        return 0
    rows = []
    unusable: dict[tuple[str, str], str] = {}  # (run, route) -> why the route could not be used
    for f in page.items:
        causes = ", ".join(f"{c.route}: " + (f"skipped ({c.category})" if c.state == "skipped"
                                             else c.category or c.state)
                           + (f" {c.http_status}" if c.http_status else "") for c in f.causes)
        rows.append([f.run_id, f.tenant, f.selected_route, f.served_route or "(none)",
                     " > ".join(f.routes), causes or "-", f.status, fmt_time(f.created_at)])
        for c in f.causes:
            if c.category == "unusable":
                unusable.setdefault((f.run_id, c.route), c.detail or "-")
    print(table(["RUN", "TENANT", "SELECTED", "SERVED BY", "ROUTES TRIED", "CAUSES", "STATUS",
                 "ADMITTED"], rows))
    if unusable:
        # Skipped without sending (a missing key, an unusable endpoint): what to fix.
        print("\nunusable routes (skipped, nothing sent)")
        for (run_id, route), why in unusable.items():
            print(f"  {run_id} {route}: {why}")
    _footer(page)
    return 0


def _span(text: str, field: str) -> float:
    """A duration such as ``1d``, ``6h``, ``30m`` or ``3600`` (seconds)."""
    m = _REL.match(text.strip())
    if m:
        return float(m.group(1)) * _UNIT[m.group(2)]
    try:
        return float(text)
    except ValueError:
        raise InvalidArgument(f"--{field} {text!r} is not a span of time: use 1d, 6h, 30m, 1w "
                              "or seconds", field=field) from None


def _used(s: Any) -> str:
    """The share of a budget charged or held, as a percentage."""
    if not s.budget:
        return "-"
    return f"{100 * (s.posted + s.held) / s.budget:.1f}%"


def _costs(args: argparse.Namespace) -> int:
    if args.label is not None and args.by != "label":
        raise InvalidArgument(f"--label {args.label!r} names the label to total by and goes with "
                              f"--by label; add --by label (it has no effect with --by "
                              f"{args.by})", field="label")
    if args.by == "label" and args.label is None:
        # The library's own message names its keyword (label='team'), not this flag.
        raise InvalidArgument("--by label totals by the values of one label; name it with "
                              "--label KEY (e.g. --label team)", field="label")
    budgets_wanted = args.by in ("tenant", "label")
    if args.every is not None and not budgets_wanted:
        raise InvalidArgument("--every splits the budgets of --by tenant or --by label; pass "
                              "one of those", field="every")
    every = None if args.every is None else _span(args.every, "every")
    if every is not None and not every >= 60:
        raise InvalidArgument(f"--every {args.every!r} is too fine: pass at least 1m (1d: UTC "
                              "days)", field="every")
    audit = _audit(args)
    try:
        since, until = _range(args, audit.now())
        page = audit.costs(by=args.by, label=args.label, since=since, until=until,
                           limit=args.limit, cursor=args.cursor)
        budgets = None
        if budgets_wanted:
            budgets = audit.spend(by=args.by, label=args.label, since=since, until=until,
                                  every=every, limit=args.limit, cursor=args.budget_cursor)
    finally:
        audit.ledger.close()
    if args.json:
        from ledger.ops.audit import to_jsonable

        doc = to_jsonable(page)
        if budgets is not None:
            doc["budgets"] = to_jsonable(budgets)
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return 0
    key = args.label if args.by == "label" else args.by
    print(table([key.upper(), "ATTEMPTS", "OK", "FAILED", "UNKNOWN", "PROMPT_TOK",
                 "COMPLETION_TOK", "CHARGED", "HELD"],
                [[t.key, t.attempts, t.succeeded, t.failed, t.unknown, t.prompt_tokens,
                  t.completion_tokens, _money(t.cost), _money(t.held)] for t in page.items]))
    _footer(page)
    if budgets is not None:
        _budget_tables(budgets, key, args.every)
    return 0


def _budget_tables(budgets: Any, key: str, every: str | None) -> None:
    """Spend against budgets: per key, then (with --every) per key and time bucket."""
    print(f"\nspend against budgets: the runs admitted in the window, by {key} (charged and "
          "held now)")
    print(table([key.upper(), "RUNS", "BUDGET", "CHARGED", "HELD", "LEFT", "USED"],
                [[s.key, s.runs, _money(s.budget), _money(s.posted), _money(s.held),
                  _money(s.left), _used(s)] for s in budgets.items]))
    if budgets.next_cursor:
        print(f"\nmore: --budget-cursor '{budgets.next_cursor}'")
    if every is None:
        return
    rows = [[fmt_time(p.start), s.key, p.runs, _money(p.budget), _money(p.posted),
             _money(p.held), _used(p)]
            for s in budgets.items for p in s.points if p.runs]
    rows.sort(key=lambda r: r[0])
    print(f"\nby when the runs were admitted (every {every}; empty buckets left out)")
    print(table(["FROM", key.upper(), "RUNS", "BUDGET", "CHARGED", "HELD", "USED"], rows))


def _health(args: argparse.Namespace) -> int:
    from dataclasses import replace

    audit = _audit(args)
    try:
        rep = audit.health(latency_window_s=None)
        since, until = _range(args, rep.now)
        rep = replace(rep, latency=audit.latency(
            since=since, until=until if until is not None else rep.now, route=args.route,
            group=args.group, category=args.category, tenant=args.tenant, state=args.state))
    finally:
        audit.ledger.close()
    if args.json:
        _emit_json(rep)
        return 0
    now = rep.now
    print("routes and profiles")
    # COUNTED SINCE last, so the columns scripts already read keep their places; with its
    # instant, as an operator compares it with when Attempts began.
    print(table(["KEY", "KIND", "PROVIDER", "STATUS", "COOLDOWN", "DISABLED", "ERRORS",
                 "RECENT", "LAST FAILURE", "LAST PROBE", "COUNTED SINCE"],
                [[k.key, k.kind, k.provider, k.status, fmt_ahead(k.cooldown_until, now),
                  fmt_ahead(k.disabled_until, now)
                  + (f" ({k.disabled_reason})" if k.status == "disabled"
                     and k.disabled_reason else ""),
                  k.error_count, k.recent_failures, relative(k.last_failure_at, now),
                  relative(k.last_probe_at, now), fmt_until(k.counted_at, now)]
                 for k in rep.routes + rep.profiles]))
    print()
    print("capacity groups")
    print(table(["GROUP", "MODE", "WAIT UNTIL", "REASON", "IN FLIGHT", "LIMIT", "WAITING"],
                [[g.group, g.mode, fmt_until(g.until, now) if g.mode != "open" else "-",
                  g.reason if g.mode != "open" else "-", g.in_flight, g.limit, g.waiting]
                 for g in rep.groups]))
    if rep.unusable:
        print()
        print("unusable routes (skipped without sending, not served since; fix the cause)")
        print(table(["ROUTE", "PROFILE", "PROVIDER", "SKIPS", "LAST SKIP", "LAST RUN"],
                    [[u.route, u.profile, u.provider, u.skips, relative(u.last_at, now),
                      u.last_run] for u in rep.unusable]))
        for u in rep.unusable:
            print(f"  {u.route}" + (f" ({u.profile})" if u.profile else "")
                  + f": {u.why or '-'}")
    if rep.latency is not None:
        print()
        print(latency_title(rep.latency, now))
        for what, stats in (("ROUTE", rep.latency.routes), ("GROUP", rep.latency.groups)):
            print()
            print(table(latency_headers(what), [latency_row(x) for x in stats])
                  if stats else f"no {what.lower()} has attempts with a latency in the window")
    return 0


def latency_title(lat: Any, now: float) -> str:
    """What a latency report covers: the window and the filters given."""
    filters = ", ".join(f"{k} {v}" for k, v in (
        ("route", lat.route), ("group", lat.group), ("category", lat.category),
        ("tenant", lat.tenant), ("state", lat.state)) if v is not None)
    since = fmt_time(lat.since) if lat.since is not None else "the first attempt"
    return (f"latency by the ledger's clock, seconds (attempts begun from {since} to "
            f"{fmt_time(lat.until if lat.until is not None else now)}"
            + (f"; {filters}" if filters else "; every outcome") + ")")


#: Every AttemptState's value, spelled here so that parsing a command's arguments does not
#: import the domain's records (tests/audit/test_cli.py holds them equal).
ATTEMPT_STATES = ["dispatching", "succeeded", "failed", "unknown", "rejected", "not_sent"]


def latency_headers(what: str) -> list[str]:
    """The columns of a latency table: every outcome's latency, the succeeded attempts'
    alone (``OK``), time to first token and to first byte."""
    return [what, "N", "P50", "P95", "P99", "OK N", "OK P50", "OK P95", "TTFT N", "TTFT P50",
            "TTFT P95", "TTFT P99", "TTFB P50", "TTFB P95", "TTFB P99"]


def latency_row(x: Any) -> list[Any]:
    """One :class:`~ledger.ops.audit.LatencyStats` under :func:`latency_headers`."""
    def p(v: Any, q: str) -> str:
        return "-" if v is None else f"{getattr(v, q):.3f}"

    lat, ok, ttft, ttfb = x.latency, x.succeeded_latency, x.first_token, x.first_byte
    return [x.key, lat.count if lat else 0, p(lat, "p50"), p(lat, "p95"), p(lat, "p99"),
            ok.count if ok else 0, p(ok, "p50"), p(ok, "p95"),
            ttft.count if ttft else 0, p(ttft, "p50"), p(ttft, "p95"), p(ttft, "p99"),
            p(ttfb, "p50"), p(ttfb, "p95"), p(ttfb, "p99")]


def _health_clear(args: argparse.Namespace) -> int:
    led = open_writer(args.db)
    try:
        ev = led.clear_cooldown(args.key, reason=args.reason, group=args.group,
                                by=operator_name() if args.by is None else args.by)
    finally:
        led.close()
    if args.json:
        _emit_json(ev)
        return 0
    d = ev.data
    prev = d.get("previous") or {}
    if d.get("kind") == "group":
        was = f"{prev.get('mode')}" + (f" until {fmt_time(prev.get('until'))}"
                                       if prev.get("until") is not None else "")
    else:
        until = prev.get("disabled_until") or prev.get("cooldown_until")
        was = f"{prev.get('status')}" + (f" until {fmt_time(until)}" if until else "") + (
            f", {prev.get('error_count')} error(s), {prev.get('recent_failures')} recent "
            "failure(s)")
    print(f"cleared {d.get('kind')} {d.get('key')} (was {was}) by {d.get('by')}: "
          f"{d.get('reason')}")
    return 0


def _actions(args: argparse.Namespace) -> int:
    from ledger.ops.audit import ACTION_KINDS

    audit = _audit(args)
    try:
        since, until = _range(args, audit.now())
        page = audit.actions(since=since, until=until, kinds=args.kinds or ACTION_KINDS,
                             limit=args.limit, cursor=args.cursor)
    finally:
        audit.ledger.close()
    if args.json:
        _emit_json(page)
        return 0
    print(table(["AT", "ACTION", "ON", "BY", "WHY"],
                [[fmt_time(a.at), a.kind, action_target(a), a.by, a.reason]
                 for a in page.items]))
    _footer(page)
    return 0


def action_target(a: Any) -> str:
    """What an operator's action was about, in a few words."""
    d = a.data
    if a.kind == "clear_cooldown":
        return f"{d.get('kind')} {a.key}"
    if a.kind == "close":
        return f"run {a.run_id} {d.get('previous_status')} -> {d.get('status')}"
    if a.kind == "retention":
        rows = d.get("rows") or {}
        return (f"history before {fmt_time(d.get('cutoff'))}: {rows.get('attempts', 0)} "
                f"attempt(s), {rows.get('events', 0)} event(s)")
    return (f"attempt {a.attempt_id} (run {a.run_id}) {d.get('previous_state')} -> "
            f"{d.get('outcome')}")


def parse_age(text: str) -> float:
    """``--older-than``: an age such as ``90d``, ``12w`` or ``2160h`` (from one day to
    36 500 days), in seconds."""
    from ledger.api.arguments import MAX_RETENTION_S, MIN_RETENTION_S

    m = _REL.match(text.strip())
    if m is None or not MIN_RETENTION_S <= float(m.group(1)) * _UNIT[m.group(2)] \
            <= MAX_RETENTION_S:
        raise InvalidArgument(
            f"--older-than {text!r} is not an age from one day to 36500 days: pass a number "
            "and a unit, e.g. --older-than 90d (days; also h, w; 24h at least)",
            field="older_than")
    return float(m.group(1)) * _UNIT[m.group(2)]


def _retention(args: argparse.Namespace) -> int:
    age = parse_age(args.older_than)
    led = open_writer(args.db)
    try:
        rep = led.drop_history(age, reason=args.reason, dry_run=args.dry_run,
                               by=operator_name() if args.by is None else args.by)
    finally:
        led.close()
    if args.json:
        _emit_json(rep)
        return 0
    verb = "would drop" if rep.dry_run else "dropped"
    print(f"history before {fmt_time(rep.cutoff)} (older than {args.older_than}): {verb} "
          f"{rep.rows('attempts')} attempt(s) and {rep.rows('events')} event(s)")
    rows = [[p.table, p.partition or "(rows)", fmt_time(p.since) if p.since else "-",
             fmt_time(p.until), p.rows, "drop" if p.held is None else f"keep: {p.held}"]
            for p in [*rep.dropped, *rep.kept]]
    if rows:
        print(table(["TABLE", "PARTITION", "SINCE", "UNTIL", "ROWS", "ACTION"], rows))
    print(f"{rep.actions_kept} operator action(s) older than the cut-off kept")
    if rep.event is not None:
        # SQLite drops in slices, each recording its own event: the report's is the last.
        last = " (its last slice's)" if "slice" in rep.event.data else ""
        print(f"recorded as retention event {rep.event.event_id}{last} by "
              f"{rep.event.data.get('by')}")
    return 0


def _span_within(text: str, field: str, most: float, fix: str) -> float:
    """:func:`_span`, from 0 to ``most`` seconds; else the flag's refusal naming the bound.

    ``most`` is the library's own bound (``Ledger.roll_up`` refuses past it too); checked here
    so the refusal speaks of the flag and of spans such as ``2d``, not of a keyword in
    seconds."""
    span = _span(text, field)
    if not 0 <= span <= most:  # NaN and the infinities too
        raise InvalidArgument(f"--{field} {text!r} is not a span from 0 to {most / 86_400:g} "
                              f"days, the longest {field} rollup takes: {fix}", field=field)
    return span


def _rollup(args: argparse.Namespace) -> int:
    lag = _span_within(args.lag, "lag", MAX_LAG_S,
                       "pass a span such as 5m (the default), 1h, 2d or seconds")
    fold = None if args.fold_after == "never" else _span_within(
        args.fold_after, "fold-after", MAX_FOLD_AFTER_S,
        f"pass a span such as {DEFAULT_FOLD_AFTER_S / 86_400:g}d (the default), 30d or "
        "seconds, or 'never' to fold nothing")
    led = open_writer(args.db)
    try:
        rep = led.roll_up(lag=lag, max_hours=args.max_hours, fold_after=fold)
    finally:
        led.close()
    if args.json:
        _emit_json(rep)
        return 0
    print(f"rolled up {rep.hours} hour(s) ending by {fmt_time(rep.until)} into {rep.rows} "
          f"row(s); {rep.pending} hour(s) left for the next run; folded {rep.days} day(s)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from ledger.api.facade import Ledger
    from ledger.clock import ManualClock
    from ledger.tools.generate import check_window, generate

    end = args.end if args.end is not None else time.time()
    # Before the ledger is opened: opening makes a new database, and an --end no other command
    # reads (milliseconds) made PostgreSQL fail on the history's partitions after it.
    check_window(attempts=args.attempts, days=args.days, end=end, flag="--")
    # The history's own time: generate moves it through the --days window.
    led = Ledger.open(args.db, clock=ManualClock(end))
    try:
        if not args.into_existing:
            _refuse_foreign_runs(led)
        bar = _progress(args, "generate")
        t0 = time.monotonic()
        st = generate(led, attempts=args.attempts, days=args.days, end=end, seed=args.seed,
                      progress=bar)
        took = time.monotonic() - t0
    finally:
        led.close()
    summary = {"runs": st.runs, "attempts": st.attempts, "failed": st.failed,
               "unknown": st.unknown, "not_sent": st.not_sent, "dispatching": st.dispatching,
               "failovers": st.failovers, "events": st.events, "since": st.since,
               "until": st.until, "seconds": round(took, 2)}
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    else:
        print(f"generated {st.attempts} attempts in {st.runs} runs ({st.failed} failed, "
              f"{st.unknown} unknown, {st.not_sent} not sent, {st.dispatching} dispatching; "
              f"{st.failovers} runs failed over; {st.events} events) from "
              f"{fmt_time(st.since)} to {fmt_time(st.until)} in {took:.1f} s")
    return 0


def _refuse_foreign_runs(led: Any) -> None:
    """Synthetic history next to real runs would mix into every audit answer: ask first."""
    from ledger.api.face import storage_of
    from ledger.storage.audit import AuditQueries
    from ledger.tools.generate import generated_policy_hash

    ctx = storage_of(led).context
    other = AuditQueries(ctx).first_run_other_than(policy_hash=generated_policy_hash())
    if other is not None:
        raise InvalidArgument(
            f"{ctx.where} holds runs that generate did not write (e.g. "
            f"{other!r}); synthetic history would mix into their audit answers. Point --db at a "
            "new database, or pass --into-existing to add it anyway",
            field="into_existing", run_id=other)


def _dashboard(args: argparse.Namespace) -> int:
    try:
        from ledger.dashboard.app import (
            MAX_REFRESH_S,
            check_allowed_hosts,
            check_bind,
            check_forwarded_allow_ips,
            serve,
        )
    except ImportError as e:
        raise InvalidArgument(
            "the dashboard needs the optional extra: "
            f"pip install 'failover-ledger[dashboard]' ({e})",
            field="dashboard") from e
    if not 0 <= args.refresh <= MAX_REFRESH_S:
        raise InvalidArgument(f"--refresh must be from 0 to {MAX_REFRESH_S} seconds (0 turns "
                              "auto-refresh off)", field="refresh")
    check_bind(args.host, args.port, host_name="--host", port_name="--port")
    allowed = check_allowed_hosts(args.allowed_hosts or (), name="--allowed-host")
    proxies = check_forwarded_allow_ips(
        ",".join(args.forwarded_allow_ips) if args.forwarded_allow_ips else None,
        name="--forwarded-allow-ips")
    token = _action_token(args)
    read_url = getattr(args, "read_url", None)
    led = open_reader(args.db, read_url)  # fail fast, with the clear message, before binding
    led.close()
    serve(args.db, read_url=read_url, host=args.host, port=args.port, refresh_s=args.refresh,
          actions=args.allow_actions, token=token, allowed_hosts=allowed,
          forwarded_allow_ips=proxies)
    return 0


def _action_token(args: argparse.Namespace) -> str | None:
    """The token the dashboard's actions need: only with --allow-actions, from --token-file
    or $LEDGER_DASHBOARD_TOKEN, checked before anything is served."""
    if not args.allow_actions:
        if args.token_file is not None:
            raise InvalidArgument("--token-file enables nothing without --allow-actions; pass "
                                  "both to serve the operator's actions", field="token_file")
        return None
    if args.token_file is not None:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise InvalidArgument(f"--token-file {args.token_file!r} cannot be read ({e}); "
                                  "pass a file holding the token", field="token_file") from e
    else:
        token = os.environ.get("LEDGER_DASHBOARD_TOKEN", "").strip()
        if not token:
            raise InvalidArgument(
                "--allow-actions needs a token: --token-file FILE or $LEDGER_DASHBOARD_TOKEN "
                "(make one with `python -c \"import secrets; print(secrets.token_urlsafe(32))\"`)"
                "; every action must carry it", field="token")
    from ledger.dashboard.actions import check_token

    return check_token(token)


# -- registration ---------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("runs", help="list runs, newest first")
    p.add_argument("--status", choices=["admitted", "running", "succeeded", "failed", "stopped",
                                        "cancelled"])
    p.add_argument("--tenant")
    _add_range(p, None)
    _add_common(p)
    p.set_defaults(func=_runs)

    run = subparsers.add_parser("run", help=f"one run: {PROG} run show ID, {PROG} run close ID")
    run_sub = run.add_subparsers(dest="run_command", metavar="SUBCOMMAND", required=True)
    show = run_sub.add_parser("show", help="a run's attempt timeline: routes, debits, outcomes, "
                              "facts, costs and the selector's reasons")
    show.add_argument("run_id", metavar="ID")
    _add_common(show, paged=False)
    show.set_defaults(func=_run_show)
    close = run_sub.add_parser(
        "close", help="end a run nobody will resume (e.g. recovered and left running)",
        description="Take the run over under a fresh fence (refused while a live executor "
        "holds it), end it with --status, record a close event and release the lease. "
        "Attempts still dispatching become unknown; unknown attempts keep their holds until "
        "settled. A run its block ended is closed with the status it ended with (until "
        "then it could be continued); closing a closed run again changes nothing.")
    close.add_argument("run_id", metavar="ID")
    close.add_argument("--status", required=True, metavar="STATUS",
                       help="failed, cancelled, stopped, or succeeded (only when its last "
                       "turn was served)")
    add_who_and_why(close, "e.g. 'host crashed; the user retried as task-8'")
    _add_db(close, reads=False)
    close.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    close.set_defaults(func=_run_close)

    p = subparsers.add_parser("attempts", help="attempts by route, group, outcome, category, time")
    p.add_argument("--route")
    p.add_argument("--group")
    p.add_argument("--state", "--outcome", dest="state",
                   choices=ATTEMPT_STATES)
    p.add_argument("--category", help="failure category, e.g. rate_limit")
    p.add_argument("--open", action="store_true",
                   help="only unknown and still-dispatching attempts, with their lease")
    _add_range(p, None)
    _add_common(p)
    p.set_defaults(func=_attempts)

    p = subparsers.add_parser("failovers", help="runs that failed over, with the causes")
    _add_range(p, "24h")
    _add_common(p)
    p.set_defaults(func=_failovers)

    p = subparsers.add_parser("costs", help="money charged and held, and token totals, per route, "
                              "run, tenant, ...")
    p.add_argument("--by", default="route",
                   choices=["route", "group", "provider", "run", "tenant", "label"])
    p.add_argument("--label", help="label key for --by label (e.g. team)")
    p.add_argument("--every", metavar="SPAN", default=None,
                   help="with --by tenant or label: also the budgets by when their runs were "
                   "admitted, in buckets of SPAN (1d: UTC days, 6h, 1w; at least 1m)")
    p.add_argument("--budget-cursor", default=None,
                   help="next cursor of the budgets table (shown under it)")
    _add_range(p, "24h")
    _add_common(p)
    p.set_defaults(func=_costs)

    p = subparsers.add_parser(
        "health", help="route, profile and group health now, and their latency percentiles; "
        f"{PROG} health clear KEY clears a cooldown",
        description="What cools now (routes, profiles, capacity groups, unusable routes), and "
        "p50/p95/p99 of the attempts' latency, time to first token and time to first byte "
        "per route and per group over --since..--until (default the last 24 h), filtered by "
        "--route, --group, --category, --tenant and --state.")
    p.add_argument("--route", help="latency of this route's attempts only")
    p.add_argument("--group", help="latency of this capacity group's attempts only")
    p.add_argument("--category", help="latency of failures of this category only, e.g. timeout")
    p.add_argument("--tenant", help="latency of this tenant's attempts only")
    p.add_argument("--state", "--outcome", dest="state",
                   choices=["succeeded", "failed", "unknown", "not_sent"],
                   help="latency of attempts with this outcome only (default: every outcome)")
    _add_range(p, "24h")
    _add_common(p, paged=False)
    p.set_defaults(func=_health)
    health_sub = p.add_subparsers(dest="health_command", metavar="SUBCOMMAND")
    clear = health_sub.add_parser(
        "clear", help="clear a route's, profile's, provider's or group's cooldown now",
        description="Make KEY available at once, at an operator's word: a route, credential "
        "profile or provider:<name> health key counts from zero again (its cooldown, disable, "
        "error and failure counts cleared); with --group, KEY is a capacity group, opened "
        "(its waiting floor gone). A clear_cooldown event keeps who, why and what was "
        "cleared (`actions` lists it). Refused, recording nothing, for a key the ledger does "
        "not know or one with nothing to clear.")
    clear.add_argument("key", metavar="KEY")
    clear.add_argument("--group", action="store_true", help="KEY is a capacity group")
    add_who_and_why(clear, "e.g. 'provider confirmed the incident is over'")
    _add_db(clear, reads=False)
    clear.add_argument("--json", action="store_true", help="print the recorded event as JSON")
    clear.set_defaults(func=_health_clear)

    p = subparsers.add_parser(
        "actions", help="what operators did: cooldowns cleared, runs closed, attempts settled",
        description="Operators' actions newest first, each with who and why: cooldowns "
        "cleared (health clear), runs closed (run close, recover --close-past-deadline), "
        "unknown attempts settled with evidence (attempt settle) and history dropped "
        "(retention), from the command line, the API or the dashboard.")
    p.add_argument("--kind", action="append", dest="kinds",
                   choices=["clear_cooldown", "close", "late_receipt", "retention"],
                   help="only this kind (repeatable)")
    _add_range(p, None)
    _add_common(p)
    p.set_defaults(func=_actions)

    p = subparsers.add_parser(
        "retention", help="drop the history of finished runs older than an age "
        "(--older-than 90d)",
        description="Drop the attempts and events older than --older-than (by the ledger's "
        "clock), except those of runs still live or with an unknown or dispatching attempt, "
        "and record a retention event (who, why, the cut-off, what went; `actions` lists "
        "it). PostgreSQL drops whole monthly partitions (a partition holding any kept row "
        "stays whole) and first creates the coming months' partitions; SQLite deletes the "
        "rows. Operators' action events, runs, debits and provenance stay. --dry-run shows "
        "what would go and changes nothing (it only reads: a role that may SELECT the "
        "tables, or a process that may only read the SQLite file, may run it). Two runs at "
        "once take turns: the second drops nothing more. "
        "See docs/operations.md.")
    p.add_argument("--older-than", required=True, metavar="AGE",
                   help="age of the history to drop: 90d, 12w, 2160h (one day to 36500 days)")
    p.add_argument("--dry-run", action="store_true", help="show what would go; drop nothing")
    add_who_and_why(p, "e.g. 'the 90-day policy of ticket OPS-12'", default="retention")
    _add_db(p, reads=False)
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    p.set_defaults(func=_retention)

    p = subparsers.add_parser(
        "rollup", help="roll up the finished hours of history for the cost totals (cron it)",
        description="Write, for each hour that ended at least --lag ago and is not rolled "
        "up, the sums of its attempts not in flight by route, group, provider, tenant and labels, "
        "one transaction per hour, oldest first. `costs` (but --by run) then reads those "
        "sums instead of the hours' attempts: the same answers, cheaper over long windows. "
        "A later write to an attempt of a rolled hour undoes its roll-up; the next run redoes "
        "it. Then fold each UTC day older than --fold-after whose hours are all rolled into "
        "one set of rows, so that whole-history reads stay nearly flat as history grows. Run "
        "it every few minutes from cron. See docs/operations.md.")
    p.add_argument("--lag", default="5m", metavar="SPAN",
                   help="how long after its end an hour is rolled up: 5m (default), 1h, "
                        f"seconds; at most {MAX_LAG_S / 86_400:g} days")
    p.add_argument("--max-hours", type=int, default=None, metavar="N",
                   help="roll up at most N hours in this run (the oldest first)")
    fold_days = f"{DEFAULT_FOLD_AFTER_S / 86_400:g}d"
    p.add_argument("--fold-after", default=fold_days, metavar="SPAN",
                   help="how long after its end a day whose hours are rolled is folded into "
                        f"one set of rows: {fold_days} (default), 'never', seconds; at most "
                        f"{MAX_FOLD_AFTER_S / 86_400:g} days")
    _add_db(p, reads=False)
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    p.set_defaults(func=_rollup)

    p = subparsers.add_parser(
        "generate", help="fill a database with a realistic history, run through the ledger",
        description="Runs Runs through the ledger (admit, lease, execute) with a scripted "
        "send function in place of the network and a manual clock moved through the --days "
        "window before --end, so every record is the ledger's own; exactly --attempts "
        "Attempts. About 6 ms of CPU per Attempt (docs/audit.md): for millions, use the "
        "benchmarks' bulk generator (python -m benchmarks generate, from a checkout).")
    p.add_argument("--attempts", type=int, default=10_000,
                   help="attempts (default 10000: about a minute; at most 1000000, about two "
                   "hours; see docs/audit.md)")
    p.add_argument("--days", type=float, default=7.0, help="history span in days (default 7)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--end", type=float, default=None, help="epoch seconds (not "
                   "milliseconds) of the newest history (default: now)")
    p.add_argument("--progress", action="store_true", help="show progress even when piped")
    p.add_argument("--into-existing", action="store_true",
                   help="write into a ledger that already holds runs generate did not write "
                   "(refused without this flag)")
    _add_db(p, reads=False)
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    p.set_defaults(func=_generate)

    p = subparsers.add_parser(
        "dashboard", help="serve the health dashboard (read-only unless --allow-actions)",
        description="Serve the dashboard: read-only pages, JSON and /metrics. With "
        "--allow-actions and a token (--token-file, or $LEDGER_DASHBOARD_TOKEN) it also "
        "serves the operator's actions (clear a cooldown, close a run, settle an unknown "
        "attempt) as POST forms that must carry the token; each is recorded with who and why.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    p.add_argument("--allowed-host", action="append", dest="allowed_hosts", metavar="NAME",
                   help="also answer requests for this host name (repeatable; e.g. the name a "
                   "proxy or browser reaches it by; the name alone, no scheme or port); "
                   "loopback's names and --host always")
    p.add_argument("--forwarded-allow-ips", action="append", metavar="ADDRESSES",
                   help="trust X-Forwarded-Proto (and -For) from these proxies: IP addresses "
                   "or networks, comma-separated or repeated, or '*' for any (default: "
                   "loopback alone). Behind a TLS proxy on another address, pass its address "
                   "and have it send X-Forwarded-Proto, or every browser action is refused")
    p.add_argument("--refresh", type=int, default=30, metavar="SECONDS",
                   help="pages reload themselves this often (default 30; 0: never)")
    p.add_argument("--allow-actions", action="store_true",
                   help="serve the operator's actions (POST, with the token); default: "
                   "read-only, no route writes")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="with --allow-actions: the file holding the token every action must "
                   "carry (default: $LEDGER_DASHBOARD_TOKEN); at least 16 characters")
    _add_db(p)
    p.set_defaults(func=_dashboard)

