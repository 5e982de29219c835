"""Loading policies: YAML files, the shipped presets, overrides, hashes and the JSON schema.

Every failure becomes a :class:`ledger.errors.PolicyError` naming the file, the field path
(``same_route_retry[0].jitter``) and the fix; raw pydantic or YAML errors, and anything else a
hostile input could provoke (``TypeError``, ``RecursionError``, ``OSError``, ...), never escape.

Time and memory are bounded before any validation runs, for files and for mappings alike: a file
is read up to :data:`MAX_FILE_BYTES`; a ``.json`` file, or text that starts with ``{``, is read
as JSON (with duplicate keys refused); YAML is read by YAML 1.2's core schema (``010`` is ten,
``no`` is text, ``1:30`` is text) and composed by a safe loader with a node budget that
counts every alias as the size of what it refers to (so an alias bomb is refused after a few
thousand nodes, not after expanding it), a nesting limit, plain-value mapping keys only, and
integers of at most :data:`MAX_INT_DIGITS` digits; then the data (a file's, or a mapping a host
passed in) is walked once against the same budget, refusing cycles, non-finite or huge numbers
and over-long strings with their field path. A policy is JSON data: YAML's ``!!set``, ``!!omap``,
``!!pairs``, ``!!binary`` and ``!!timestamp``, and a Python set in a mapping, are refused (a set's
order, and so the policy's hash, would follow PYTHONHASHSEED).
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import re
import reprlib
from collections.abc import Mapping, Set
from pathlib import Path
from typing import Annotated, Any, cast

import yaml
from pydantic import BaseModel, ValidationError

from ledger.domain.facts import Category
from ledger.domain.validation import Rule, checked, that
from ledger.domain.values import content_hash
from ledger.errors import PolicyError
from ledger.policy import DEFAULT_PRESET, PRESETS
from ledger.policy.model import FROZEN, DisableRule, Policy, PolicyArg, PolicyValueError

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

#: A policy file larger than this is refused unread (the presets are a few KiB).
MAX_FILE_BYTES = 256 * 1024
#: Deepest nesting of sections, lists and mappings a policy may have.
MAX_DEPTH = 32
#: Most values (scalars, lists, mappings; an alias counts as everything it refers to).
MAX_NODES = 20_000
#: Longest string value or key.
MAX_STRING_CHARS = 16_384
#: Largest number a policy may hold (durations, counts, factors are all far below it).
MAX_NUMBER = 10**15
#: Longest integer literal read from YAML.
MAX_INT_DIGITS = 30
_MAX_REPORTED = 50
# No policy number is negative (durations, counts, factors, statuses): the fix names the range
# a value can have, not the symmetric bound the check uses.
_IN_RANGE = f"use a value from 0 to {MAX_NUMBER:g}"
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6
_SHORT.maxlevel = 3


def preset_dirs() -> list[Path]:
    """Where preset files are looked for: inside the installed wheel, then the source tree."""
    pkg = Path(__file__).resolve().parents[1]  # the ledger package
    return [pkg / "_policies", pkg.parent / "policies"]


def preset_path(name: str) -> Path:
    """The file of preset ``name`` (one of :data:`~ledger.policy.PRESETS`).

    Raises:
        PolicyError: the preset's file is missing from the installation.
    """
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


PresetName = Annotated[str, that(lambda v: isinstance(v, str), "is not a preset name",
                                 f"pass one of {', '.join(PRESETS)}")]
"""A preset's name; a string that names none is the PolicyError listing them."""
# Any value reaches load_policy's body, which refuses a wrong one with the PolicyError its
# documentation promises; checked() still makes a call that fits no signature ArgumentMismatch.
PolicySource = Annotated[str | os.PathLike[str], Rule(lambda value: value)]


@checked
def preset(name: PresetName) -> Policy:
    """One of the shipped presets (``goclaw``, ``fased``, ``failure-domain``).

    The file is parsed once; each call returns a policy of its own, so changing the lists
    or mappings inside one changes nothing another caller, or a later admission, reads.

    Raises:
        PolicyError: ``name`` is not a preset (the message lists them).
        InvalidArgument: ``name`` is not a string.
    """
    return own_copy(shared_preset(name))


