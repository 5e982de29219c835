"""A reader's role on a test database, made as docs/auditor-role.md makes one."""

from __future__ import annotations

from typing import Any


def reader_role(pg_server: Any, pg_url: str, *, read_only_sessions: bool = True) -> str:
    """The URL of ``pg_url``'s database as a new role granted ``SELECT`` on the ledger's tables
    (docs/auditor-role.md), whose sessions in that database are read-only when
    ``read_only_sessions`` (the page's optional ``default_transaction_read_only``; without it
    a write is refused for want of the privilege). Named after the database: roles are the
    server's, databases the test's."""
    db = pg_url.rsplit("/", 1)[1]
    role = f"reader_{db}"
    pg_server.psql(f"CREATE ROLE {role} LOGIN")
    pg_server.psql(f"GRANT USAGE ON SCHEMA public TO {role}; "
                   f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}", db)
    if read_only_sessions:
        pg_server.psql(f"ALTER ROLE {role} IN DATABASE {db} "
                       "SET default_transaction_read_only = on")
    return pg_url.replace(f"{pg_server.user}@", f"{role}@", 1)
