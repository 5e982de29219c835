"""Policy authoring: what a file, a JSON file or a mapping says is what the policy is.

The audit of policy authoring found values that changed silently on the way in (YAML 1.1's
octal, base 60 and ``no:``), a hash that followed PYTHONHASHSEED (a ``!!set``), keys dropped
without a word and settings that could never apply; each rule here refuses or reads them as an
author expects, naming the field and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ledger.domain.facts import Category
from ledger.domain.media import MAX_BINARY_BYTES
from ledger.errors import InvalidArgument, PolicyError
from ledger.policy.load import (
    MAX_NUMBER,
    load_policy,
    policy_hash,
    policy_json_schema,
    validate_policy,
)
from ledger.policy.model import FROZEN, DisableRule, FailoverPolicy, HealthPolicy, Policy

REPO = Path(__file__).resolve().parents[2]

# A policy that fails over says what moves on (refused otherwise): each policy below that loads
# carries this one rule, beside the point its test makes.
MOVES: dict[str, object] = {"moves_on": [{"categories": ["overloaded"]}]}
MOVES_YAML = "moves_on: [{categories: [overloaded]}]\n"


def _write(tmp_path: Path, text: str, name: str = "policy.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def _refused(source: Path | dict[str, object]) -> list[tuple[str, str, str]]:
    with pytest.raises(PolicyError) as info:
        if isinstance(source, Path):
            load_policy(source)
        else:
            validate_policy(source)
    return info.value.errors


# -- a policy is JSON data: nothing whose order or form a process picks -------------------------


@pytest.mark.parametrize(("value", "says", "fix"), [
    ("!!set {a, b}", "has no order", "write a YAML list [a, b]"),
    ("!!binary aGVsbG8=", "not JSON data", "as text"),
    ("!!omap [a: 1]", "not JSON data", "plain mapping"),
    ("!!pairs [a: 1]", "not JSON data", "plain mapping"),
    ("!!timestamp 2024-01-01", "not JSON data", "quoted string"),
])
def test_a_policy_file_holds_only_json_data(tmp_path: Path, value: str, says: str,
                                            fix: str) -> None:
    """A ``!!set`` became a list in PYTHONHASHSEED's order, so the same file had another hash
    in the next process and resuming its Run raised AdmissionConflict ['policy_hash']."""
    errors = _refused(_write(tmp_path, f"name: t\nfailover:\n  excluded_roles: {value}\n"))
    assert len(errors) == 1
    field, problem, got_fix = errors[0]
    assert field.startswith("<yaml line 3") and says in problem and fix in got_fix


def test_a_set_in_a_policy_mapping_or_model_is_refused_not_ordered_by_the_hash_seed() -> None:
    data: dict[str, object] = {"name": "t", "failover": {"excluded_roles": {"a", "b"}},
                               "profiles": {"auth_order": {"openai": frozenset({"x", "y"})}}}
    errors = _refused(data)
    assert [e[0] for e in errors] == ["failover.excluded_roles", "profiles.auth_order.openai"]
    assert all("no order" in problem and "list" in fix for _, problem, fix in errors)
    with pytest.raises(InvalidArgument) as info:
        Policy(name="t", failover=FailoverPolicy(excluded_roles={"a", "b"}))  # type: ignore[arg-type]
    assert "no order" in str(info.value)


# -- YAML merge keys: a mapping's own keys override what it merges -------------------------------

RETRIES = """name: t
moves_on: [{categories: [overloaded]}]
same_route_retry:
  - &r {categories: [overloaded], max: 2, delays_s: [1, 2]}
  - &s {categories: [server_error], max: 1, delays_s: [5], jitter: 0.5}
  - <<: [*r, *s]
    categories: [rate_limit]
