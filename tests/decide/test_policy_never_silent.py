"""A policy setting that could never do what it says is refused at load, naming the field and the
fix: an enabled failover with nothing that moves on, a provider's failure classified as the
ledger's own ``unusable`` (or a retry, cooldown or disable rule naming it), a Retry-After cap on
a rule that reads no hints, and a retry rule's transport kind that an earlier rule's category
already takes. A Run admitted before these rules reads its policy back as it was (invariant 5)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ledger.decide.classify import classify
from ledger.decide.retry import retry_decision
from ledger.domain.facts import Category, Observation, Transport
from ledger.errors import PolicyError
from ledger.policy.load import PRESETS, load_policy, preset, validate_policy
from ledger.policy.model import FROZEN, Policy

REPO = Path(__file__).resolve().parents[2]
MOVES: dict[str, object] = {"moves_on": [{"categories": ["overloaded"]}]}


def _refused(data: dict[str, object]) -> list[tuple[str, str, str]]:
    with pytest.raises(PolicyError) as info:
        validate_policy(data)
    return info.value.errors


def _read_back_as_frozen(data: dict[str, object]) -> Policy:
    return Policy.model_validate(data, context=FROZEN)


# -- failover on, nothing moves on -------------------------------------------------------------


@pytest.mark.parametrize("data", [
    {"name": "mine", "failover": {"enabled": True}},
    {"name": "mine"},  # enabled by default
], ids=["enabled", "default"])
def test_an_enabled_failover_names_at_least_one_failure_that_moves_on(
        data: dict[str, object]) -> None:
    """``failover: {enabled: true}`` without ``moves_on`` loaded and never failed over: every
    failure a provider answered stopped the request."""
    [(field, problem, fix)] = _refused(data)
    assert field == "moves_on" and "moves_on is left out" in problem
    assert "add a moves_on rule" in fix and "moves_on: []" in fix
    assert "failover.enabled: false" in fix
    assert not _read_back_as_frozen(data).moves_on
    off = validate_policy({**data, "failover": {"enabled": False}})
    assert not off.failover.enabled and not off.moves_on
    assert validate_policy({**data, **MOVES}).moves_on


def test_an_explicitly_empty_moves_on_keeps_a_request_on_its_route_but_skips_an_unusable_one(
        ) -> None:
    """``moves_on: []`` said on purpose is a policy of its own, not the silent default: no
    provider failure moves on, yet a route that cannot be built is skipped, which
    ``failover.enabled: false`` does not do (it stops every failure)."""
    sticky = validate_policy({"name": "sticky", "moves_on": []})
    assert sticky.failover.enabled and sticky.moves_on == []
    for obs in (Observation(status=503, body="unavailable"),
                Observation(transport=Transport.CONNECT_REFUSED)):
        assert not classify(obs, sticky).moves_on
    unusable = Observation(transport=Transport.CANNOT_BUILD)
    assert classify(unusable, sticky).moves_on


def test_the_cli_refuses_an_enabled_failover_with_no_moves_on(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    from ledger.cli.main import main

    mine = tmp_path / "mine.yaml"
    mine.write_text("name: mine\nfailover:\n  enabled: true\n", encoding="utf-8")
    assert main(["policy", "check", str(mine)]) == 2
    err = capsys.readouterr().err
    assert "field: moves_on" in err and "fix: add a moves_on rule" in err


# -- `unusable` is the ledger's own fact -------------------------------------------------------


@pytest.mark.parametrize(("classification", "field"), [
    ({"status": {401: "unusable"}}, "classification.status.401"),
    ({"status_4xx": "unusable"}, "classification.status_4xx"),
    ({"codes": {"openai_code": {"invalid_api_key": "unusable"}}},
     "classification.codes.openai_code.invalid_api_key"),
    ({"status_text": [{"statuses": [403], "patterns": ["key"], "category": "unusable"}]},
     "classification.status_text[0].category"),
    ({"text": [{"category": "unusable", "patterns": ["no such key"]}]},
     "classification.text[0].category"),
    ({"transports": {"dns_failure": "unusable"}}, "classification.transports.dns_failure"),
], ids=["status", "status_4xx", "codes", "status_text", "text", "transports"])
def test_no_providers_failure_is_classified_as_the_ledgers_own_unusable(
        classification: dict[str, object], field: str) -> None:
    """``status: {401: unusable}`` skipped the route whatever moves_on said and never cooled it:
    ``unusable`` is the ledger's "could not build the request", forced to route scope and left
    out of health."""
    data = {"name": "t", **MOVES, "classification": classification}
    [(got, problem, fix)] = _refused(data)
    assert got == field and "the ledger's own fact" in problem and "cannot_build" in problem
    assert "classify it as the failure it is" in fix
    assert _read_back_as_frozen(data).name == "t"


def test_the_ledgers_own_transport_kind_may_still_say_unusable() -> None:
    """Every preset lists ``cannot_build: unusable``, as the classifier reads it anyway."""
    data = {"name": "t", **MOVES, "classification": {"transports": {"cannot_build": "unusable"}}}
    policy = validate_policy(data)
    assert policy.classification.transports == {Transport.CANNOT_BUILD: Category.UNUSABLE}
    fact = classify(Observation(transport=Transport.CANNOT_BUILD), policy)
    assert fact.category is Category.UNUSABLE


@pytest.mark.parametrize(("section", "field"), [
    ({"same_route_retry": [{"categories": ["unusable"], "max": 2, "delays_s": [1, 2]}]},
     "same_route_retry[0].categories[0]"),
    ({"health": {"cooldown_categories": ["overloaded", "unusable"]}},
     "health.cooldown_categories[1]"),
    ({"health": {"cooldown_categories": [], "disables": [{"categories": ["unusable"]}]}},
     "health.disables[0].categories[0]"),
], ids=["same_route_retry", "cooldown", "disables"])
def test_no_rule_about_the_route_itself_names_the_ledgers_own_unusable(
        section: dict[str, object], field: str) -> None:
    """A route that cannot be built is skipped: the turn never retries it and a settle never
    cools or disables it, so ``same_route_retry``, ``cooldown_categories`` or ``disables``
    naming ``unusable`` loaded and never acted."""
    data = {"name": "t", **MOVES, **section}
    [(got, problem, fix)] = _refused(data)
    assert got == field and "the ledger's own fact" in problem
    assert "never retried, cooled or disabled" in problem
    assert fix == "remove 'unusable' from this list"
    assert _read_back_as_frozen(data).name == "t"


def test_a_move_rule_may_name_unusable_as_it_moves_on_anyway() -> None:
    """Listing ``unusable`` in ``moves_on`` says what the turn does (the route is skipped), so
    it still loads."""
    policy = validate_policy({"name": "t", "moves_on": [{"categories": ["unusable"]}]})
    assert classify(Observation(transport=Transport.CANNOT_BUILD), policy).moves_on


# -- a Retry-After cap where no hint is read ---------------------------------------------------


RULE: dict[str, object] = {"categories": ["overloaded"], "max": 2, "delays_s": [2, 6]}


def test_a_retry_after_cap_is_refused_on_a_rule_that_reads_no_hints() -> None:
    """``retry_after_cap_s: 20`` without ``honor_retry_after`` retried a 1-hour hint anyway,
    though the docs and the rule's docstring said a longer hint means no retry."""
    data = {"name": "t", **MOVES,
            "same_route_retry": [{**RULE, "retry_after_cap_s": 20}]}
    [(field, problem, fix)] = _refused(data)
    assert field == "same_route_retry[0].retry_after_cap_s" and "never apply" in problem
    assert "honor_retry_after: true" in fix and "remove retry_after_cap_s" in fix
    assert _read_back_as_frozen(data).same_route_retry[0].retry_after_cap_s == 20
    # The cap's default (null), said or not, trips nothing; with the hints read it applies.
    for rule in (RULE, {**RULE, "retry_after_cap_s": None}):
        assert validate_policy({"name": "t", **MOVES, "same_route_retry": [rule]})
    honored = validate_policy({"name": "t", **MOVES, "same_route_retry": [
        {**RULE, "retry_after_cap_s": 20, "honor_retry_after": True}]})
    fact = classify(Observation(status=503, headers={"Retry-After": "3600"}), honored)
    decision = retry_decision(fact, honored, 0, random.Random(0))
    assert (decision.retry, decision.reason) == (False, "retry_after_exceeds_cap")