def own_copy(policy: Policy) -> Policy:
    """``policy`` again, sharing no list or mapping with it.

    A frozen model still holds mutable containers; a caller handed the one every Run reads could
    change what later Runs freeze. Re-validating its dump costs a seventh of a deep copy.
    """
    # A copy is of a policy already accepted (a frozen one may predate a rule of the loader).
    return cast(Policy, Policy.__pydantic_validator__.validate_python(policy.model_dump(),
                                                                        context=FROZEN))


@functools.cache
def shared_preset(name: str) -> Policy:
    """The preset ``name``, parsed once and shared: for readers inside the ledger only.

    Admission reads it to freeze and hash it; it is never handed to a caller (:func:`preset`
    gives each its own copy).
    """
    if name not in PRESETS:
        valid = ", ".join(PRESETS)
        raise PolicyError(
            f"unknown policy preset {name!r}; valid presets: {valid}",
            file=None,
            errors=[("<preset>", f"unknown preset {name!r}", f"use one of: {valid}")],
        )
    return _load_file(preset_path(name))


def default_policy() -> Policy:
    """The default policy: the ``failure-domain`` preset."""
    return preset(DEFAULT_PRESET)


def _shown(value: object, limit: int = 200) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


@checked
def load_policy(path_or_preset: PolicySource) -> Policy:
    """A policy from a YAML or JSON file path, or from a preset name.

    The file is bounded before it is parsed (size, depth, nodes, duplicate keys) and then
    validated; every problem is reported at once.

    Args:
        path_or_preset: A policy file (``str`` or ``pathlib.Path``), or one of the preset
            names (``goclaw``, ``fased``, ``failure-domain``).

    Returns:
        The validated :class:`~ledger.Policy`.

    Raises:
        PolicyError: for any value: an unreadable or malformed file, or a policy that does
            not validate; ``errors`` lists each ``(field path, problem, fix)``.
        ArgumentMismatch: a call that fits no signature (``path=...``: a misspelt keyword).

    Example:
        >>> load_policy("failure-domain").failover.enabled  # doctest: +SKIP
        True
    """
    if not isinstance(path_or_preset, str | os.PathLike):
        kind = type(path_or_preset).__name__
        raise PolicyError(
            f"load_policy takes a file path or a preset name, not a value of type {kind}",
            file=None,
            errors=[("<argument>", f"got a value of type {kind}",
                     f"pass a str or pathlib.Path: a policy file, or one of {', '.join(PRESETS)}"
                     " (a mapping goes to validate_policy)")],
        )
    if isinstance(path_or_preset, str) and path_or_preset in PRESETS:
        return preset(path_or_preset)  # a copy of its own
    if isinstance(path_or_preset, str) and not path_or_preset.strip():
        # Path("") is the current directory: "it is a directory" would blame the wrong thing.
        raise PolicyError(
            f"load_policy was given an empty name {path_or_preset!r}",
            file=None,
            errors=[("<argument>", "the name is empty",
                     f"name a preset ({', '.join(PRESETS)}) or a policy file path")],
        )
    try:
        path = Path(path_or_preset)
        if "\x00" in str(path):
            # pathlib answers "no such file" for it, which would send the user looking for one.
            raise ValueError("the path contains a NUL byte")
        is_file = path.is_file()
        is_dir = not is_file and path.is_dir()
        exists = is_file or is_dir or path.exists()
        shown = _shown(path)
    except (TypeError, ValueError, OSError) as e:  # NUL bytes, a path too long, bytes paths
        shown = _shown(repr(path_or_preset))
        raise PolicyError(
            f"{shown}: not a usable policy file path ({_shown(e)})",
            file=shown,
            errors=[("<file>", f"the path cannot be used: {_shown(e)}",
                     "pass the path of a readable policy file, or name a preset")],
        ) from e
    if is_file:
        return _load_file(path)
    text = str(path_or_preset)
    looks_like_name = isinstance(path_or_preset, str) and not (
        path.suffix or "/" in text or "\\" in text
    )
    if looks_like_name and not is_dir:
        return preset(text)  # raises the unknown-preset error listing valid names
    if not exists:
        problem, said = "the file does not exist", "no such policy file"
    else:
        said = "not a policy file"
        problem = ("it is a directory" if is_dir
                   else "it is a device, a pipe or a socket, not a regular file")
    raise PolicyError(
        f"{shown}: {said} ({problem})",
        file=shown,
        errors=[("<file>", problem, "check the path, or name a preset")],
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, with bounds.

    Duplicate keys (which PyYAML would let the last win) and non-scalar keys are refused,
    nesting is limited to MAX_DEPTH and the document to MAX_NODES nodes, where an alias counts as
    the whole node it refers to.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._sizes: dict[str, int] = {}

    def _charge(self, n: int, mark: Any) -> None:
        self._nodes += n
        if self._nodes > MAX_NODES:
            raise yaml.composer.ComposerError(
                None, None,
                f"the document has more than {MAX_NODES} values (aliases count as what they "
                "refer to)", mark,
            )

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent):
            self._charge(self._sizes.get(str(event.anchor), 1), event.start_mark)
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nesting deeper than {MAX_DEPTH} levels", event.start_mark
                )
            before = self._nodes
            self._charge(1, event.start_mark)
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._sizes[str(anchor)] = self._nodes - before
        return node


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _merged_entries(node: yaml.MappingNode, seen: set[int]) -> list[tuple[Any, Any]]:
    """The entries ``<<`` merges into ``node``, the one that takes precedence first.

    YAML's merge key fills only what the mapping does not say itself; of several merged
    mappings (``<<: [*a, *b]``) the first wins, and a merged mapping's own merges come after
    its own keys. Nodes are read, never changed: an anchored mapping is constructed once and
    may be merged again elsewhere.
    """
    if id(node) in seen:
        raise yaml.constructor.ConstructorError(
            None, None, "a mapping merges itself (<<: refers to the mapping it is in)",
            node.start_mark)
    seen = seen | {id(node)}
    out: list[tuple[Any, Any]] = []
    for key_node, value_node in node.value:
        if key_node.tag != _MERGE_TAG:
            continue
        sources = (value_node.value if isinstance(value_node, yaml.SequenceNode)
                   else [value_node])
        for source in sources:
            if not isinstance(source, yaml.MappingNode):
                raise yaml.constructor.ConstructorError(
                    None, None, "<< merges a mapping or a list of mappings, not "
                    f"{source.id}", source.start_mark)
            out += [(k, v) for k, v in source.value if k.tag != _MERGE_TAG]
            out += _merged_entries(source, seen)
    return out


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    own = [(k, v) for k, v in node.value if k.tag != _MERGE_TAG]
    merged = _merged_entries(node, set()) if len(own) < len(node.value) else []
    out: dict[Any, Any] = {}
    for i, (key_node, value_node) in enumerate(own + merged):
        if not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(
                None, None,
                "a mapping key must be a plain name or number, not a list or a mapping",
                key_node.start_mark,
            )
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            if i >= len(own):
                continue  # a merged key the mapping (or an earlier merge) already says
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {_SHORT.repr(key)}", key_node.start_mark
            )
        out[key] = loader.construct_object(value_node, deep=True)
    return out