"""


def test_a_merged_key_is_overridden_by_the_mappings_own_key(tmp_path: Path) -> None:
    """``<<: *r`` then ``categories:`` was refused as "duplicate key 'categories'": the merged
    keys were checked as if the mapping had written them twice."""
    rule = load_policy(_write(tmp_path, RETRIES)).same_route_retry[2]
    assert [c.value for c in rule.categories] == ["rate_limit"]  # its own key wins
    assert (rule.max, rule.delays_s) == (2, [1, 2])  # of several merged, the first wins
    assert rule.jitter == 0.5  # what only a later merge says still fills in


def test_a_key_a_mapping_itself_says_twice_is_still_a_duplicate(tmp_path: Path) -> None:
    text = RETRIES + "    categories: [timeout]\n"
    [(field, problem, _)] = _refused(_write(tmp_path, text))
    assert field.startswith("<yaml line 8") and problem == "duplicate key 'categories'"


# -- two keys that mean one entry: refused, not one of them dropped -----------------------------

COLLIDING = [
    ({"status": {"503": "overloaded", 503: "server_error"}},
     '  status:\n    "503": overloaded\n    503: server_error\n',
     '"status": {"503": "overloaded", "503.0": "server_error"}',
     "classification.status.503", "same status 503"),
    ({"codes": {"openai_code": {"Overloaded": "overloaded", "overloaded": "rate_limit"}}},
     "  codes:\n    openai_code: {Overloaded: overloaded, overloaded: rate_limit}\n",
     '"codes": {"openai_code": {"Overloaded": "overloaded", "overloaded": "rate_limit"}}',
     "classification.codes.openai_code.overloaded", "compared case-insensitively"),
]


@pytest.mark.parametrize(("mapping", "yaml_text", "json_text", "field", "says"), COLLIDING,
                         ids=["status", "codes"])
def test_two_keys_for_one_status_or_code_are_refused_not_one_dropped(
        tmp_path: Path, mapping: dict[str, object], yaml_text: str, json_text: str,
        field: str, says: str) -> None:
    """``{"503": overloaded, 503: server_error}`` kept one of the two silently, as did two
    spellings of a code the classifier compares case-insensitively."""
    sources: list[Path | dict[str, object]] = [
        {"name": "t", "classification": mapping},
        _write(tmp_path, "name: t\nclassification:\n" + yaml_text),
        _write(tmp_path, '{"name": "t", "classification": {' + json_text + "}}", "p.json"),
    ]
    for source in sources:
        [(got_field, problem, fix)] = _refused(source)
        assert got_field == field and says in problem and fix.startswith("keep one entry")


PROVIDER_KEYED = [
    ({"health": {"cooldown_categories": [], "disables": [
        {"categories": ["billing"], "base_s_by_provider": {"OpenAI": 60, "openai": 120}}]}},
     "health.disables[0].base_s_by_provider.openai"),
    ({"profiles": {"auth_order": {"Anthropic": ["a"], "anthropic": ["b"]}}},
     "profiles.auth_order.anthropic"),
]


@pytest.mark.parametrize(("data", "field"), PROVIDER_KEYED,
                         ids=["base_s_by_provider", "auth_order"])
def test_two_spellings_of_one_provider_key_are_refused_not_one_ignored(
        data: dict[str, object], field: str) -> None:
    """Provider keys are matched case-insensitively everywhere in a policy (as
    ``exempt_providers`` is), and the first key that matches is taken: a second spelling of
    one provider was accepted, and one of its two entries silently never applied."""
    [(got, problem, fix)] = _refused({"name": "t", **data})
    assert got == field and "same provider" in problem
    assert "compared case-insensitively" in problem and fix.startswith("keep one entry")
    with pytest.raises(InvalidArgument) as info:
        Policy(**{"name": "t", **data})  # type: ignore[arg-type]
    assert "same provider" in str(info.value)
    # Invariant 5: a Run admitted with both spellings before this rule reads back under it.
    frozen = Policy.model_validate({"name": "t", **data}, context=FROZEN)
    assert policy_hash(frozen)


BLANK_PROVIDER_KEYS = [
    ({"health": {"cooldown_categories": [], "disables": [
        {"categories": ["billing"], "base_s_by_provider": {" ": 60}}]}},
     "health.disables[0].base_s_by_provider. "),
    ({"profiles": {"auth_order": {"": ["a"]}}}, "profiles.auth_order"),  # the key is ""
]


@pytest.mark.parametrize(("data", "field"), BLANK_PROVIDER_KEYS,
                         ids=["base_s_by_provider", "auth_order"])
def test_a_blank_provider_key_is_refused_as_matching_nothing(
        data: dict[str, object], field: str) -> None:
    """A provider key is matched against routes' provider names: a blank one applies to no
    route, as a blank name in ``exempt_providers`` exempts none (refused there already)."""
    [(got, problem, fix)] = _refused({"name": "t", **data})
    assert got == field and "is blank" in problem and fix.startswith("remove the entry")
    frozen = Policy.model_validate({"name": "t", **data}, context=FROZEN)
    assert policy_hash(frozen)


# -- a list that names things names each once -----------------------------------------------------

_RETRY = {"max": 1, "delays_s": [1]}
LISTED_TWICE = [
    ({"failover": {"excluded_roles": ["eval", "review", "EVAL"]}},
     "failover.excluded_roles[2]", "one role: roles are compared case-insensitively"),
    ({"health": {"exempt_providers": ["openrouter", "OpenRouter"]}},
     "health.exempt_providers[1]", "one provider: providers are compared case-insensitively"),
    ({"health": {"cooldown_categories": ["overloaded", "timeout", "overloaded"]}},
     "health.cooldown_categories[2]", "category 'overloaded' is listed twice (at [0] and [2])"),
    ({"health": {"cooldown_categories": [], "disables": [{"categories": ["billing", "billing"]}]}},
     "health.disables[0].categories[1]", "category 'billing' is listed twice"),
    ({"profiles": {"type_order": ["oauth", "token", "oauth"]}},
     "profiles.type_order[2]", "profile type 'oauth' is listed twice"),
    ({"moves_on": [{"categories": ["rate_limit", "rate_limit"]}]},
     "moves_on[0].categories[1]", "category 'rate_limit' is listed twice"),
    ({"moves_on": [{"categories": ["network"], "phases": ["before_send", "before_send"]}]},
     "moves_on[0].phases[1]", "phase 'before_send' is listed twice"),
    ({"moves_on": [{"categories": ["network"], "transports": ["stream_cut", "stream_cut"]}]},
     "moves_on[0].transports[1]", "transport kind 'stream_cut' is listed twice"),
    ({"moves_on": [{"categories": ["server_error"], "statuses": [504, 504.0]}]},
     "moves_on[0].statuses[1]", "status 504 is listed twice"),
    ({"same_route_retry": [{"categories": ["overloaded", "overloaded"], **_RETRY}]},
     "same_route_retry[0].categories[1]", "category 'overloaded' is listed twice"),
    ({"same_route_retry": [{"transports": ["stream_cut", "stream_cut"], **_RETRY}]},
     "same_route_retry[0].transports[1]", "transport kind 'stream_cut' is listed twice"),
    ({"classification": {"context_overflow_text": ["too long", "Too Long"]}},
     "classification.context_overflow_text[1]", "one pattern: patterns are matched"),
    ({"classification": {"text": [{"category": "overloaded", "patterns": ["busy", "BUSY"]}]}},
     "classification.text[0].patterns[1]", "one pattern: patterns are matched"),
    ({"classification": {"status_text": [{"statuses": [429, 429.0], "patterns": ["x"],
                                          "category": "overloaded"}]}},
     "classification.status_text[0].statuses[1]", "status 429 is listed twice"),
    ({"classification": {"status_text": [{"statuses": [429], "patterns": ["Busy", "busy"],
                                          "category": "overloaded"}]}},
     "classification.status_text[0].patterns[1]", "one pattern: patterns are matched"),
]


@pytest.mark.parametrize(("data", "field", "says"), LISTED_TWICE,
                         ids=[case[1] for case in LISTED_TWICE])
def test_a_list_setting_names_each_entry_once(data: dict[str, object], field: str,
                                               says: str) -> None:
    """``type_order: [oauth, token, oauth]`` ranked OAuth after tokens (the last entry set its
    rank), and every other list took a second entry (or a second spelling of a role, provider
    or pattern compared case-insensitively) without a word, where another was likely meant."""
    [(got, problem, fix)] = _refused({"name": "t", **data})
    assert got == field and says in problem
    assert fix.startswith("list each ") and f"remove {field[field.rindex('['):]}" in fix
    with pytest.raises(InvalidArgument) as info:
        Policy(**{"name": "t", **data})  # type: ignore[arg-type]
    assert field in str(info.value) and "list each " in str(info.value)
    # Invariant 5: a Run admitted with such a list before this rule reads back under it.
    frozen = Policy.model_validate({"name": "t", **data}, context=FROZEN)
    assert policy_hash(frozen)


def _array_fields(node: object, path: str, out: dict[str, dict[str, Any]]) -> None:
    if isinstance(node, dict):
        if node.get("type") == "array":
            out[path] = node
        for key, value in node.items():
            _array_fields(value, f"{path}/{key}", out)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _array_fields(value, f"{path}/{i}", out)


def test_every_list_of_names_in_the_schema_says_its_entries_are_unique() -> None:
    """Every list-valued setting is covered by the one rule (so a new one is too): all but the
    lists of rules (each rule its own entry) and ``delays_s``, a sequence of waits."""
    schema = policy_json_schema()
    arrays: dict[str, dict[str, Any]] = {}
    _array_fields(schema, "", arrays)

    def of_rules(array: dict[str, Any]) -> bool:
        ref = array.get("items", {}).get("$ref", "")
        return bool(ref) and schema["$defs"][ref.rsplit("/", 1)[1]].get("type") == "object"

    of_values = {p: a for p, a in arrays.items()
                 if not of_rules(a) and not p.endswith("/delays_s")}
    assert len(of_values) == 16  # auth_order's lists too, refused by their own rule
    assert [p for p, a in of_values.items() if a.get("uniqueItems") is not True] == []


def test_a_category_two_disable_rules_list_is_refused_as_a_rule_never_read() -> None:
    """It was refused as "billing both cools and disables" though nothing cooled on it: the
    first rule that lists a category is the one that applies."""
    [(field, problem, fix)] = _refused({"name": "t", "health": {
        "cooldown_categories": ["overloaded"],
        "disables": [{"categories": ["billing"]}, {"categories": ["auth", "billing"]}]}})
    assert field == "health.disables[1].categories"
    assert problem == ("'billing' is listed by disables[0] already, and the first rule that "
                       "lists it applies: this one never does for it")
    assert fix == "remove 'billing' here, or merge the two rules"
    assert "cool" not in problem


def test_a_category_that_cools_and_disables_is_refused_saying_it_only_disables() -> None:
    """A disable rule is read first: such a failure disables the key and never cools it."""
    [(field, problem, fix)] = _refused({"name": "t", "health": {
        "cooldown_categories": ["billing"], "disables": [{"categories": ["billing"]}]}})
    assert field == "health.disables[0].categories"
    assert "disables the key and never cools it" in problem
    assert "from cooldown_categories to disable on it" in fix and "to cool on it" in fix
    with pytest.raises(InvalidArgument, match="never cools it"):
        HealthPolicy(cooldown_categories=[Category.BILLING],
                     disables=[DisableRule(categories=[Category.BILLING])])


# -- YAML 1.2, as the docs say: no value changes on the way in ----------------------------------


@pytest.mark.parametrize(("value", "seconds"), [
    ("010", 10.0), ("0o10", 8.0), ("0x10", 16.0), ("1_000", 1000.0), ("600.", 600.0),
    ("1e3", 1000.0), (".5e2", 50.0),
])
def test_numbers_are_read_as_yaml_1_2_and_json_read_them(tmp_path: Path, value: str,
                                                         seconds: float) -> None:
    """YAML 1.1 read ``010`` as 8 (octal) and refused 1.2's ``0o10`` as text."""
    text = f"name: t\n{MOVES_YAML}health:\n  cooldown:\n    base_s: {value}\n    cap_s: 1e6\n"
    assert load_policy(_write(tmp_path, text)).health.cooldown.base_s == seconds


