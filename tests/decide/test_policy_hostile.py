"""The policy loader only ever raises PolicyError, naming the field path and the fix, quickly.

Every input to ``load_policy``, ``ledger policy check`` and ``admit_run(policy=...)``: hostile
YAML (complex keys, deep nesting, alias bombs, huge integers), hostile paths and argument types,
and mappings with typos, cycles and absurd values. A hypothesis test mutates the shipped presets
and random structures, as YAML files and as mappings.
"""

from __future__ import annotations

import copy
import string
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.api.facade import Ledger
from ledger.cli.main import main
from ledger.domain.values import Budget, Grant, Price, Route
from ledger.errors import PolicyError
from ledger.policy.load import MAX_FILE_BYTES, PRESETS, load_policy, preset, validate_policy
from ledger.policy.model import Policy

REPO = Path(__file__).resolve().parents[2]
PRESET_DATA = {n: yaml.safe_load((REPO / "policies" / f"{n}.yaml").read_text()) for n in PRESETS}
BOUND_S = 5.0  # per call, with the machine's cores busy


def outcome(fn: Any, *args: Any) -> Policy | PolicyError:
    """Policy or PolicyError, quickly; anything else fails the test."""
    started = time.perf_counter()
    try:
        result = fn(*args)
    except PolicyError as e:
        assert e.errors, f"a PolicyError without field paths: {e}"
        for field, problem, fix in e.errors:
            assert field and problem and fix and isinstance(field, str)
        assert len(str(e)) < 20_000
        result = e
    assert time.perf_counter() - started < BOUND_S, "not bounded in time"
    assert isinstance(result, Policy | PolicyError)
    return result


def _write(tmp_path: Path, text: str | bytes, name: str = "p.yaml") -> Path:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text, encoding="utf-8")
    return p


def _field(err: Policy | PolicyError) -> list[str]:
    assert isinstance(err, PolicyError)
    return [f for f, _, _ in err.errors]


# -- the observed failures, one by one ---------------------------------------------------------

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
)


@pytest.mark.parametrize(
    ("text", "where", "says"),
    [
        ("name: x\n? [a, b]\n: 1\n", "<yaml line 2", "plain name or number"),
        ("name: x\n{a: 1}: 2\n", "<yaml line 2", "plain name or number"),
        ("name: x\ndescription: " + "[" * 20_000 + "]" * 20_000 + "\n", "<yaml", "deeper"),
        ("name: x\nfailover:\n" + "".join(" " * (i + 1) + "a:\n" for i in range(60)),
         "<yaml", "deeper"),
        ("name: x\nprobe:\n  max_keys: " + "9" * 5000 + "\n", "<yaml line 3", "5000 digits"),
        (BOMB + "name: x\nfailover:\n  excluded_roles: *i\n", "<yaml", "aliases count"),
        ("name: x\nprobe:\n  interval_s: .inf\n", "probe.interval_s", "not a finite number"),
        ("name: x\nfailover:\n  enabled: !!python/object:os.system ls\n", "<yaml", "tag"),
        ("name: x\nname: y\n", "<yaml", "duplicate key"),
    ],
)
def test_hostile_yaml_is_a_policy_error(tmp_path: Path, text: str, where: str, says: str) -> None:
    err = outcome(load_policy, _write(tmp_path, text))
    assert isinstance(err, PolicyError)
    assert any(f.startswith(where) for f in _field(err)), err.errors
    assert says in str(err)


def test_a_file_too_large_is_refused_unread(tmp_path: Path) -> None:
    err = outcome(load_policy, _write(tmp_path, "name: x\n" + "#" * MAX_FILE_BYTES))
    assert _field(err) == ["<file>"] and "larger than" in str(err)


