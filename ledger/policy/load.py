"""Loading policies: YAML files, the shipped presets, overrides, hashes and the JSON schema.

Every failure becomes a :class:`ledger.errors.PolicyError` naming the file, the field path
(``same_route_retry[0].jitter``) and the fix; raw pydantic or YAML errors never escape.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

import ledger
from ledger.core.facts import Category
from ledger.errors import PolicyError
from ledger.model import content_hash
from ledger.policy import DEFAULT_PRESET, PRESETS
from ledger.policy.model import DisableRule, Policy, PolicyValueError

# The override keys the conformance vectors use, each mapped onto this policy model.
OVERRIDE_KEYS: tuple[str, ...] = (
    "failover_enabled",
    "group_fact_max_age_s",
    "auth_order",
    "billing_backoff_hours",
    "billing_backoff_hours_by_provider",
    "billing_max_hours",
    "failure_window_s",
)

_HOUR = 3600.0


def preset_dirs() -> list[Path]:
    """Where preset files are looked for: inside the installed wheel, then the source tree."""
    pkg = Path(ledger.__file__).resolve().parent
    return [pkg / "_policies", pkg.parent / "policies"]


def _preset_path(name: str) -> Path:
    for d in preset_dirs():
        p = d / f"{name}.yaml"
        if p.is_file():
            return p
    raise PolicyError(
        f"preset {name!r} is listed but its file was not found in "
        + ", ".join(str(d) for d in preset_dirs()),
        file=None,
        errors=[("<preset>", f"no {name}.yaml", "reinstall ledger, or load the file by path")],
    )


@functools.cache
def preset(name: str) -> Policy:
    """One of the shipped presets (``goclaw``, ``fased``, ``failure-domain``)."""
    if name not in PRESETS:
        valid = ", ".join(PRESETS)
        raise PolicyError(
            f"unknown policy preset {name!r}; valid presets: {valid}",
            file=None,
            errors=[("<preset>", f"unknown preset {name!r}", f"use one of: {valid}")],
        )
    return _load_file(_preset_path(name))


def default_policy() -> Policy:
    """The default policy: the ``failure-domain`` preset."""
    return preset(DEFAULT_PRESET)


def load_policy(path_or_preset: str | Path) -> Policy:
    """A policy from a YAML file path, or from a preset name."""
    if isinstance(path_or_preset, str) and path_or_preset in PRESETS:
        return preset(path_or_preset)
    path = Path(path_or_preset)
    if path.is_file():
        return _load_file(path)
    looks_like_name = isinstance(path_or_preset, str) and not (
        path.suffix or "/" in path_or_preset or "\\" in path_or_preset
    )
    if looks_like_name:
        return preset(str(path_or_preset))  # raises the unknown-preset error listing valid names
    raise PolicyError(
        f"{path}: no such policy file",
        file=str(path),
        errors=[("<file>", "the file does not exist", "check the path, or name a preset")],
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, which PyYAML would silently let the last win."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    out: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        out[key] = loader.construct_object(value_node, deep=True)
    return out


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _load_file(path: Path) -> Policy:
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(
            f"{file}: cannot read the policy file: {e}",
            file=file,
            errors=[("<file>", str(e), "make the file readable UTF-8 text")],
        ) from e
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # safe: no arbitrary objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"
        problem = getattr(e, "problem", None) or str(e)
        raise PolicyError(
            f"{file}: YAML syntax error at {where}: {problem}",
            file=file,
            errors=[(f"<yaml {where}>", str(problem), "fix the YAML syntax at that position")],
        ) from e
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise PolicyError(
            f"{file}: a policy file must be a mapping of sections, but it is {kind}",
            file=file,
            errors=[
                (
                    "<root>",
                    f"the document is {kind}",
                    "start from a preset: name:, failover:, classification:, moves_on:, ...",
                )
            ],
        )
    return validate_policy(data, file=file)


def validate_policy(data: Mapping[str, Any], *, file: str | None = None) -> Policy:
    """Validate a mapping into a :class:`Policy`, converting every problem to PolicyError."""
    try:
        return Policy.model_validate(dict(data))
    except ValidationError as e:
        raise _policy_error(e, file) from e


def _policy_error(e: ValidationError, file: str | None) -> PolicyError:
    errors = [_describe(err) for err in e.errors(include_url=False)]
    where = file or "<policy>"
    lines = [f"{where}: the policy is invalid ({len(errors)} problem(s)):"]
    lines += [f"  {path}: {problem}; fix: {fix}" for path, problem, fix in errors]
    return PolicyError("\n".join(lines), file=file, errors=errors)


def _describe(err: Any) -> tuple[str, str, str]:
    loc: tuple[Any, ...] = tuple(err.get("loc", ()))
    kind = str(err.get("type", ""))
    ctx: dict[str, Any] = err.get("ctx") or {}
    cause = ctx.get("error")
    if isinstance(cause, PolicyValueError):
        if cause.field:
            loc = (*loc, cause.field)
        return _path(loc), cause.problem, cause.fix
    msg = str(err.get("msg", "invalid value"))
    got = err.get("input")
    if kind == "extra_forbidden":
        valid = _valid_keys(loc[:-1])
        fix = "remove it" + (f"; valid keys here: {', '.join(valid)}" if valid else "")
        return _path(loc), "unknown key", fix
    if kind == "missing":
        return _path(loc), "required field is missing", "add it"
    if kind in ("greater_than_equal", "greater_than"):
        bound = ctx.get("ge", ctx.get("gt"))
        op = ">=" if "ge" in ctx else ">"
        return _path(loc), f"{msg} (got {got!r})", f"use a value {op} {_num(bound)}"
    if kind in ("less_than_equal", "less_than"):
        bound = ctx.get("le", ctx.get("lt"))
        op = "<=" if "le" in ctx else "<"
        return _path(loc), f"{msg} (got {got!r})", f"use a value {op} {_num(bound)}"
    if kind in ("enum", "literal_error"):
        return _path(loc), f"{got!r} is not allowed", msg[0].lower() + msg[1:]
    if kind == "finite_number":
        return _path(loc), f"{got!r} is not a finite number", "use a finite number"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return _path(loc), f"wrong type: {msg} (got {got!r})", _type_fix(kind)
    return _path(loc), f"{msg} (got {got!r})", "correct the value"


def _num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, int | float) else str(v)


def _type_fix(kind: str) -> str:
    wanted = {
        "float": "a number",
        "int": "a whole number",
        "bool": "true or false",
        "string": "a string",
        "list": "a list",
        "dict": "a mapping",
        "model": "a mapping",
    }
    for prefix, what in wanted.items():
        if kind.startswith(prefix):
            return f"write {what} here"
    return "use the type the schema gives (`failover-ledger policy schema`)"


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def _valid_keys(loc: tuple[Any, ...]) -> list[str]:
    """The field names accepted at ``loc``, by walking the model along the path."""
    model: type[BaseModel] = Policy
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        sub = _model_in(field.annotation)
        if sub is None:
            return []
        model = sub
    return sorted(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def apply_overrides(policy: Policy, overrides: Mapping[str, Any]) -> Policy:
    """``policy`` with the conformance override keys (see :data:`OVERRIDE_KEYS`) applied."""
    unknown = sorted(set(overrides) - set(OVERRIDE_KEYS))
    if unknown:
        valid = ", ".join(OVERRIDE_KEYS)
        raise PolicyError(
            f"unknown policy override key(s): {', '.join(unknown)}; valid: {valid}",
            errors=[(k, "unknown override key", f"use one of: {valid}") for k in unknown],
        )
    data = policy.model_dump(mode="python")
    if "failover_enabled" in overrides:
        data["failover"]["enabled"] = overrides["failover_enabled"]
    if "group_fact_max_age_s" in overrides:
        data["failover"]["group_fact_max_age_s"] = overrides["group_fact_max_age_s"]
    if "auth_order" in overrides:
        data["profiles"]["auth_order"] = overrides["auth_order"]
    if "failure_window_s" in overrides:
        data["health"]["failure_window_s"] = overrides["failure_window_s"]
    billing = {
        k: overrides[k]
        for k in ("billing_backoff_hours", "billing_backoff_hours_by_provider", "billing_max_hours")
        if k in overrides
    }
    if billing:
        _apply_billing(data["health"], billing)
    return validate_policy(data, file=None)


def _apply_billing(health: dict[str, Any], billing: Mapping[str, Any]) -> None:
    rules: list[dict[str, Any]] = health["disables"]
    targets = [r for r in rules if "billing" in [str(c) for c in r["categories"]]]
    if not targets:
        # Naming a billing backoff asks for billing disables, even where the preset only cools.
        health["cooldown_categories"] = [
            c for c in health["cooldown_categories"] if str(c) != "billing"
        ]
        rules.append(DisableRule(categories=[Category.BILLING]).model_dump(mode="python"))
        targets = [rules[-1]]
    try:
        for rule in targets:
            if "billing_backoff_hours" in billing:
                rule["base_s"] = float(billing["billing_backoff_hours"]) * _HOUR
            if "billing_max_hours" in billing:
                rule["cap_s"] = float(billing["billing_max_hours"]) * _HOUR
            if "billing_backoff_hours_by_provider" in billing:
                by = billing["billing_backoff_hours_by_provider"]
                rule["base_s_by_provider"] = {str(p): float(h) * _HOUR for p, h in by.items()}
    except (TypeError, ValueError, AttributeError) as e:
        raise PolicyError(
            f"billing overrides must be numbers of hours: {e}",
            errors=[("billing_backoff_hours", str(e), "give hours as numbers")],
        ) from e


def policy_hash(policy: Policy) -> str:
    """A stable content hash (``sha256:<hex>``) of the policy's canonical JSON."""
    return content_hash(policy.model_dump(mode="json"))


def policy_json_schema() -> dict[str, Any]:
    """The published JSON schema of a policy file."""
    schema = Policy.model_json_schema(mode="validation")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


__all__ = [
    "DEFAULT_PRESET",
    "OVERRIDE_KEYS",
    "PRESETS",
    "apply_overrides",
    "default_policy",
    "load_policy",
    "policy_hash",
    "policy_json_schema",
    "preset",
    "preset_dirs",
    "validate_policy",
]