class _Refused(yaml.constructor.ConstructorError):
    """A YAML construct the loader refuses, with the fix to report instead of a generic one."""

    def __init__(self, problem: str, fix: str, mark: Any) -> None:
        super().__init__(None, None, problem, mark)
        self.fix = fix


# A policy is JSON data: it is hashed as its canonical JSON. A set has no order (a list built
# from it follows PYTHONHASHSEED, so a Run resumed by another process has another policy hash);
# the other types have no JSON form to hash at all.
_NOT_JSON = {
    "tag:yaml.org,2002:set": ("a YAML set (!!set) has no order, so the policy's hash would "
                              "differ from one process to the next", "write a YAML list [a, b]"),
    "tag:yaml.org,2002:omap": ("an ordered mapping (!!omap) is not JSON data",
                               "write a plain mapping {a: 1, b: 2}"),
    "tag:yaml.org,2002:pairs": ("a list of pairs (!!pairs) is not JSON data",
                                "write a plain mapping {a: 1, b: 2}"),
    "tag:yaml.org,2002:binary": ("binary data (!!binary) is not JSON data",
                                 "write the value as text"),
    "tag:yaml.org,2002:timestamp": ("a date or time (!!timestamp) is not JSON data",
                                    "write it as a quoted string, or a number of seconds"),
}