@pytest.mark.parametrize(
    "arg",
    [5, None, b"goclaw", 3.5, ["goclaw"], {"name": "x"}, object()],
    ids=["int", "none", "bytes", "float", "list", "dict", "object"],
)
def test_load_policy_refuses_non_paths(arg: Any) -> None:
    err = outcome(load_policy, arg)
    assert _field(err) == ["<argument>"] and "str or pathlib.Path" in err.errors[0][2]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "path",
    ["a/" * 5000 + "x.yaml", "x" * 5000, "x" * 5000 + ".yaml", "bad\x00name.yaml", "/",
     "/nonexistent-dir/p.yaml", "", ".", "nope"],
)
def test_hostile_paths_are_policy_errors(path: str) -> None:
    err = outcome(load_policy, path)
    assert isinstance(err, PolicyError) and len(str(err)) < 2_000


@pytest.mark.parametrize(("path", "says"), [
    ("/dev/zero", "not a regular file"),
    ("/dev/null", "not a regular file"),
    ("bad\x00name.yaml", "NUL byte"),
    ("bad\x00name", "NUL byte"),
    ("/nonexistent-dir/p.yaml", "does not exist"),
])
def test_a_path_that_is_no_regular_file_is_not_reported_as_missing(path: str, says: str) -> None:
    err = outcome(load_policy, path)
    assert _field(err) == ["<file>"] and says in str(err), err
    assert says == "does not exist" or "does not exist" not in str(err)


def test_a_mapping_with_a_typo_names_the_field_and_the_fix() -> None:
    data = copy.deepcopy(PRESET_DATA["failure-domain"])
    data["failover"]["enabeld"] = data["failover"].pop("enabled")
    err = outcome(validate_policy, data)
    assert isinstance(err, PolicyError)
    (row,) = [e for e in err.errors if e[0] == "failover.enabeld"]
    assert row[1] == "unknown key" and "rename it to 'enabled'" in row[2]


def test_admit_run_names_the_field_path_and_writes_nothing(tmp_path: Path) -> None:
    route = Route(id="r", provider="p", model="m", group="g", recipient="p", price=Price())
    data = copy.deepcopy(PRESET_DATA["goclaw"])
    data["health"]["cooldown"]["cap_sec"] = 5
    cyclic: dict[str, Any] = {"name": "x"}
    cyclic["failover"] = cyclic
    with Ledger.open(str(tmp_path / "l.db")) as led:
        for bad, field in [
            (data, "health.cooldown.cap_sec"),
            ({"name": "x", "probe": {"max_keys": 10**5000}}, "probe.max_keys"),
            ({"name": "x", "streaming": {"idle_timeout_s": float("nan")}},
             "streaming.idle_timeout_s"),
            (cyclic, "failover"),
            ([("name", "x")], "<root>"),
            (42, "<root>"),
            (b"goclaw", "<root>"),
            (Path(tmp_path / "missing.yaml"), "<file>"),
        ]:
            with pytest.raises(PolicyError) as info:
                led.admit_run("run-1", plan=[route], policy=bad,  # type: ignore[arg-type]
                              budget=Budget(max_calls=1, max_retries=0, max_cost=Decimal(1)),
                              grant=Grant(recipients={"p": ["user_input"]}))
            assert field in [f for f, _, _ in info.value.errors], (field, info.value.errors)
        with pytest.raises(Exception):  # noqa: B017 - nothing was admitted
            led.get_run("run-1")


def test_policy_check_reports_every_hostile_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = [
        _write(tmp_path, "name: x\n? [a]\n: 1\n", "complex.yaml"),
        _write(tmp_path, "name: x\ndescription: " + "[" * 5000 + "\n", "deep.yaml"),
        _write(tmp_path, BOMB + "name: x\n", "bomb.yaml"),
        _write(tmp_path, b"name: \xff\n", "binary.yaml"),
    ]
    status = main(["policy", "check", *map(str, files), "x" * 5000, "goclaw"])
    out = capsys.readouterr()
    assert status == 2
    assert out.err.count("problem:") == len(files) + 1
    assert "ok: goclaw" in out.out