def test_base_60_is_text_not_a_number(tmp_path: Path) -> None:
    """YAML 1.1 read ``1:30`` as 90 seconds."""
    [(field, problem, fix)] = _refused(
        _write(tmp_path, "name: t\nhealth:\n  cooldown:\n    base_s: 1:30\n"))
    assert field == "health.cooldown.base_s" and "'1:30'" in problem and "a number" in fix


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "y", "n"])
def test_only_true_and_false_are_booleans(tmp_path: Path, word: str) -> None:
    """``no:`` as a provider key was the boolean False, ``enabled: yes`` silently true."""
    policy = load_policy(_write(tmp_path, f"name: {word}\n{MOVES_YAML}profiles:\n  auth_order:\n"
                                          f"    {word}: [p1]\n"))
    assert policy.name == word and policy.profiles.auth_order == {word: ["p1"]}
    [(field, problem, fix)] = _refused(
        _write(tmp_path, f"name: t\nfailover:\n  enabled: {word}\n"))
    assert field == "failover.enabled" and "wrong type" in problem and "true or false" in fix
    for spelled in ("true", "True", "TRUE", "false", "False", "FALSE"):
        text = f"name: t\n{MOVES_YAML}failover:\n  enabled: {spelled}\n"
        assert load_policy(_write(tmp_path, text)).failover.enabled is (spelled.lower() == "true")