def _construct_not_json(loader: _UniqueKeyLoader, node: yaml.Node) -> Any:
    problem, fix = _NOT_JSON[str(node.tag)]
    raise _Refused(problem, fix, node.start_mark)


_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_BOOL = "tag:yaml.org,2002:bool"
_DECIMAL = re.compile(r"[-+]?[0-9][0-9_]*")


def _construct_int(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> Any:
    text = str(node.value)
    digits = sum(c.isalnum() for c in text)
    if digits > MAX_INT_DIGITS:
        raise yaml.constructor.ConstructorError(
            None, None,
            f"an integer of {digits} digits; policy numbers have at most {MAX_INT_DIGITS}",
            node.start_mark,
        )
    # YAML 1.2: 010 is ten (YAML 1.1, PyYAML's own reading, made it eight), 0o10 is eight.
    if _DECIMAL.fullmatch(text):
        return int(text.replace("_", ""), 10)
    try:
        return int(text[2:], {"0o": 8, "0x": 16}[text[:2].lower()])
    except (KeyError, ValueError):
        raise _Refused(f"{_SHORT.repr(text)} is not a YAML 1.2 integer",
                       "write a decimal integer, or one in 0o (octal) or 0x (hex)",
                       node.start_mark) from None


def _construct_float(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> Any:
    text = str(node.value).replace("_", "").lower()
    special = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}
    if text in special:
        return special[text]
    try:
        return float(text)  # never base 60 (YAML 1.1 read 1:30 as 90)
    except ValueError:
        raise _Refused(f"{_SHORT.repr(node.value)} is not a YAML 1.2 number",
                       "write a number such as 1.5, 1e3 or 600", node.start_mark) from None


def _construct_bool(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> Any:
    text = str(node.value).lower()
    if text not in ("true", "false"):  # YAML 1.1 also read yes, no, on, off
        raise _Refused(f"{_SHORT.repr(node.value)} is not a YAML 1.2 boolean",
                       "write true or false", node.start_mark)
    return text == "true"


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)
_UniqueKeyLoader.add_constructor(_INT, _construct_int)
_UniqueKeyLoader.add_constructor(_FLOAT, _construct_float)
_UniqueKeyLoader.add_constructor(_BOOL, _construct_bool)
for _tag in _NOT_JSON:
    _UniqueKeyLoader.add_constructor(_tag, _construct_not_json)

# Plain scalars are read by YAML 1.2's core schema, as the docs promise; PyYAML implements
# YAML 1.1, which changed values silently: `no:` (a provider's key) was the boolean False, 010
# was eight, 1:30 was ninety, a date a date. Now only true/false are booleans, 010 is ten, 0o10
# eight, 1:30 and dates are text, 1e3 is a number. ``_`` between digits is still read, as PyYAML
# did; null and the merge key ``<<`` are as before.
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag in ("tag:yaml.org,2002:null", _MERGE_TAG, "tag:yaml.org,2002:yaml")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_UniqueKeyLoader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_UniqueKeyLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
_UniqueKeyLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(r"^(?:[-+]?(?:\.[0-9][0-9_]*|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"),
)


