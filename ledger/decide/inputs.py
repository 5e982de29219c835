"""What the selector read for one decision, recorded beside the decision, and read back.

The retry owner writes each decision of a turn with the inputs it was made from (the ``select``
event of the Attempt it led to, or the ``stop`` event of a turn that stopped): the time, what
the Run still allowed, what the turn had tried, the capacity-group projections and health the
selector read (with their sample times), and the first failed preflight check of each plan
route. With the Run's frozen plan, grant, role and policy and the failure fact recorded on the
failed Attempt, that is everything :func:`~ledger.decide.select.select` reads, so a decision can
be recomputed exactly from the ledger alone (:func:`selection_input`), under its own policy or
another one (``failover-ledger replay``).

The record is compact JSON: only what can change a decision is kept. A group projection counts
only when it is not ``open`` (an open group never eliminates a candidate), a health key only
when one of the four fields the selector reads (``cooldown_until``, ``disabled_until``,
``last_probe_at``, ``last_used``) is set, a preflight verdict only when the route fails it.
Empty members are left out. Its keys (``v`` is the format's version, :data:`INPUTS_VERSION`):

========== ==========================================================================
``by``     how the decision was made: ``select`` (the selector), ``retry`` (the policy's
           same-route retry rule; the inputs are what the selector would have read),
           ``after_rejection`` (the policy's rule after an admission refusal)
``on``     what it decides: ``new_turn``, ``failure`` (after a failed Attempt), ``rejection``
           (after a capacity group refused one)
``turn``   the logical turn id
``at``     the decision's time (the snapshot's), epoch seconds
``failed`` the Attempt whose failure fact it decides on
``current``, ``profile``, ``pin``  the route, profile and pin it decides from
``left``   ``[retries left, model calls left]``
``tried``, ``tried_profiles``, ``tried_pairs``, ``no_probe``  the turn's exclusions
``groups`` ``{group: [mode, until, sampled_at]}``, as the selector read them
``refused`` the groups that refused an Attempt of this turn (in ``groups`` as unavailable)
``health`` ``{key: [cooldown_until, disabled_until, last_probe_at, last_used]}``
``preflight`` ``{route: [check, detail, fix]}``
========== ==========================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from ledger.decide.health import PROVIDER_KEY_PREFIX, canonical_key, provider_key
from ledger.decide.preflight import Check, PreflightFailure
from ledger.decide.profiles import Pin
from ledger.decide.select import RunPermissions, SelectionInput
from ledger.domain.facts import FailureFact
from ledger.domain.values import Grant, GroupMode, GroupProjection, Health, Route
from ledger.errors import InvalidArgument
from ledger.policy.model import Policy

#: The version of the recorded format (``"v"``); a reader refuses any but it and
#: :data:`READ_VERSIONS`. 2: a provider's health key is folded (migration 0020) in every
#: record; a version-1 record may keep it as a route spelled it.
INPUTS_VERSION = 2
#: The versions a reader takes: the same members; a version-1 record's provider keys are
#: folded as it is read (:func:`parse_inputs`).
READ_VERSIONS = (1, 2)

#: How a recorded decision was made (``by``).
BY = ("select", "retry", "after_rejection")
#: What a recorded decision decides (``on``).
ON = ("new_turn", "failure", "rejection")


@dataclass(frozen=True)
class RecordedInputs:
    """The inputs of one decision as recorded, read back (:func:`parse_inputs`).

    Attributes:
        by: How the decision was made: ``select``, ``retry`` or ``after_rejection``.
        on: What it decides: ``new_turn``, ``failure`` or ``rejection``.
        turn: The logical turn id.
        at: The decision's time.
        failed: The Attempt whose failure fact the decision follows (``on == "failure"``).
        current: The route it decides from (the failed one, or the Run's current route).
        current_profile: The credential profile it decides from.
        pin: How that profile was pinned.
        retries_left: Retry permissions the Run had left.
        calls_left: Model calls the Run had left.
        tried: Routes the turn had ruled out.
        tried_profiles: Profiles the turn had ruled out on every route.
        tried_pairs: (route, profile) pairs that failed in the turn.
        no_probe: Routes whose probe another process had claimed.
        groups: The capacity-group projections the selector read, by group.
        refused: Groups whose admission refused an Attempt of the turn.
        health: The health the selector read, by key (only the fields it reads), a provider's
            key in a version-1 record folded as the selector looks it up now
            (:func:`~ledger.decide.health.provider_key`; :func:`parse_inputs`).
        verdicts: The first failed preflight check of each plan route that fails.
        version: The record's format (``v``): 1 may predate the folded provider keys
            (:func:`decided_again`).
    """

    by: str
    on: str
    turn: str
    at: float
    failed: str | None
    current: str | None
    current_profile: str | None
    pin: Pin | None
    retries_left: int
    calls_left: int
    tried: frozenset[str]
    tried_profiles: frozenset[str]
    tried_pairs: frozenset[tuple[str, str]]
    no_probe: frozenset[str]
    groups: Mapping[str, GroupProjection]
    refused: frozenset[str]
    health: Mapping[str, Health]
    verdicts: Mapping[str, PreflightFailure]
    version: int = INPUTS_VERSION


def _health_row(h: Health) -> list[float | None] | None:
    row = [h.cooldown_until, h.disabled_until, h.last_probe_at, h.last_used]
    return row if any(v is not None for v in row) else None


def record_inputs(inp: SelectionInput, *, by: str, on: str, turn: str,
                  failed: str | None = None, refused: Sequence[str] = ()) -> dict[str, Any]:
    """The compact JSON record of what ``inp`` gives the selector (see the module docstring).

    ``inp`` must carry its preflight verdicts (:func:`~ledger.decide.select.preflight_verdicts`),
    so that the record holds every check the selector could make.

    Args:
        inp: The selection input the decision was made from (or, for ``by="retry"``, the one the
            selector would have been given).
        by: ``select``, ``retry`` or ``after_rejection``.
        on: ``new_turn``, ``failure`` or ``rejection``.
        turn: The logical turn id.
        failed: The Attempt whose failure ``inp.failure`` is.
        refused: The groups whose admission refused an Attempt of the turn.

    Raises:
        InvalidArgument: ``inp`` has no verdicts, or ``by``/``on`` is not one of the above.
    """
    if inp.verdicts is None:
        raise InvalidArgument("record_inputs needs the input's preflight verdicts; pass "
                              "replace(inp, verdicts=preflight_verdicts(inp))", field="verdicts")
    if by not in BY or on not in ON:
        raise InvalidArgument(f"by must be one of {BY} and on one of {ON}", field="by")
    perm = inp.permissions
    out: dict[str, Any] = {"v": INPUTS_VERSION, "by": by, "on": on, "turn": turn,
                           "at": inp.now, "left": [perm.retries_left, perm.calls_left]}
    optional: dict[str, Any] = {
        "failed": failed, "current": inp.current, "profile": inp.current_profile,
        "pin": inp.pin.value if inp.pin is not None else None,
        "tried": sorted(perm.tried), "tried_profiles": sorted(perm.tried_profiles),
        "tried_pairs": sorted([r, p] for r, p in perm.tried_pairs),
        "no_probe": sorted(inp.no_probe),
        "groups": {g: [p.mode.value, p.until, p.sampled_at]
                   for g, p in sorted(inp.groups.items()) if p.mode is not GroupMode.OPEN},
        "refused": sorted(set(refused)),
        "health": {k: row for k, h in sorted(inp.health.items())
                   if (row := _health_row(h)) is not None},
        "preflight": {r: [v.check.value, v.detail, v.fix]
                      for r, v in sorted(inp.verdicts.items()) if v is not None},
    }
    out.update({k: v for k, v in optional.items() if v})
    return out


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"recorded inputs: {name} is not a number", field=name)
    return float(value)


def _maybe(value: Any, name: str) -> float | None:
    return None if value is None else _number(value, name)


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"recorded inputs: {name} is not a text", field=name)
    return value


def _optional_text(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    return None if value is None else _text(value, key)


def _texts(data: Mapping[str, Any], name: str) -> frozenset[str]:
    value = data.get(name)
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"recorded inputs: {name} is not a list of texts", field=name)
    return frozenset(value)


def _table(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"recorded inputs: {name} is not an object", field=name)
    return value


def _group(g: str, row: Any) -> GroupProjection:
    mode, until, sampled = row
    return GroupProjection(group=g, mode=GroupMode(mode), until=_maybe(until, "groups"),
                           sampled_at=_maybe(sampled, "groups"))


def _health(k: str, row: Any) -> Health:
    cu, du, lp, lu = (_maybe(v, "health") for v in row)
    return Health(key=k, cooldown_until=cu, disabled_until=du, last_probe_at=lp, last_used=lu)


def _read_keys(version: int, plan: Sequence[Route],
               policy: Policy | None) -> Callable[[str], tuple[str, ...]]:
    """How a recorded health key of a record of ``version`` over ``plan`` is looked up now.

    Only a provider's key can have changed, and only in a version-1 record: one made before
    migration 0020 keeps it as a route spelled its provider. Which recorded keys are a
    provider's the record alone cannot say (a route or profile id may be ``provider:Foo``
    too, and is read as it is); ``policy``, the one the decision was made under, can: only
    under ``health.key: provider`` does the selector read a provider's key, ``provider:`` and
    the name as a route of the plan spells it. A profile id spelled so was read through the
    same row then, and is kept under its own key as well.
    """
    if version >= 2 or policy is None or policy.health.key != "provider":
        return lambda k: (k,)
    spelled = {PROVIDER_KEY_PREFIX + r.provider for r in plan}
    profiles = {p.id for r in plan for p in r.profiles}

    def keys(k: str) -> tuple[str, ...]:
        if k not in spelled:
            return (k,)
        folded = canonical_key(k)
        return (folded, k) if k in profiles and k != folded else (folded,)
    return keys


def _read_health(table: Mapping[str, Any], keys: Callable[[str], tuple[str, ...]],
                 memo: dict[Any, Any]) -> dict[str, Health]:
    """The recorded health by the key the selector looks each up under now (``keys``).

    Rows that come to one key (spellings of one provider in a version-1 record) merge as
    migration 0020 merged the stored rows: the later cooldown end, disable, probe and use of
    them.
    """
    rows: dict[str, list[Any]] = {}
    for k, row in table.items():
        for key in keys(k):
            rows.setdefault(key, []).append(row)
    health = {}
    for key, same in rows.items():
        row = same[0] if len(same) == 1 else [
            max((v for v in col if v is not None), default=None)
            for col in zip(*same, strict=True)]
        health[key] = _memo(memo, ("h", key, *row), partial(_health, key, row))
    return health


def decided_again(rec: RecordedInputs, plan: Sequence[Route], policy: Policy) -> bool:
    """Whether ``rec`` can decide its decision again over ``plan`` under ``policy``.

    ``plan`` and ``policy`` are the Run's frozen ones, which the decision was made under. Not
    when it may have been recorded before migration 0020 folded provider keys (a version-1
    record), two keys the selector read apart then are one key now, and the record holds its
    health: under ``health.key: provider``, a plan that spells one provider two ways
    (``OpenAI``, ``openai``), or a profile id that is a provider's folded key. The selector
    then read each under a key of its own, and a row under one (the only one recorded, a
    healthy key has none) was never read for the other, which the one key now cannot give
    back. With one spelling, folding renames the key and decides alike; under another
    ``health.key`` no provider's key is read, and nothing was folded. Conservative: a
    version-1 record made after 0020 over such a plan is not decided again either, since
    nothing in it says when.
    """
    if rec.version >= 2 or policy.health.key != "provider":
        return True
    # The keys read then, by the key each is read under now.
    then: dict[str, set[str]] = {}
    for r in plan:
        then.setdefault(provider_key(r.provider), set()).add(PROVIDER_KEY_PREFIX + r.provider)
        for p in r.profiles:
            then.setdefault(p.id, set()).add(p.id)
    merged = {now for now, read in then.items() if len(read) > 1}
    return not merged.intersection(rec.health)


def _verdict(row: Any) -> PreflightFailure:
    check, detail, fix = row
    return PreflightFailure(Check(check), _text(detail, "preflight"), _text(fix, "preflight"))


def _memo(memo: dict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
    try:
        return memo[key]
    except KeyError:
        value = memo[key] = make()
        return value
    except TypeError:  # an unhashable row: read it as it is (its validation says why)
        return make()


def parse_inputs(data: Any, *, plan: Sequence[Route], policy: Policy | None,
                 memo: dict[Any, Any] | None = None) -> RecordedInputs:
    """The recorded inputs of one decision, read back from its JSON record.

    Args:
        data: The record (the ``inputs`` member of a ``select`` or ``stop`` event).
        plan: The frozen plan of the decision's Run.
        policy: The frozen policy of the decision's Run, which it was made under: a record of
            format 1 has its provider keys folded, and only under ``health.key: provider`` is
            a ``provider:`` key a provider's (a route or profile id may be spelled so too).
            ``None`` (a policy that does not read): every key is read as recorded.
        memo: Where projections, health and verdicts already read are kept, so that one
            reader of many records validates each distinct one once.

    Raises:
        InvalidArgument: ``data`` is not such a record (another version, a missing or
            mistyped member; ``field`` names it).
    """
    if not isinstance(data, Mapping) or data.get("v") not in READ_VERSIONS:
        raise InvalidArgument("not a record of selection inputs of version "
                              + " or ".join(map(str, READ_VERSIONS)), field="v")
    memo = {} if memo is None else memo
    try:
        by, on = data.get("by"), data.get("on")
        if by not in BY or on not in ON:
            raise InvalidArgument(f"recorded inputs: unknown by {by!r} or on {on!r}",
                                  field="by")
        left = data.get("left")
        if not isinstance(left, list) or len(left) != 2:
            raise InvalidArgument("recorded inputs: left is not [retries, calls]", field="left")
        pairs = data.get("tried_pairs", [])
        if not isinstance(pairs, list) or any(
                not isinstance(p, list) or len(p) != 2 for p in pairs):
            raise InvalidArgument("recorded inputs: tried_pairs is not a list of pairs",
                                  field="tried_pairs")
        groups = {g: _memo(memo, ("g", g, *row), partial(_group, g, row))
                  for g, row in _table(data, "groups").items()}
        health = _read_health(_table(data, "health"),
                              _read_keys(int(data["v"]), plan, policy), memo)
        verdicts = {r: _memo(memo, ("v", *row), partial(_verdict, row))
                    for r, row in _table(data, "preflight").items()}
        pin = data.get("pin")
        return RecordedInputs(
            by=by, on=on, turn=_text(data.get("turn"), "turn"), at=_number(data.get("at"), "at"),
            failed=_optional_text(data, "failed"), current=_optional_text(data, "current"),
            current_profile=_optional_text(data, "profile"),
            pin=None if pin is None else Pin(pin),
            retries_left=int(_number(left[0], "left")), calls_left=int(_number(left[1], "left")),
            tried=_texts(data, "tried"), tried_profiles=_texts(data, "tried_profiles"),
            tried_pairs=frozenset((_text(r, "tried_pairs"), _text(p, "tried_pairs"))
                                  for r, p in pairs),
            no_probe=_texts(data, "no_probe"), groups=groups,
            refused=_texts(data, "refused"), health=health, verdicts=verdicts,
            version=int(data["v"]))
    except InvalidArgument:
        raise
    except (TypeError, ValueError) as e:  # a row of the wrong shape, an unknown enum value
        raise InvalidArgument(f"recorded inputs do not read: {e}", field="inputs") from e


def selection_input(rec: RecordedInputs, *, plan: Sequence[Route], policy: Policy, role: str,
                    grant: Grant | None, failure: FailureFact | None,
                    health: Mapping[str, Health] | None = None,
                    groups: Mapping[str, GroupProjection] | None = None,
                    tried_profiles: frozenset[str] | None = None) -> SelectionInput:
    """The selection input ``rec`` records, for the Run's frozen ``plan``, ``role``, ``grant``.

    Under its own frozen ``policy`` and with the failure fact recorded on ``rec.failed``,
    :func:`~ledger.decide.select.select` of the result is the recorded decision, exactly.

    Args:
        rec: The recorded inputs.
        plan: The Run's frozen plan.
        policy: The policy to decide under (the Run's own, or another one to replay).
        role: The Run's role.
        grant: The Run's frozen grant.
        failure: The failure fact of ``rec.failed`` (``None`` when the decision follows none).
        health: Health to decide on instead of the recorded (another policy's own).
        groups: Group projections to decide on instead of the recorded.
        tried_profiles: Profiles ruled out instead of the recorded (another policy's rule).
    """
    verdicts: dict[str, PreflightFailure | None] = {r.id: None for r in plan}
    verdicts.update(rec.verdicts)
    return SelectionInput(
        plan=plan,
        permissions=RunPermissions(
            retries_left=rec.retries_left, calls_left=rec.calls_left, tried=rec.tried,
            tried_profiles=rec.tried_profiles if tried_profiles is None else tried_profiles,
            tried_pairs=rec.tried_pairs),
        policy=policy, now=rec.at, role=role, grant=grant,
        groups=rec.groups if groups is None else groups,
        health=rec.health if health is None else health, current=rec.current,
        current_profile=rec.current_profile, pin=rec.pin, failure=failure,
        no_probe=rec.no_probe, verdicts=verdicts)


__all__ = [
    "BY",
    "INPUTS_VERSION",
    "ON",
    "READ_VERSIONS",
    "RecordedInputs",
    "decided_again",
    "parse_inputs",
    "record_inputs",
    "selection_input",
]