def test_a_date_is_text(tmp_path: Path) -> None:
    assert load_policy(_write(tmp_path, "name: 2024-01-01\n" + MOVES_YAML)).name == "2024-01-01"


# -- a JSON policy is read as JSON ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["p.json", "p.yaml"])
def test_a_json_policy_indented_with_tabs_loads(tmp_path: Path, name: str) -> None:
    """YAML reads most JSON but no tab indentation: such a file was "a YAML syntax error"."""
    text = ('\ufeff{\n\t"name": "t",\n\t"moves_on": [{"categories": ["overloaded"]}],\n'
            '\t"streaming": {\n\t\t"connect_timeout_s": 5\n\t}\n}\n')
    assert load_policy(_write(tmp_path, text, name)).streaming.connect_timeout_s == 5


def test_a_json_policy_is_refused_as_json_with_the_loaders_checks(tmp_path: Path) -> None:
    def errors(text: str) -> list[tuple[str, str, str]]:
        return _refused(_write(tmp_path, text, "p.json"))

    assert errors('{"name": "t", "name": "u"}') == [
        ("<json>", "duplicate key 'name'", "keep one of the two entries")]
    [(field, problem, fix)] = errors('{"name": "t",}')
    assert field == "<json line 1, column 14>" and "double quotes" in problem
    assert fix == "fix the JSON syntax at that position"
    assert errors('{"name": "t", "streaming": {"idle_timeout_s": NaN}}') == _refused(
        {"name": "t", "streaming": {"idle_timeout_s": float("nan")}})
    [(field, problem, _)] = errors('{"name": "t", "probe": {"max_keys": ' + "9" * 5000 + "}}")
    assert field == "<json>" and "5000 digits" in problem
    [(field, problem, _)] = errors("[1, 2]")
    assert field == "<root>" and problem == "the document is a JSON list"