def _load_file(path: Path) -> Policy:
    file = _shown(path)
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise PolicyError(
                f"{file}: the policy file is larger than {MAX_FILE_BYTES} bytes",
                file=file,
                errors=[("<file>", f"larger than {MAX_FILE_BYTES} bytes",
                         "a policy is a few KiB: start from a preset "
                         "(`failover-ledger policy show`)")],
            )
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(
            f"{file}: cannot read the policy file: {_shown(e)}",
            file=file,
            errors=[("<file>", _shown(e), "make the file readable UTF-8 text")],
        ) from e
    data, form = _json_document(path, text, file), "JSON"
    if data is _NOT_JSON_TEXT:
        data, form = _yaml_document(text, file), "YAML"
    if not isinstance(data, dict):
        kind = ("empty" if data is None and form == "YAML" else "null" if data is None
                else f"a {form} {type(data).__name__}")
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


_NOT_JSON_TEXT = object()


class _DuplicateJsonKey(ValueError):
    pass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # json.loads would let the last win
            raise _DuplicateJsonKey(key)
        out[key] = value
    return out


def _json_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {digits} digits; policy numbers have at most "
                         f"{MAX_INT_DIGITS}")
    return int(text)


def _json_document(path: Path, text: str, file: str) -> Any:
    """The data of a JSON policy, or :data:`_NOT_JSON_TEXT` for YAML text.

    A ``.json`` file, or text that starts with ``{``, is JSON: YAML reads most JSON, but not
    JSON indented with tabs, which it refused as a syntax error. Text that only starts like
    JSON but is not (a YAML flow mapping such as ``{name: x}``) is left to YAML.
    """
    body = text.lstrip("\ufeff")
    strict = path.suffix.lower() == ".json"
    if not strict and not body.lstrip().startswith("{"):
        return _NOT_JSON_TEXT
    try:
        return json.loads(body, object_pairs_hook=_unique_pairs, parse_int=_json_int)
    except _DuplicateJsonKey as e:
        key = _SHORT.repr(e.args[0])
        raise PolicyError(
            f"{file}: JSON error: duplicate key {key}",
            file=file,
            errors=[("<json>", f"duplicate key {key}", "keep one of the two entries")],
        ) from e
    except json.JSONDecodeError as e:
        if not strict:
            return _NOT_JSON_TEXT
        where = f"line {e.lineno}, column {e.colno}"
        raise PolicyError(
            f"{file}: JSON error at {where}: {_shown(e.msg)}",
            file=file,
            errors=[(f"<json {where}>", _shown(e.msg), "fix the JSON syntax at that position")],
        ) from e
    except (ValueError, RecursionError) as e:
        problem = (f"nesting deeper than {MAX_DEPTH} levels" if isinstance(e, RecursionError)
                   else _shown(e))
        raise PolicyError(
            f"{file}: the JSON could not be read: {problem}",
            file=file,
            errors=[("<json>", problem, "write plain JSON: objects, arrays, strings, numbers")],
        ) from e


def _yaml_document(text: str, file: str) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # safe: no arbitrary objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"
        problem = _shown(getattr(e, "problem", None) or e)
        fix = (e.fix if isinstance(e, _Refused)
               else "fix the YAML syntax at that position" if isinstance(
                   e, yaml.scanner.ScannerError | yaml.parser.ParserError)
               else "simplify the YAML at that position")
        raise PolicyError(
            f"{file}: YAML error at {where}: {problem}",
            file=file,
            errors=[(f"<yaml {where}>", problem, fix)],
        ) from e
    except (ValueError, TypeError, ArithmeticError, RecursionError) as e:
        raise PolicyError(
            f"{file}: the YAML could not be read: {_shown(e)}",
            file=file,
            errors=[("<yaml>", _shown(e), "write plain YAML: mappings, lists, names, numbers")],
        ) from e


