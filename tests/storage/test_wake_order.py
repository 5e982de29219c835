"""The waiters' wake-ups of one process (:mod:`ledger.storage.wake`) keep each group's waiters
indexed in serving order; they must wake and poll exactly as a scan of every waiter would.

The model below is that scan, said plainly: the earliest waiter of a group is the lowest ticket,
and among equal tickets the one registered first (a waiter registered again, or moved to a new
ticket, keeps its arrival). Random operations (seeded) on the registry and on the model must
agree after every step: who is woken, who polls, and what each call returns.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from ledger.storage import wake


@dataclass
class _Waiter:
    group: str
    ticket: int
    woken: bool = False


class _Scan:
    """Every waiter of every database in registration order, each question a scan."""

    def __init__(self) -> None:
        self.by_key: dict[str, dict[str, _Waiter]] = {}

    def _earliest(self, key: str, group: str) -> str | None:
        mine = [(w.ticket, n, wid) for n, (wid, w) in enumerate(self.by_key.get(key, {}).items())
                if w.group == group]
        return min(mine)[2] if mine else None

    def _wake_first(self, key: str, group: str) -> int:
        idle = [(w.ticket, n, w) for n, w in enumerate(self.by_key.get(key, {}).values())
                if w.group == group and not w.woken]
        if not idle:
            return 0
        min(idle, key=lambda t: t[:2])[2].woken = True
        return 1

    def _hand_over(self, key: str, group: str, before: str | None, at_begin: str) -> None:
        now = self._earliest(key, group)
        if now is not None and now != before and now != at_begin:
            self.by_key[key][now].woken = True

    def add(self, key: str, wid: str, group: str, ticket: int) -> None:
        before = self._earliest(key, group)
        self.by_key.setdefault(key, {})[wid] = _Waiter(group, ticket)
        self._hand_over(key, group, before, wid)

    def retick(self, key: str, wid: str, ticket: int) -> bool:
        w = self.by_key.get(key, {}).get(wid)
        if w is None:
            return False
        before = self._earliest(key, w.group)
        w.ticket = ticket
        self._hand_over(key, w.group, before, wid)
        return True

    def remove(self, key: str, wid: str) -> bool:
        waiters = self.by_key.get(key, {})
        gone = waiters.get(wid)
        if gone is not None:
            before = self._earliest(key, gone.group)
            del waiters[wid]
            if gone.woken:
                self._wake_first(key, gone.group)
            self._hand_over(key, gone.group, before, wid)
        if not waiters:
            self.by_key.pop(key, None)
            return True
        return False

    def poke(self, key: str, group: str | None) -> int:
        if group is not None:
            return self._wake_first(key, group)
        waiters = list(self.by_key.get(key, {}).values())
        for w in waiters:
            w.woken = True
        return len(waiters)

    def polls(self, key: str, wid: str) -> bool:
        w = self.by_key.get(key, {}).get(wid)
        return w is not None and self._earliest(key, w.group) == wid


@pytest.mark.parametrize("seed", range(6))
def test_the_earliest_waiter_of_a_group_is_the_one_a_scan_of_every_waiter_finds(
        seed: int) -> None:
    rng = random.Random(seed)
    registry, scan = wake._Registry(), _Scan()
    signals: dict[tuple[str, str], wake._Signal] = {}
    keys, groups, ids = ["db-1", "db-2"], ["ga", "gb", "gc"], [f"w{i}" for i in range(12)]
    for _ in range(3000):
        key, wid = rng.choice(keys), rng.choice(ids)
        ticket = rng.randrange(8)  # few tickets: ties happen, and arrival decides them
        op = rng.random()
        if op < 0.3:
            group = rng.choice(groups)
            signal = wake._Signal(group, ticket)
            registry.add(key, wid, signal)
            signals[key, wid] = signal
            scan.add(key, wid, group, ticket)
        elif op < 0.45:
            assert registry.retick(key, wid, ticket) == scan.retick(key, wid, ticket)
        elif op < 0.65:
            assert registry.remove(key, wid) == scan.remove(key, wid)
            signals.pop((key, wid), None)
        elif op < 0.8:
            group = rng.choice(groups)
            assert registry.poke(key, group) == scan.poke(key, group)
        elif op < 0.82:
            assert registry.poke(key, None) == scan.poke(key, None)
        elif (key, wid) in signals:  # back at its wait: its signal is cleared
            signals[key, wid].clear()
            scan.by_key[key][wid].woken = False
        for (k, w), s in signals.items():
            assert s.event.is_set() == scan.by_key[k][w].woken, (k, w)
            assert registry.polls(k, w) == scan.polls(k, w), (k, w)
        assert set(registry.by_key) == set(scan.by_key)