# -- a retry rule's transport kind an earlier rule's category takes ----------------------------


@pytest.mark.parametrize(("category", "transport"), [
    ("network", "connect_refused"), ("timeout", "read_timeout")])
def test_a_retry_rules_transport_kind_is_not_taken_by_an_earlier_rules_category(
        category: str, transport: str) -> None:
    """``[{categories: [network]}, {transports: [connect_refused]}]`` loaded, though a refused
    connection is ``network`` and the first rule took it: the second never applied."""
    by_category = {"categories": [category], "max": 1, "delays_s": [5]}
    by_transport = {"transports": [transport], "max": 2, "delays_s": [0.5, 0.5]}
    # A timed-out read may have executed: retried only where that may be sent again.
    data = {"name": "t", **MOVES, "failover": {"resubmit_unknown_execution": True},
            "same_route_retry": [by_category, by_transport]}
    [(field, problem, fix)] = _refused(data)
    assert field == "same_route_retry[1].transports"
    assert f"{transport!r} is classified {category!r}" in problem
    assert "same_route_retry[0]" in problem and "same_route_retry[1] never does" in problem
    assert "put the transport rule first" in fix
    assert _read_back_as_frozen(data).same_route_retry[1].max == 2
    # The transport rule first: the transport kind takes it, every other failure the category.
    first = validate_policy({**data, "same_route_retry": [by_transport, by_category]})
    fact = classify(Observation(transport=Transport(transport)), first)
    assert retry_decision(fact, first, 1, random.Random(0)).retry  # its second retry