def validate_policy(data: Mapping[str, Any] | object, *, file: str | None = None) -> Policy:
    """Validate a mapping into a :class:`Policy`.

    Raises:
        PolicyError: every problem, each naming the field path and the fix (also for a value
            that is not a mapping at all).
    """
    where = file or "<policy>"
    if not isinstance(data, Mapping):
        kind = "empty" if data is None else f"a value of type {type(data).__name__}"
        raise PolicyError(
            f"{where}: a policy must be a mapping of sections, but it is {kind}",
            file=file,
            errors=[("<root>", f"the policy is {kind}",
                     "pass a mapping (name:, failover:, classification:, moves_on:, ...), a "
                     f"policy file path, or a preset name ({', '.join(PRESETS)})")],
        )
    problems: list[tuple[str, str, str]] = []
    _check_shape(data, (), 0, [0], set(), problems)
    if problems:
        raise _error_from(problems, file)
    try:
        # Past Policy.model_validate (which raises InvalidArgument): a file's or a mapping's
        # problems are a PolicyError, with the loader's paths and fixes.
        return cast(Policy, Policy.__pydantic_validator__.validate_python(dict(data)))
    except ValidationError as e:
        raise _policy_error(e, file) from e
    except (ValueError, TypeError, ArithmeticError, RecursionError) as e:
        raise PolicyError(
            f"{where}: the policy could not be validated: {_shown(e)}",
            file=file,
            errors=[("<root>", _shown(e), "compare it with `failover-ledger policy schema`")],
        ) from e


def _check_shape(
    value: Any,
    loc: tuple[Any, ...],
    depth: int,
    count: list[int],
    path_ids: set[int],
    problems: list[tuple[str, str, str]],
) -> None:
    """Bounds any policy data must meet before validation (see the module docstring)."""
    if len(problems) >= _MAX_REPORTED or count[0] > MAX_NODES:
        return
    count[0] += 1
    if count[0] > MAX_NODES:
        problems.append((_path(loc), f"the policy has more than {MAX_NODES} values",
                         "a policy is a few hundred values: start from a preset"))
        return
    if depth > MAX_DEPTH:
        problems.append((_path(loc), f"nested deeper than {MAX_DEPTH} levels",
                         "policy sections are a few levels deep; compare with a preset"))
        return
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        if abs(value) > MAX_NUMBER:
            problems.append((_path(loc), "the number is too large", _IN_RANGE))
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            problems.append((_path(loc), f"{value!r} is not a finite number", "use a number"))
        elif abs(value) > MAX_NUMBER:
            problems.append((_path(loc), "the number is too large", _IN_RANGE))
        return
    if isinstance(value, str | bytes | bytearray):
        if len(value) > MAX_STRING_CHARS:
            problems.append((_path(loc), f"a text of {len(value)} characters",
                             f"use at most {MAX_STRING_CHARS} characters"))
        return
    if isinstance(value, Set):
        # A list validated from it follows the set's iteration order, which PYTHONHASHSEED
        # picks: the same policy would hash differently in each process.
        problems.append((_path(loc), "a set has no order, so the policy's hash would differ "
                         "from one process to the next", "pass a list [a, b] (sorted, if the "
                         "order means nothing)"))
        return
    if not isinstance(value, Mapping | list | tuple):
        return  # dates and other scalars: the model says what it wants instead
    if id(value) in path_ids:
        problems.append((_path(loc), "the value contains itself",
                         "pass plain data: no container may refer to itself"))
        return
    path_ids.add(id(value))
    try:
        if isinstance(value, Mapping):
            for k, v in value.items():
                if isinstance(k, str) and len(k) > MAX_STRING_CHARS:
                    problems.append((_path(loc), "a key is too long",
                                     f"use keys of at most {MAX_STRING_CHARS} characters"))
                    continue
                _check_shape(v, (*loc, k), depth + 1, count, path_ids, problems)
        else:
            for i, v in enumerate(value):
                _check_shape(v, (*loc, i), depth + 1, count, path_ids, problems)
    finally:
        path_ids.discard(id(value))


def _error_from(errors: list[tuple[str, str, str]], file: str | None) -> PolicyError:
    shown = errors[:_MAX_REPORTED]
    where = file or "<policy>"
    lines = [f"{where}: the policy is invalid ({len(errors)} problem(s)):"]
    lines += [f"  {path}: {problem}; fix: {fix}" for path, problem, fix in shown]
    if len(errors) > len(shown):
        lines.append(f"  ... and {len(errors) - len(shown)} more")
    return PolicyError("\n".join(lines), file=file, errors=shown)