def test_a_yaml_flow_mapping_is_still_yaml(tmp_path: Path) -> None:
    assert not load_policy(_write(tmp_path, "{name: t, failover: {enabled: false}}\n")
                           ).failover.enabled


# -- settings that could never apply are refused at load -----------------------------------------


@pytest.mark.parametrize("name", ["connect_timeout_s", "read_timeout_s", "idle_timeout_s"])
def test_no_time_limit_is_above_the_total_limit(tmp_path: Path, name: str) -> None:
    """As total_timeout_s below first_token_timeout_s is refused: the total always ends the
    call first, so a longer limit (and its transport kind) could never fire."""
    [(field, problem, fix)] = _refused(
        {"name": "t", "streaming": {name: 1000, "total_timeout_s": 600}})
    assert field == f"streaming.{name}" and "never applies" in problem
    assert f"lower {name}" in fix and "raise total_timeout_s" in fix
    equal = validate_policy({"name": "t", **MOVES,
                             "streaming": {name: 600, "total_timeout_s": 600}})
    assert getattr(equal.streaming, name) == 600


@pytest.mark.parametrize(("second", "field"), [
    ({"categories": ["rate_limit", "overloaded"], "max": 2, "delays_s": [1, 2]},
     "same_route_retry[1].categories"),
    ({"transports": ["stream_cut"], "max": 1, "delays_s": [1]},
     "same_route_retry[1].transports"),
], ids=["category", "transport"])
def test_a_retry_rule_never_lists_what_an_earlier_rule_already_takes(
        second: dict[str, object], field: str) -> None:
    """The first rule that lists a failure's category (or transport kind) applies."""
    first = {"categories": ["overloaded"], "transports": ["stream_cut"], "max": 1,
             "delays_s": [1]}
    [(got, problem, fix)] = _refused({"name": "t", "same_route_retry": [first, second]})
    assert got == field and "same_route_retry[0] already" in problem and "remove" in fix


