"""An async Run session's first entry imports the adapters (httpx, the protocols: some 0.2 s)
off the event loop, which the session must never hold up. A fresh interpreter records which
thread imports ``ledger.adapters``; SQLite file, the shipped fake provider on loopback."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import asyncio, sys, threading
    from decimal import Decimal

    importers = []

    class Watch:
        def find_spec(self, name, path=None, target=None):
            if name == "ledger.adapters":
                importers.append(threading.current_thread() is threading.main_thread())
            return None

    sys.meta_path.insert(0, Watch())

    from ledger import AsyncLedger, Budget, Envelope, Grant, Part
    from ledger.testing import FakeProvider
    from tests.fakeplan import plan

    async def main(fake):
        async with await AsyncLedger.open(sys.argv[1]) as led:
            assert "ledger.adapters" not in sys.modules
            async with led.run("r", plan=plan(fake), grant=Grant(recipients={"fake": [
                    "user_input"]}), budget=Budget(max_calls=2, max_retries=1,
                                                   max_cost=Decimal("1"))) as run:
                await run.turn(Envelope(parts=[Part(content="hello")]))

    with FakeProvider().in_thread() as fake:
        asyncio.run(main(fake))
    print("on the loop" if any(importers) else "off the loop", importers)
""")


def test_the_first_async_session_imports_the_adapters_off_the_event_loop(tmp_path: Path
                                                                         ) -> None:
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "l.db")],
                         capture_output=True, text=True, cwd=str(REPO), timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("off the loop [False]"), res.stdout