def test_the_shadowing_is_read_from_the_policys_own_transport_table() -> None:
    """The category a transport kind gets is the classification's, not a fixed one."""
    table = {"classification": {"transports": {"connect_refused": "dns"}}}
    by_transport = {"transports": ["connect_refused"], "max": 1, "delays_s": [1]}
    network_first = {"name": "t", **MOVES, **table, "same_route_retry": [
        {"categories": ["network"], "max": 1, "delays_s": [1]}, by_transport]}
    assert validate_policy(network_first)
    dns_first = {**network_first, "same_route_retry": [
        {"categories": ["dns"], "max": 1, "delays_s": [1]}, by_transport]}
    [(field, problem, _)] = _refused(dns_first)
    assert field == "same_route_retry[1].transports" and "classified 'dns'" in problem


# -- what ships still loads --------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((REPO / "policies").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_preset_file_loads(path: Path) -> None:
    assert load_policy(path).moves_on and path.stem in PRESETS
    assert preset(path.stem).moves_on


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a page: (language, body)."""
    blocks: list[tuple[str, str]] = []
    fence: str | None = None
    body: list[str] = []
    for line in text.splitlines(keepends=True):
        if fence is None and line.startswith("```"):
            fence, body = line[3:].strip(), []
        elif fence is not None and line.rstrip() == "```":
            blocks.append((fence, "".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
    return blocks


def _doc_examples() -> list[tuple[str, str, str | None]]:
    """Each ``yaml`` policy example of the docs (a block that starts with ``name:``), with the
    refusal the docs print right after it, if any."""
    out: list[tuple[str, str, str | None]] = []
    for page in sorted([*(REPO / "docs").rglob("*.md"), REPO / "README.md"]):
        blocks = _code_blocks(page.read_text(encoding="utf-8"))
        for i, (language, body) in enumerate(blocks):
            if language != "yaml" or not body.startswith("name:"):
                continue
            after = blocks[i + 1][1] if i + 1 < len(blocks) else ""
            shown = after if after.startswith("failover-ledger: error:") else None
            out.append((f"{page.relative_to(REPO)} block {i}", body, shown))
    return out


def test_every_policy_example_in_the_docs_loads_or_is_refused_as_shown(tmp_path: Path) -> None:
    examples = _doc_examples()
    assert any(shown for _, _, shown in examples) and any(not s for _, _, s in examples)
    for where, text, shown in examples:
        path = tmp_path / "mine.yaml"
        path.write_text(text, encoding="utf-8")
        if shown is None:
            assert load_policy(path).name, where
            continue
        with pytest.raises(PolicyError) as info:
            load_policy(path)
        said = [line.strip() for line in shown.splitlines()[2:]]
        for field, problem, fix in info.value.errors:
            assert said == [f"field: {field}", f"problem: {problem}", f"fix: {fix}"], where