# -- hypothesis: mutated presets and random structures, as mappings and as YAML ---------------

_LEAF = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=10**15, max_value=10**60)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
    | st.sampled_from(["auth", "rate_limit", "before_send", "route", "group", "oauth", "stop",
                       "failover", "", "-1", "1e309", "NaN"])
)
_KEY = st.text(alphabet=string.ascii_letters + "_.[]", min_size=1, max_size=12) | st.integers(
    -5, 600)
_VALUE = st.recursive(
    _LEAF,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_KEY, kids, max_size=4),
    max_leaves=25,
)


def _nested(depth: int) -> Any:
    value: Any = "x"
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


@st.composite
def _mutated(draw: st.DrawFn) -> Any:
    data = copy.deepcopy(PRESET_DATA[draw(st.sampled_from(PRESETS))])
    for _ in range(draw(st.integers(1, 4))):
        # Walk to a random container of the preset.
        node: Any = data
        for _ in range(draw(st.integers(0, 4))):
            children = list(node.items()) if isinstance(node, dict) else list(enumerate(node)) \
                if isinstance(node, list) else []
            containers = [(k, v) for k, v in children if isinstance(v, dict | list) and v]
            if not containers:
                break
            _, node = draw(st.sampled_from(containers))
        keys = list(node.keys()) if isinstance(node, dict) else list(range(len(node)))
        op = draw(st.sampled_from(["replace", "delete", "typo", "add", "deep", "wrap", "huge"]))
        if not keys:
            continue
        key = draw(st.sampled_from(keys))
        if op == "replace":
            node[key] = draw(_VALUE)
        elif op == "delete":
            del node[key]
        elif op == "typo" and isinstance(node, dict) and isinstance(key, str):
            node[key + draw(st.sampled_from(["s", "_", "x"]))] = node.pop(key)
        elif op == "add" and isinstance(node, dict):
            node[draw(_KEY)] = draw(_VALUE)
        elif op == "deep":
            node[key] = _nested(draw(st.integers(20, 200)))
        elif op == "wrap":
            node[key] = [node[key]]
        elif op == "huge":
            node[key] = draw(st.sampled_from([10**5000, "y" * 100_000, -(10**40), 1e308]))
    return data


_SETTINGS = settings(max_examples=150, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(st.one_of(_mutated(), _VALUE))
def test_any_mapping_is_a_policy_or_a_policy_error(data: Any) -> None:
    outcome(validate_policy, data)


@_SETTINGS
@given(_mutated())
def test_any_mutated_preset_file_is_a_policy_or_a_policy_error(tmp_path: Path, data: Any) -> None:
    try:
        text = yaml.safe_dump(data, allow_unicode=True)
    except (yaml.YAMLError, ValueError, RecursionError):
        return  # the dumper cannot write it; the mapping test covers it
    outcome(load_policy, _write(tmp_path, text))


_YAMLISH = st.text(alphabet=string.ascii_letters + string.digits + " \n\t:-[]{},&*!|>?#'\"%@`.~",
                   max_size=30)


@_SETTINGS
@given(
    st.sampled_from(PRESETS),
    st.lists(st.tuples(st.floats(0, 1), st.integers(0, 20), _YAMLISH), min_size=1, max_size=6),
)
def test_any_mangled_preset_text_is_a_policy_or_a_policy_error(
    tmp_path: Path, name: str, edits: list[tuple[float, int, str]]
) -> None:
    text = (REPO / "policies" / f"{name}.yaml").read_text()
    for at, cut, insert in edits:
        i = int(at * len(text))
        text = text[:i] + insert + text[i + cut:]
    result = outcome(load_policy, _write(tmp_path, text))
    if isinstance(result, Policy):
        assert result == validate_policy(result.model_dump(mode="json"))


def test_unmutated_presets_still_load() -> None:
    for name in PRESETS:
        assert outcome(validate_policy, copy.deepcopy(PRESET_DATA[name])) == preset(name)