@pytest.mark.parametrize(("section", "key"), [("failover", "excluded_roles"),
                                              ("health", "exempt_providers")])
@pytest.mark.parametrize("blank", ["", "  "])
def test_a_role_or_provider_is_named_by_more_than_blanks(section: str, key: str,
                                                         blank: str) -> None:
    [(field, problem, fix)] = _refused({"name": "t", section: {key: ["ok", blank]}})
    assert field == f"{section}.{key}[1]" and "blank" in problem and "remove it" in fix


@pytest.mark.parametrize(("classification", "field"), [
    ({"status": {499: "cancelled"}}, "classification.status.499"),
    ({"status_5xx": "budget_exceeded"}, "classification.status_5xx"),
    ({"codes": {"openai_code": {"user_abort": "cancelled"}}},
     "classification.codes.openai_code.user_abort"),
    ({"text": [{"category": "cancelled", "patterns": ["aborted"]}]},
     "classification.text[0].category"),
], ids=["status", "status_5xx", "codes", "text"])
def test_no_provider_response_is_classified_as_the_callers_own_fact(
        classification: dict[str, object], field: str) -> None:
    """``status: {499: cancelled}`` would stop the request as if the caller had cancelled it;
    the docs already forbid the caller's facts in every rule's categories."""
    [(got, problem, fix)] = _refused({"name": "t", "classification": classification})
    assert got == field and "caller's own fact" in problem and "route's failure" in fix


# -- the published schema refuses what loading refuses, field by field ---------------------------

SCHEMA_AND_LOADER_REFUSE = {
    "classification.status.401": {"classification": {"status": {"401": "unusable"}}},
    "classification.transports.dns_failure": {
        "classification": {"transports": {"dns_failure": "unusable"}}},
    "envelope.max_part_bytes": {"envelope": {"max_part_bytes": 0}},
    "envelope.max_envelope_bytes": {"envelope": {"max_envelope_bytes": 10**12}},
    "classification.status": {"classification": {"status": {"600": "overloaded"}}},
    "classification.status_text[0].statuses": {"classification": {"status_text": [
        {"statuses": [700], "patterns": ["x"], "category": "overloaded"}]}},
    "moves_on[0].statuses": {"moves_on": [{"categories": ["server_error"], "statuses": [700]}]},
    "health.cooldown_after": {"health": {"cooldown_after": 0}},
    "health.cooldown_window_s": {"health": {"cooldown_after": 2, "cooldown_window_s": 0.5}},
    "same_route_retry[0].jitter": {"same_route_retry": [
        {"categories": ["overloaded"], "max": 1, "delays_s": [1], "jitter": 1.0}]},
    "streaming.total_timeout_s": {"streaming": {"total_timeout_s": 1e308}},
    "moves_on[0].categories": {"moves_on": [{"categories": []}]},
    "name": {"name": "  "},
    "failover.excluded_roles[0]": {"failover": {"excluded_roles": [""]}},
    "profiles.type_order[1]": {"profiles": {"type_order": ["oauth", "oauth"]}},
    "health.cooldown_categories[1]": {"health": {"cooldown_categories": ["timeout", "timeout"]}},
}


