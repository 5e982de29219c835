"""Policy files: presets load, bad input is refused with the file, the field path and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ledger.cli.policy_cmd import schema_text
from ledger.errors import PolicyError
from ledger.policy.load import (
    PRESETS,
    apply_overrides,
    default_policy,
    load_policy,
    policy_hash,
    policy_json_schema,
    preset,
)

REPO = Path(__file__).resolve().parents[2]

# A policy that fails over says what moves on (refused otherwise): each file below that loads
# carries this one rule, beside the point its test makes.
MOVES = "moves_on: [{categories: [overloaded]}]\n"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "policy.yaml"
    p.write_text(text, encoding="utf-8")
    return p


def _error(path: Path) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    return info.value


def _only(err: PolicyError, field: str) -> tuple[str, str, str]:
    matching = [e for e in err.errors if e[0] == field]
    assert matching, f"no error for {field}: {err.errors}"
    return matching[0]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_turn_failover_on(name: str) -> None:
    policy = preset(name)
    assert policy.name == name
    assert policy.failover.enabled
    assert load_policy(REPO / "policies" / f"{name}.yaml") == policy


def test_default_is_failure_domain() -> None:
    assert default_policy().name == "failure-domain"
    assert default_policy().classification.text == []


def test_hash_is_stable_and_content_sensitive() -> None:
    a = policy_hash(preset("goclaw"))
    assert a == policy_hash(load_policy(REPO / "policies" / "goclaw.yaml"))
    assert a.startswith("sha256:") and len(a) == 71
    assert len({policy_hash(preset(n)) for n in PRESETS}) == len(PRESETS)
    changed = apply_overrides(preset("goclaw"), {"failover_enabled": False})
    assert policy_hash(changed) != a


def test_unknown_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "name: x\nfailover:\n  enabeld: true\n")
    err = _error(path)
    assert err.file == str(path)
    _, problem, fix = _only(err, "failover.enabeld")
    assert "unknown key" in problem
    assert "enabled" in fix and "remove" in fix


def test_wrong_type(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, "name: x\nprobe:\n  max_keys: lots\n"))
    _, problem, fix = _only(err, "probe.max_keys")
    assert "wrong type" in problem and "whole number" in fix


def test_negative_duration(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, "name: x\nfailover:\n  group_fact_max_age_s: -5\n"))
    _, problem, fix = _only(err, "failover.group_fact_max_age_s")
    assert "-5" in problem and ">= 0" in fix


def test_negative_delay_in_list(tmp_path: Path) -> None:
    text = "name: x\nsame_route_retry:\n  - categories: [overloaded]\n    max: 1\n"
    text += "    delays_s: [-1]\n"
    err = _error(_write(tmp_path, text))
    _only(err, "same_route_retry[0].delays_s[0]")


@pytest.mark.parametrize("jitter", ["1.0", "-0.1", "1.5"])
def test_jitter_outside_unit_interval(tmp_path: Path, jitter: str) -> None:
    text = "name: x\nsame_route_retry:\n  - categories: [overloaded]\n    max: 1\n"
    text += f"    delays_s: [2]\n    jitter: {jitter}\n"
    err = _error(_write(tmp_path, text))
    _, problem, fix = _only(err, "same_route_retry[0].jitter")
    assert "[0, 1)" in problem and "0.2" in fix
    assert str(err.file).endswith("policy.yaml")
    assert "same_route_retry[0].jitter" in str(err)


def test_retry_max_beyond_delays(tmp_path: Path) -> None:
    text = "name: x\nsame_route_retry:\n  - categories: [overloaded]\n    max: 3\n"
    text += "    delays_s: [2, 6]\n"
    _, problem, fix = _only(_error(_write(tmp_path, text)), "same_route_retry[0].max")
    assert "2 delay" in problem and "delays_s" in fix


def test_empty_required_lists(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, "name: x\nmoves_on:\n  - categories: []\n"))
    _, _, fix = _only(err, "moves_on[0].categories")
    assert "at least one" in fix
    err = _error(
        _write(
            tmp_path, "name: x\nclassification:\n  text:\n    - {category: auth, patterns: []}\n"
        )
    )
    _only(err, "classification.text[0].patterns")


def test_category_both_cools_and_disables(tmp_path: Path) -> None:
    text = "name: x\nhealth:\n  cooldown_categories: [billing]\n  disables:\n"
    text += "    - categories: [billing]\n"
    _, problem, _ = _only(_error(_write(tmp_path, text)), "health.disables[0].categories")
    assert "billing" in problem


def test_cap_below_base(tmp_path: Path) -> None:
    text = "name: x\nhealth:\n  cooldown: {base_s: 600, cap_s: 60}\n"
    _only(_error(_write(tmp_path, text)), "health.cooldown.cap_s")


@pytest.mark.parametrize(("rule", "field"), [
    ("{categories: [billing], base_s: 600, cap_s: 60}", "health.disables[0].cap_s"),
    ("{categories: [billing], base_s: 600, cap_s: 3600, base_s_by_provider: {openai: 7200}}",
     "health.disables[0].base_s_by_provider.openai"),
], ids=["cap_below_base", "provider_base_above_cap"])
def test_a_disable_rule_whose_cap_would_cut_its_base_is_refused(
        tmp_path: Path, rule: str, field: str) -> None:
    text = f"name: x\nhealth:\n  cooldown_categories: []\n  disables:\n    - {rule}\n"
    _, problem, fix = _only(_error(_write(tmp_path, text)), field)
    assert "cap_s" in problem and "cap_s" in fix


def test_unknown_preset_lists_valid_ones() -> None:
    with pytest.raises(PolicyError) as info:
        load_policy("gocalw")
    assert all(name in str(info.value) for name in PRESETS)
    with pytest.raises(PolicyError):
        preset("nope")


def test_an_empty_policy_name_is_reported_as_empty_not_as_a_directory() -> None:
    # Path("") is the current directory, which the loader then blamed.
    for empty in ("", "  "):
        with pytest.raises(PolicyError) as info:
            load_policy(empty)
        assert "empty" in str(info.value) and "directory" not in str(info.value)
        assert info.value.errors[0][1] == "the name is empty"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "absent.yaml")
    assert info.value.file == str(tmp_path / "absent.yaml")


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "name: x\nfailover: [unclosed\n")
    err = _error(path)
    assert err.file == str(path)
    assert "line" in str(err) and err.errors
    assert isinstance(err.__cause__, Exception)


def test_duplicate_key_refused(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, "name: x\nname: y\n"))
    assert "duplicate key" in str(err)


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "42\n"])
def test_not_a_mapping(tmp_path: Path, text: str) -> None:
    err = _error(_write(tmp_path, text))
    assert err.errors[0][0] == "<root>" and "mapping" in str(err)


def test_overrides_map_onto_the_model() -> None:
    p = apply_overrides(
        preset("fased"),
        {
            "failover_enabled": False,
            "group_fact_max_age_s": 5,
            "auth_order": {"anthropic": ["anthropic:b", "anthropic:a"]},
            "billing_backoff_hours": 1,
            "billing_backoff_hours_by_provider": {"openai": 2},
            "billing_max_hours": 3,
            "failure_window_s": 7,
        },
    )
    assert not p.failover.enabled
    assert p.failover.group_fact_max_age_s == 5
    assert p.profiles.auth_order == {"anthropic": ["anthropic:b", "anthropic:a"]}
    rule = p.health.disables[0]
    assert (rule.base_s, rule.cap_s, rule.base_s_by_provider) == (3600, 10800, {"openai": 7200})
    assert p.health.failure_window_s == 7


def test_billing_override_adds_a_disable_where_billing_only_cooled() -> None:
    p = apply_overrides(preset("goclaw"), {"billing_backoff_hours": 2})
    assert "billing" not in p.health.cooldown_categories
    assert p.health.disables[0].base_s == 7200


def test_bad_overrides_are_policy_errors() -> None:
    with pytest.raises(PolicyError) as info:
        apply_overrides(preset("goclaw"), {"failover": False})
    assert "failover_enabled" in str(info.value)
    with pytest.raises(PolicyError) as info:
        apply_overrides(preset("goclaw"), {"group_fact_max_age_s": -1})
    assert info.value.errors[0][0] == "failover.group_fact_max_age_s"


def test_published_schema_is_current() -> None:
    committed = (REPO / "docs" / "policy.schema.json").read_text(encoding="utf-8")
    assert committed == schema_text(), (
        "regenerate with: failover-ledger policy schema > docs/policy.schema.json"
    )
    assert json.loads(committed) == policy_json_schema()


# -- the fleet's bounds: one bound on waiting, and the cooling threshold ------------------------


@pytest.mark.parametrize("value", ["-1", ".inf", "-.inf", ".nan"])
def test_a_negative_or_infinite_wait_bound_is_refused(tmp_path: Path, value: str) -> None:
    err = _error(_write(tmp_path, f"name: x\nadmission:\n  max_capacity_wait_s: {value}\n"))
    _, problem, fix = _only(err, "admission.max_capacity_wait_s")
    assert problem and fix


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "true"])
def test_a_cooling_threshold_below_one_failure_is_refused(tmp_path: Path, value: str) -> None:
    text = f"name: x\nhealth:\n  cooldown_after: {value}\n  cooldown_window_s: 60\n"
    err = _error(_write(tmp_path, text))
    _, problem, fix = _only(err, "health.cooldown_after")
    assert "at least 1" in problem and "cooldown_window_s: 60" in fix


@pytest.mark.parametrize(("value", "said"), [("0.5", "at least 1"), ("0", "at least 1"),
                                             ("-1", "at least 1"), (".inf", "finite")])
def test_a_cooling_window_shorter_than_a_second_is_refused(tmp_path: Path, value: str,
                                                           said: str) -> None:
    text = f"name: x\nhealth:\n  cooldown_after: 3\n  cooldown_window_s: {value}\n"
    err = _error(_write(tmp_path, text))
    _, problem, fix = _only(err, "health.cooldown_window_s")
    assert said in problem and fix


def test_a_cooling_threshold_needs_its_window(tmp_path: Path) -> None:
    err = _error(_write(tmp_path, "name: x\nhealth:\n  cooldown_after: 3\n"))
    _, problem, fix = _only(err, "health.cooldown_window_s")
    assert "within how long" in problem and "cooldown_window_s" in fix


def test_the_default_preset_cools_after_three_failures_within_a_minute() -> None:
    hp = preset("failure-domain").health
    assert (hp.cooldown_after, hp.cooldown_window_s) == (3, 60)
    assert preset("failure-domain").failover.wait_for_reopening
    for name in ("goclaw", "fased"):  # the seeds cool on the first failure, and never wait
        assert preset(name).health.cooldown_after == 1
        assert not preset(name).failover.wait_for_reopening


@pytest.mark.parametrize(("ids", "said"), [("[]", "is empty"),
                                           ("[anthropic:a, anthropic:a]", "more than once")])
def test_an_auth_order_that_leaves_a_provider_no_credential_is_refused(
        tmp_path: Path, ids: str, said: str) -> None:
    text = f"name: x\nprofiles:\n  auth_order:\n    anthropic: {ids}\n"
    err = _error(_write(tmp_path, text))
    _, problem, fix = _only(err, "profiles.auth_order.anthropic")
    assert said in problem
    assert "profile ids" in fix or "once" in fix


@pytest.mark.parametrize(("text", "field"), [
    ("failover:\n  enabled: 'yes'\n", "failover.enabled"),
    ("failover:\n  enabled: 1\n", "failover.enabled"),
    ("admission:\n  max_capacity_wait_s: '30'\n", "admission.max_capacity_wait_s"),
    ("same_route_retry:\n  - categories: [overloaded]\n    max: '2'\n    delays_s: [1, 2]\n",
     "same_route_retry[0].max"),
    ("health:\n  cooldown_after: 3\n  cooldown_window_s: true\n", "health.cooldown_window_s"),
])
def test_a_quoted_or_mistyped_scalar_is_refused_not_guessed_at(tmp_path: Path, text: str,
                                                               field: str) -> None:
    """What the published schema refuses, loading refuses too: ``'yes'`` is no boolean and
    ``'30'`` no number (a whole number still passes where seconds are asked for)."""
    err = _error(_write(tmp_path, "name: x\n" + text))
    _only(err, field)


# -- the caller's facts are no rule's to act on --------------------------------------------------


@pytest.mark.parametrize("category", ["cancelled", "budget_exceeded"])
@pytest.mark.parametrize(("text", "field"), [
    ("moves_on:\n  - categories: [overloaded, {c}]\n", "moves_on[0].categories[1]"),
    ("same_route_retry:\n  - categories: [{c}]\n    max: 1\n    delays_s: [1]\n",
     "same_route_retry[0].categories[0]"),
    ("health:\n  cooldown_categories: [{c}]\n", "health.cooldown_categories[0]"),
    ("health:\n  cooldown_categories: []\n  disables:\n    - categories: [{c}]\n",
     "health.disables[0].categories[0]"),
], ids=["moves_on", "same_route_retry", "cooldown_categories", "disables"])
def test_a_cancellation_or_the_token_budget_never_retries_moves_on_or_cools(
        tmp_path: Path, category: str, text: str, field: str) -> None:
    """Only the caller reports these, and the request stops on them (docs/presets/goclaw.md:
    over its token budget it "never moves on"); a rule naming one is refused, not obeyed."""
    err = _error(_write(tmp_path, "name: x\n" + text.format(c=category)))
    _, problem, fix = _only(err, field)
    assert "caller's own fact" in problem and f"remove {category!r}" in fix
    items = policy_json_schema()["$defs"]["MoveRule"]["properties"]["categories"]["items"]
    assert category in items["not"]["enum"]


def test_a_status_text_rule_names_only_http_statuses(tmp_path: Path) -> None:
    """As the ``status`` map does: a status outside 100..599 can never be observed."""
    text = ("name: x\nclassification:\n  status_text:\n"
            "    - {statuses: [429, 700], patterns: [busy], category: overloaded}\n")
    err = _error(_write(tmp_path, text))
    _, problem, fix = _only(err, "classification.status_text[0].statuses")
    assert "700 is not an HTTP status" in problem and "100 and 599" in fix


@pytest.mark.parametrize("value", ["1.0e+20", "-1.0e+20", "100000000000000000000"])
def test_an_over_large_duration_is_told_its_real_range(tmp_path: Path, value: str) -> None:
    err = _error(_write(tmp_path, f"name: x\nstreaming:\n  total_timeout_s: {value}\n"))
    _, problem, fix = _only(err, "streaming.total_timeout_s")
    assert "too large" in problem and fix == "use a value from 0 to 1e+15"


def test_a_total_limit_below_the_first_token_limit_is_refused(tmp_path: Path) -> None:
    """The total limit would end every silent stream first: the first-token one never fires."""
    text = "name: x\nstreaming:\n  first_token_timeout_s: 60\n  total_timeout_s: 5\n"
    _, problem, fix = _only(_error(_write(tmp_path, text)), "streaming.total_timeout_s")
    assert "never applies" in problem and "first_token_timeout_s" in fix
    equal = (f"name: x\n{MOVES}streaming:\n  first_token_timeout_s: 5\n  total_timeout_s: 5\n"
             "  connect_timeout_s: 5\n  read_timeout_s: 5\n  idle_timeout_s: 5\n")
    assert load_policy(_write(tmp_path, equal)).streaming.total_timeout_s == 5


def test_an_enabled_probe_is_spaced_by_a_positive_interval(tmp_path: Path) -> None:
    """At interval 0 every request to a cooling key is its probe: the cooldown holds nothing."""
    text = "name: x\nprobe:\n  enabled: true\n  interval_s: 0\n"
    _, problem, fix = _only(_error(_write(tmp_path, text)), "probe.interval_s")
    assert "defeats its cooldown" in problem
    assert "positive interval" in fix and "probe.enabled: false" in fix
    off = f"name: x\n{MOVES}probe:\n  enabled: false\n  interval_s: 0\n"  # unused, so left alone
    assert load_policy(_write(tmp_path, off)).probe.interval_s == 0


def test_group_evidence_is_not_stale_the_moment_it_is_read(tmp_path: Path) -> None:
    """A zero age limit would make every group fact stale: group_aware would do nothing."""
    text = "name: x\nfailover:\n  group_fact_max_age_s: 0\n"
    _, problem, fix = _only(_error(_write(tmp_path, text)), "failover.group_fact_max_age_s")
    assert "stale" in problem and "group_aware: false" in fix and "positive age" in fix
    off = f"name: x\n{MOVES}failover:\n  group_aware: false\n  group_fact_max_age_s: 0\n"
    assert load_policy(_write(tmp_path, off)).failover.group_fact_max_age_s == 0


@pytest.mark.parametrize("name", ['"   "', '"\\t"'], ids=["spaces", "tab"])
def test_a_policy_is_named_by_more_than_blanks(tmp_path: Path, name: str) -> None:
    _, problem, fix = _only(_error(_write(tmp_path, f"name: {name}\n")), "name")
    assert "blank" in problem and fix


@pytest.mark.parametrize(("value", "seconds"), [
    ("1e3", 1000.0), ("1.5e3", 1500.0), ("2E+2", 200.0), ("+1e2", 100.0), ("6_0e0", 60.0),
    (".5e2", 50.0),
])
def test_a_number_in_exponent_notation_is_read_as_a_number(tmp_path: Path, value: str,
                                                            seconds: float) -> None:
    """PyYAML's YAML 1.1 reads ``1e3`` (no dot, or an unsigned exponent) as text, which was
    refused as "wrong type: write a number" though it is one in YAML 1.2, JSON and the
    published schema."""
    text = f"name: x\n{MOVES}health:\n  cooldown:\n    base_s: {value}\n    cap_s: 1.0e+6\n"
    assert load_policy(_write(tmp_path, text)).health.cooldown.base_s == seconds


def test_text_that_only_starts_like_a_number_stays_text(tmp_path: Path) -> None:
    """The resolver matches whole numbers only: a description that merely starts with digits
    and an ``e`` stays text."""
    text = f"name: x\n{MOVES}description: 1e3 requests a day\n"
    assert load_policy(_write(tmp_path, text)).description == "1e3 requests a day"