def _policy_error(e: ValidationError, file: str | None) -> PolicyError:
    return _error_from([_describe(err) for err in e.errors(include_url=False)], file)


def _describe(err: Any) -> tuple[str, str, str]:
    loc: tuple[Any, ...] = tuple(err.get("loc", ()))
    kind = str(err.get("type", ""))
    ctx: dict[str, Any] = err.get("ctx") or {}
    cause = ctx.get("error")
    if isinstance(cause, PolicyValueError):
        if cause.field:
            loc = (*loc, cause.field)
        return _path(loc), cause.problem, cause.fix
    msg = _shown(err.get("msg", "invalid value"))
    got = _SHORT.repr(err.get("input"))
    if kind == "extra_forbidden":
        valid = _valid_keys(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1) if loc and valid else []
        fix = "remove it" + (f", or rename it to {close[0]!r}" if close else "")
        fix += f"; valid keys here: {', '.join(valid)}" if valid else ""
        return _path(loc), "unknown key", fix
    if kind == "invalid_key":
        return _path(loc), f"the key {got} is not a name", "use a string key (a section or field)"
    if kind == "missing":
        return _path(loc), "required field is missing", "add it"
    if kind in ("greater_than_equal", "greater_than"):
        bound = ctx.get("ge", ctx.get("gt"))
        op = ">=" if "ge" in ctx else ">"
        return _path(loc), f"{msg} (got {got})", f"use a value {op} {_num(bound)}"
    if kind in ("less_than_equal", "less_than"):
        bound = ctx.get("le", ctx.get("lt"))
        op = "<=" if "le" in ctx else "<"
        return _path(loc), f"{msg} (got {got})", f"use a value {op} {_num(bound)}"
    if kind in ("enum", "literal_error"):
        return _path(loc), f"{got} is not allowed", msg[0].lower() + msg[1:]
    if kind == "finite_number":
        return _path(loc), f"{got} is not a finite number", "use a finite number"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return _path(loc), f"wrong type: {msg} (got {got})", _type_fix(kind)
    return _path(loc), f"{msg} (got {got})", "correct the value"


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
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        elif isinstance(part, str) and part.startswith("[") and out:
            out += part  # a validator's own index into the field (PolicyValueError.field)
        else:
            out += ("." if out else "") + _shown(part, 64)
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


@checked
def policy_hash(policy: PolicyArg) -> str:
    """A stable content hash (``sha256:<hex>``) of the policy's canonical JSON.

    It is what a Run freezes as ``policy_hash``: two policies with the same hash decide alike.

    Raises:
        InvalidArgument: ``policy`` is not a :class:`Policy` (load a name or a path first).
    """
    return content_hash(policy.model_dump(mode="json"))


def policy_json_schema() -> dict[str, Any]:
    """The published JSON schema of a policy file.

    Besides each field's own bounds it carries the loader's: every number within
    :data:`MAX_NUMBER`, every text within :data:`MAX_STRING_CHARS`.
    """
    schema = Policy.model_json_schema(mode="validation")
    _with_loader_bounds(schema)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def _with_loader_bounds(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _with_loader_bounds(item)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") in ("number", "integer"):
        if not any(k in node for k in ("maximum", "exclusiveMaximum")):
            node["maximum"] = MAX_NUMBER
        if not any(k in node for k in ("minimum", "exclusiveMinimum")):
            node["minimum"] = -MAX_NUMBER
    if node.get("type") == "string" and "enum" not in node and "maxLength" not in node:
        node["maxLength"] = MAX_STRING_CHARS
    for key, value in node.items():
        if key not in ("default", "enum", "const", "examples"):
            _with_loader_bounds(value)


__all__ = [
    "DEFAULT_PRESET",
    "OVERRIDE_KEYS",
    "PRESETS",
    "PolicySource",
    "PresetName",
    "apply_overrides",
    "default_policy",
    "load_policy",
    "own_copy",
    "policy_hash",
    "policy_json_schema",
    "preset",
    "preset_dirs",
    "shared_preset",
    "validate_policy",
]