def _schema_errors(data: dict[str, object]) -> list[str]:
    """What the published schema says of ``data``: with jsonschema where it is installed."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "docs" / "policy.schema.json").read_text(encoding="utf-8"))
    return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(data)]


@pytest.mark.parametrize("field", sorted(SCHEMA_AND_LOADER_REFUSE))
def test_the_schema_refuses_each_single_field_limit_the_loader_refuses(field: str) -> None:
    """The schema let an editor accept a zero byte limit, status 600, a jitter of 1 or a
    number of 1e308, which loading then refused."""
    data = {"name": "t", **SCHEMA_AND_LOADER_REFUSE[field]}
    assert field in [f for f, _, _ in _refused(dict(data))]
    assert _schema_errors(data)


def test_the_schema_states_the_loaders_bounds() -> None:
    """Said without a validator: the bounds an editor reads."""
    defs = policy_json_schema()["$defs"]
    envelope = defs["EnvelopePolicy"]["properties"]["max_part_bytes"]
    assert (envelope["minimum"], envelope["maximum"]) == (1, MAX_BINARY_BYTES)
    assert defs["StatusTextRule"]["properties"]["statuses"]["items"] == {
        "maximum": 599, "minimum": 100, "type": "integer"}
    status = defs["ClassificationPolicy"]["properties"]["status"]
    assert status["propertyNames"] == {"pattern": "^[1-5][0-9][0-9]$"}
    health = defs["HealthPolicy"]["properties"]
    assert health["cooldown_after"]["minimum"] == health["cooldown_window_s"]["minimum"] == 1
    jitter = defs["RetryRule"]["properties"]["jitter"]
    assert (jitter["minimum"], jitter["exclusiveMaximum"]) == (0, 1)
    assert defs["StreamingPolicy"]["properties"]["total_timeout_s"]["maximum"] == MAX_NUMBER


@pytest.mark.parametrize(("section", "values"), [
    ("probe", {"max_keys": 2.0}),
    ("envelope", {"max_part_bytes": 1024.0, "max_envelope_bytes": 2048.0}),
    ("health", {"cooldown_after": 3.0, "cooldown_window_s": 60}),
    ("classification", {"status_text": [{"statuses": [429.0], "patterns": ["busy"],
                                         "category": "overloaded"}]}),
])
def test_a_whole_number_written_as_2_0_is_the_integer_json_schema_says_it_is(
        section: str, values: dict[str, object]) -> None:
    """JSON Schema's ``integer`` accepts ``2.0``; the loader refused it as a wrong type. It is
    the integer, so the policy (and its hash) is the one written with ``2``."""
    data = {"name": "t", **MOVES, section: values}
    as_float = validate_policy(data)
    as_int = validate_policy(json.loads(json.dumps(data).replace(".0", "")))
    assert policy_hash(as_float) == policy_hash(as_int)
    assert not _schema_errors(data)
    half = {"name": "t", "probe": {"max_keys": 2.5}}
    assert _refused(half)[0][0] == "probe.max_keys" and _schema_errors(half)


# -- what an operator reads is what the file says ---------------------------------------------


@pytest.mark.parametrize(("data", "field", "char"), [
    ({"name": "t\x1b[31m"}, "name", "U+001B"),  # a terminal escape: colours what follows
    ({"name": "t\u202ekcehc"}, "name", "U+202E"),  # a bidi override: reads backwards
    ({"name": "t\u200b"}, "name", "U+200B"),  # zero-width: two names that look one
    ({"name": "t", "description": "ok\n\x1b]0;title\x07"}, "description", "U+001B"),
    ({"name": "t", "description": "ok\u2028then"}, "description", "U+2028"),  # a line break
], ids=["name-escape", "name-bidi", "name-zero-width", "description-escape",
        "description-line-separator"])
def test_a_policy_name_or_description_that_would_not_print_as_written_is_refused(
        data: dict[str, object], field: str, char: str) -> None:
    """``policy check``, ``policy show`` and the dashboard print the name and the description;
    an escape or a bidi override there rewrote what an operator read (``ok: t`` in red)."""
    [(got, problem, fix)] = _refused(data)
    assert got == field and char in problem and "not printed as itself" in problem
    assert fix.startswith(f"write the {field} in printable characters")
    # Invariant 5: a Run admitted before this rule reads its policy back as it was.
    frozen = Policy.model_validate(data, context=FROZEN)
    assert frozen.name == data["name"] and policy_hash(frozen)


def test_a_description_keeps_its_line_breaks_tabs_and_every_space() -> None:
    # Spaces of French, Japanese or Chinese text (U+00A0, U+202F, U+3000) print as spaces;
    # str.isprintable() refused them.
    text = ("Rules of our gateway.\n\tSee the runbook.\n"
            "Prix\u00a0: 5\u202f\u20ac \u65b9\u3000\u91dd\n")
    assert Policy.model_validate(
        {"name": "my\u00a0policy", "description": text, **MOVES}).description == text
