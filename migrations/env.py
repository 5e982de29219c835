"""Alembic environment for the ledger.

The ledger runs migrations programmatically (``ledger.storage.migrate``), passing an open
connection in ``config.attributes["connection"]``; ``alembic -x url=... upgrade head`` with the
repository's ``alembic.ini`` works too.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from ledger.storage.engine import normalize_url
from ledger.storage.migrate import comparison_options
from ledger.storage.schema import metadata

config = context.config


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        **comparison_options(connection.dialect.name),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Migrate the connection the ledger hands over, else the ``-x url=`` database.

    The ledger migrates in its own transaction; the alembic command opens its own connection.
    """
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    )
    if not url:
        raise SystemExit("pass the database with: alembic -x url=<URL> upgrade head")
    engine = create_engine(normalize_url(url))
    with engine.connect() as conn:
        _run(conn)


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run against a database")
run_migrations_online()
