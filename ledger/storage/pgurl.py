"""A PostgreSQL URL as libpq takes it: every spelling of several hosts, one connection string.

A ledger on a highly available PostgreSQL names all of its servers, and libpq tries them in
order until one answers (and, with ``target_session_attrs=read-write``, until one takes
writes). Three spellings of that URL are in common use, and each means the same here:

* libpq's lists in the query: ``postgresql+psycopg://u@/db?host=a,b&port=5432,5433``;
* repeated ``host=`` parameters, each with its port (SQLAlchemy's spelling):
  ``postgresql+psycopg://u@/db?host=a:5432&host=b:5433``;
* the hosts in the URL's authority: ``postgresql+psycopg://u@a:5432,b:5433/db``.

:func:`hosts_to_query` rewrites the last one into the first before SQLAlchemy parses the URL
(its parser takes one host there), and :func:`conninfo` turns the parsed URL into the libpq
connection string that every connection of the store is made with — the hot path's and the
cold path's alike (:mod:`ledger.storage.pgpool`), blocking and asyncio. The other query
parameters (``target_session_attrs``, ``connect_timeout``, ``keepalives_idle``, ``sslmode``,
...) pass through to libpq; a URL with more than one host gets ``target_session_attrs=
read-write`` unless it says otherwise, so a connection never lands on a standby.

Nothing here resolves a name or opens a socket: a URL that cannot be read (a port that is not
a number, a host that is not a host name, an address or a socket directory, a count of ports
that fits no count of hosts, an option libpq does not know or a value it would refuse when it
connects, the database, user or password named twice) is refused with
:class:`~ledger.errors.InvalidArgument` naming what is wrong, before any lookup — a mis-split
``host=127.0.0.1:5432`` is never looked up as a host name.
"""

from __future__ import annotations

import ipaddress
import re
from typing import TYPE_CHECKING

from ledger.errors import InvalidArgument

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

_SCHEME = "postgresql+psycopg://"
# A host name (RFC 1123 letters, digits, hyphens and dots; underscores, which container
# networks use); addresses and socket directories are told apart before it is tried.
_HOSTNAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_.])?")
_AUTHORITY = re.compile(r"(?P<user>[^/?#@]*@)?(?P<hosts>[^/?#]*)(?P<tail>.*)", re.S)
_HOSTS = re.compile(r"(?P<hosts>[^/?#]*)(?P<tail>.*)", re.S)
# SQLAlchemy's reading of a user part with a password: a user name without ':' or '/', then
# everything up to the next '@' (a raw '/', '?' or '#' included).
PASSWORD_USER = re.compile(r"[^:/]*:[^@]*@")
_BRACKETED = re.compile(r"\[(?P<host>[^\]]*)\](?::(?P<port>.*))?")
EXAMPLE = ("postgresql+psycopg://USER@/DBNAME?host=HOST1,HOST2&port=PORT1,PORT2 "
           "(or USER@HOST1:PORT1,HOST2:PORT2/DBNAME)")


def _refuse(where: str, fault: str, *, hosts: bool = True) -> InvalidArgument:
    hint = f"; write several hosts as {EXAMPLE}" if hosts else ""
    # Quoted: the redaction of messages reads an option's ``***`` with a ':' after it as a
    # value of its own, and would eat the ':'.
    return InvalidArgument(f"database URL {where!r}: {fault}{hint}", field="url")


def _split_hosts(text: str) -> list[str]:
    """``text`` split at its commas, except inside ``[...]`` (an IPv6 address)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return out


def _port(text: str, where: str, *, hosts: bool = True) -> str:
    if not (text.isascii() and text.isdigit() and 0 < int(text) < 65536):
        raise _refuse(where, f"port {text!r} is not a number from 1 to 65535", hosts=hosts)
    return str(int(text))


def _host(text: str, where: str, *, hosts: bool = True) -> tuple[str, str | None]:
    """One entry of a host list: ``(host, port or None)``, both checked; ``hosts``: whether
    a refusal ends with how to write several hosts (not for a URL of one)."""
    if text.startswith("/"):
        return text, None  # a Unix socket directory
    bracketed = _BRACKETED.fullmatch(text)
    if bracketed is not None:
        host, port = bracketed["host"], bracketed["port"]
        if ":" not in host:  # brackets are for an IPv6 address; anything else is no host
            raise _refuse(where, f"host {text!r} is in brackets but is not an IPv6 address",
                          hosts=hosts)
    elif text.count(":") >= 2:
        host, port = text, None  # an IPv6 address without a port
    else:
        host, _, port_text = text.partition(":")
        port = port_text if ":" in text else None
    if not host:
        raise _refuse(where, f"an empty host in {text!r}" if text else "an empty host",
                      hosts=hosts)
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _refuse(where, f"host {host!r} is not an IPv6 address", hosts=hosts) from None
    elif not _HOSTNAME.fullmatch(host):
        raise _refuse(where, f"host {host!r} is not a host name, an IP address or a socket "
                             "directory", hosts=hosts)
    elif re.fullmatch(r"[0-9.]+", host):
        # No top-level domain is numeric: libpq would look a mistyped address up as a name.
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise _refuse(where, f"host {host!r} is not an IPv4 address", hosts=hosts) from None
    return host, None if port is None else _port(port, where, hosts=hosts)


# The values libpq accepts for the connection options the ledger's users set most; libpq
# itself checks them only when it connects, and its refusal then reads as an outage.
_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "target_session_attrs": ("any", "read-write", "read-only", "primary", "standby",
                             "prefer-standby"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "load_balance_hosts": ("disable", "random"),
}
_WHOLE_NUMBERS = ("connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval",
                  "keepalives_count", "tcp_user_timeout")


def _option(key: str, value: str, where: str) -> str:
    """``value`` of the connection option ``key``, checked where libpq would refuse it only
    when it connects."""
    choices = _CHOICES.get(key)
    if choices is not None and value not in choices:
        raise _refuse(where, f"{key}={value!r} is not one of {', '.join(choices)}", hosts=False)
    if key in _WHOLE_NUMBERS and not (value.isascii() and value.isdigit()):
        raise _refuse(where, f"{key}={value!r} is not a whole number of seconds (or a count)",
                      hosts=False)
    if key == "hostaddr":
        for entry in value.split(","):
            try:
                ipaddress.ip_address(entry)
            except ValueError:
                raise _refuse(where, f"hostaddr {entry!r} is not an IP address (hostaddr= "
                                     "takes addresses; names go in host=)", hosts=False) from None
    return value


def refuse_blank_options(norm: str, where: str) -> None:
    """Refuse a query parameter given without a value (``?host=``, ``sslmode=``, a bare
    ``?sslmode``): SQLAlchemy drops it, so libpq would silently use its default (for
    ``host=``, the local socket; for ``sslmode``, ``prefer``)."""
    if not norm.startswith(_SCHEME):
        return
    # A password may hold a raw '?' (SQLAlchemy reads it up to its '@'): the query begins
    # after the user part, or a password's tail would be read as a bare parameter.
    user = PASSWORD_USER.match(norm, len(_SCHEME))
    query = norm[len(_SCHEME) if user is None else user.end():].partition("?")[2]
    for pair in query.split("&"):
        key, eq, value = pair.partition("=")
        # An empty dbname= is the URL naming no database, which its own check names as such.
        if key and key != "dbname" and (not eq or not value or value.startswith("#")):
            # A bare key's '#...' is a fragment, not part of its name.
            key = key.partition("#")[0] or key
            raise _refuse(where, f"parameter {key!r} is given no value: give it one "
                                 f"({key}=VALUE), or leave it out", hosts=False)


def hosts_to_query(norm: str, where: str) -> str:
    """``norm`` (a ``postgresql+psycopg://`` URL) with several hosts in its authority
    rewritten as libpq's ``?host=...&port=...`` lists; any other URL as it is."""
    if not norm.startswith(_SCHEME):
        return norm
    rest = norm[len(_SCHEME):]
    # RFC 3986: the user part ends at '@' and holds no '/', '?' or '#' (encode them).
    parts = _AUTHORITY.match(rest)
    assert parts is not None  # every part is optional
    # SQLAlchemy reads a password up to its '@' whatever it holds, and so the ledger connects
    # with one that holds a raw '/', '?' or '#': the hosts begin after it.
    password = PASSWORD_USER.match(rest)
    if password is not None and password.end() != len(parts["user"] or ""):
        if ("," in parts["hosts"] or parts["user"] is not None) and "@" not in parts["hosts"]:
            # Hosts (or a user part) before an '@' in a query value, or a password that holds
            # a ',' too: which is meant cannot be told, and the message may quote neither.
            raise _refuse(where, "cannot tell where its user part ends: percent-encode a '/', "
                                 "'?', '#' or ',' in the password (%2F, %3F, %23, %2C) and an "
                                 "'@' in a query value (%40)", hosts=False)
        user_end = password.end()
    else:
        user_end = len(parts["user"] or "")
    after = _HOSTS.match(rest, user_end)
    assert after is not None  # both parts are optional
    user, hostlist, tail = rest[:user_end], after["hosts"], after["tail"]
    if "," not in hostlist:
        if hostlist.startswith("["):
            # SQLAlchemy drops the brackets: check them while they show.
            _host(hostlist, where, hosts=False)
        elif hostlist.count(":") == 1:
            # SQLAlchemy's own refusal of the port is Python's int() message.
            _port(hostlist.partition(":")[2], where, hosts=False)
        return norm
    hosts, ports = [], []
    for entry in _split_hosts(hostlist):
        host, port = _host(entry, where)
        hosts.append(host)
        ports.append(port or "")
    path, _, query = tail.partition("?")
    if re.search(r"(?:^|&)(?:host|port)=", query):
        raise _refuse(where, "the hosts are named twice: in the URL's authority and as host= "
                             "or port=")
    lists = "host=" + ",".join(hosts)
    if any(ports):
        lists += "&port=" + ",".join(ports)
    return f"{_SCHEME}{user}{path or '/'}?{lists}" + (f"&{query}" if query else "")


def conninfo(parsed: URL, where: str, *, reads: bool = False) -> str:
    """The libpq connection string of the parsed ``postgresql+psycopg://`` URL ``parsed``
    (``where``: the URL without its password, for messages). Refuses what libpq would
    misread, with :class:`~ledger.errors.InvalidArgument` (``field="url"``).

    ``reads``: the URL of a read replica (``read_url=``): several hosts default to
    ``target_session_attrs=prefer-standby`` (a standby when one answers, else the primary),
    and every session is read-only (``default_transaction_read_only``), so that nothing is
    ever written through it, whichever server it reached."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    query = dict(parsed.query)
    raw_hosts, raw_ports = query.pop("host", None), query.pop("port", None)
    entries: list[tuple[str, str | None]] = []
    if parsed.host:
        if raw_hosts is not None:
            raise _refuse(where, "the host is named twice: in the URL's authority and as host=")
        entries.append(_host(f"[{parsed.host}]" if ":" in parsed.host else parsed.host, where,
                             hosts=False))
    named = [entry for value in ((raw_hosts,) if isinstance(raw_hosts, str) else raw_hosts or ())
             for entry in _split_hosts(value)]
    entries += [_host(entry, where, hosts=len(named) > 1) for entry in named]
    listed = [p for value in ((raw_ports,) if isinstance(raw_ports, str) else raw_ports or ())
              for p in value.split(",")]
    if parsed.port is not None:
        if listed:
            raise _refuse(where, "the port is named twice: in the URL's authority and as port=")
        listed = [str(parsed.port)]
    inline = [port for _, port in entries if port is not None]
    if inline and listed:
        raise _refuse(where, "the ports are named twice: as host=HOST:PORT and as port=")
    if listed:
        ports = [_port(p, where, hosts=len(entries) > 1) if p else "" for p in listed]
        if len(ports) != 1 and len(ports) != len(entries):
            raise _refuse(where, f"{len(entries)} host(s) but {len(ports)} ports: give one port "
                                 "for every host, or one for all")
    else:
        ports = [port or "" for _, port in entries] if inline else []
    params: dict[str, str] = {}
    for key, given in query.items():
        if not isinstance(given, str):
            raise _refuse(where, f"parameter {key!r} is given {len(given)} times; give it once",
                          hosts=False)
        params[key] = _option(key, given, where)
    for key, in_url in (("dbname", parsed.database), ("user", parsed.username),
                        ("password", parsed.password)):
        if in_url and key in params:
            raise _refuse(where, f"the {key} is named twice: in the URL and as {key}=",
                          hosts=False)
    if len(entries) > 1:
        # libpq takes the first server that answers; only the primary takes writes, and
        # reads for people go to a standby when there is one.
        params.setdefault("target_session_attrs", "prefer-standby" if reads else "read-write")
    if reads:
        params["options"] = " ".join(
            filter(None, (params.get("options"), "-c default_transaction_read_only=on")))
    kwargs = {"dbname": parsed.database, "user": parsed.username, "password": parsed.password,
              "host": ",".join(h for h, _ in entries) or None, "port": ",".join(ports) or None,
              **params}
    try:
        return make_conninfo(**{k: v for k, v in kwargs.items() if v is not None})
    except psycopg.ProgrammingError as e:  # libpq's own parser: an option it does not know
        raise _refuse(where, f"{str(e).strip().splitlines()[0]} (the query parameters are "
                             "libpq's connection options)", hosts=False) from e


__all__ = ["EXAMPLE", "PASSWORD_USER", "conninfo", "hosts_to_query", "refuse_blank_options"]
