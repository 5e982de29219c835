"""The one place pydantic's ``ValidationError`` becomes :class:`~ledger.errors.InvalidArgument`.

Every public value model (routes, budgets, grants, envelopes, facts, ...) derives from
:class:`StrictModel`. Building one (``Route(...)``), validating data into one
(``Route.model_validate(...)``, ``model_validate_json``, ``model_validate_strings``) or assigning
to one (they are frozen) raises ``InvalidArgument`` and never pydantic's error:

- ``field`` is the dotted path of the first problem (``group``, ``profiles[1].id``,
  ``recipients['r1'][0]``); the facade prefixes where it validated the value
  (``plan[0].group``, ``budget.max_cost``);
- ``errors`` lists every problem as ``(path, problem, fix)``, like ``PolicyError.errors``;
- the message says what was wrong and what to pass instead.

A nested model validated as part of an outer one reports the outer path: pydantic validates the
whole value in one pass (the nested model's ``__init__`` is not called), and the path is read
from its error. ``model_construct`` and ``model_copy(update=...)`` skip validation, as pydantic
documents; build a new model to have a changed value checked.

The annotated field types here (:data:`Id`, :data:`Count`, :data:`Seconds`, ...) carry the ranges
of :mod:`ledger.domain.bounds`, so a model and an API argument accept exactly the same values.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import reprlib
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, Self, TypeVar, Union, cast, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from ledger.domain.bounds import (
    MAX_COUNT,
    MAX_ID_LENGTH,
    id_problem,
    text_problem,
)
from ledger.errors import ArgumentMismatch, InvalidArgument

M = TypeVar("M", bound=BaseModel)

MAX_REPORTED = 5
_SEE_DOCS = "pass a value as the field's documentation says (docs/concepts.md)"
MAX_TEXT = 200

_SHORT = reprlib.Repr()
_SHORT.maxstring = 40
_SHORT.maxother = 40
_SHORT.maxlist = 4
_SHORT.maxdict = 4


class Problem(ValueError):
    """Raised by a field validator: what is wrong with the value, and what to pass instead.

    A plain ``ValueError`` works too (its text becomes the problem); this one also says the fix.
    """

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix


def _id(value: str) -> str:
    found = id_problem(value)
    if found is not None:
        raise Problem(*found)
    return value


def _text(value: str) -> str:
    found = text_problem(value, MAX_TEXT)
    if found is not None:
        raise Problem(*found)
    return value


# -- field types with the documented ranges (ledger.domain.bounds) -----------------------------

Id = Annotated[StrictStr, AfterValidator(_id)]
"""An identifier: 1 to 200 printable characters, not only whitespace (``bounds.check_id``)."""
Text = Annotated[StrictStr, AfterValidator(_text)]
"""A short printable text (a name, a reason): at most 200 characters."""
Count = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]
"""An integer in [0, 10^9]; ``True``/``False`` are not counts."""
Instant = Annotated[StrictFloat, Field(allow_inf_nan=False)]
"""A finite time in the clock's unit (epoch seconds), as the ledger computes and reads it."""
Seconds = Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)]
"""A finite, non-negative duration in seconds."""
HttpStatus = Annotated[StrictInt, Field(ge=0, le=999)]
"""An HTTP status: the three digits of a status line, 0 to 999. Every one is kept as evidence
(a hostile server may send 042 or 999); each fits the status column on both backends."""


class StrictModel(BaseModel):
    """Base of the ledger's public value models.

    Frozen, no unknown fields, and every validation problem an :class:`InvalidArgument` naming
    the field (see the module docstring).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            # ``from None``: the pydantic error repeats the input, which may be private
            # envelope content; everything it says is in the InvalidArgument's ``errors``.
            raise invalid_argument(e, type(self)) from None

    # Not a "custom" __init__ for pydantic: nested models keep being validated in the outer
    # model's single pass, so their errors carry the outer path.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """Validate ``obj`` into this model; problems raise :class:`InvalidArgument`."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as e:
            raise invalid_argument(e, cls) from None

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Self:
        """Validate JSON text into this model; problems raise :class:`InvalidArgument`."""
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as e:
            raise invalid_argument(e, cls) from None

    @classmethod
    def model_validate_strings(cls, obj: Any, **kwargs: Any) -> Self:
        """Validate string data into this model; problems raise :class:`InvalidArgument`."""
        try:
            return super().model_validate_strings(obj, **kwargs)
        except ValidationError as e:
            raise invalid_argument(e, cls) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise invalid_argument(e, type(self)) from None

    def __delattr__(self, name: str) -> None:
        try:
            super().__delattr__(name)
        except ValidationError as e:
            raise invalid_argument(e, type(self)) from None


def validate_as(cls: type[M], value: Any, field: str) -> M:
    """``value`` (an instance, or a mapping of its fields) as ``cls``.

    Problems raise :class:`InvalidArgument` with paths under ``field`` (``budget.max_cost``).
    """
    if isinstance(value, cls):
        return value
    try:
        # The validator itself (not cls.model_validate, which reports paths from the model's
        # root): the error's paths are then prefixed with where the value sat.
        out: M = cls.__pydantic_validator__.validate_python(value)
        return out
    except ValidationError as e:
        raise invalid_argument(e, cls, field) from None


# -- turning a ValidationError into InvalidArgument ---------------------------------------------


def invalid_argument(error: ValidationError, model: type[BaseModel] | None,
                     prefix: str = "") -> InvalidArgument:
    """One :class:`InvalidArgument` for every problem pydantic found in ``model``'s data.

    ``prefix`` is where the data sat in the caller's arguments (``plan[0]``).
    """
    problems: list[tuple[str, str, str]] = []
    seen: set[str] = set()
    root = prefix or (model.__name__ if model is not None else "value")
    for err in error.errors(include_url=False):
        path, owner = _path(model, tuple(err.get("loc", ())), prefix)
        problem, fix = _describe(err, owner)
        path = path or root
        if path in seen and len(problems) >= 1:
            # A union reports one error per member: the first one says enough.
            continue
        seen.add(path)
        problems.append((path, problem, fix))
    # A misspelt field is reported as missing under its name and unknown under the typo: the
    # typo comes first, with its likely spelling (the "missing" one is its consequence).
    problems.sort(key=lambda p: 0 if p[1].startswith("is not a field of") else 1)
    shown = problems[:MAX_REPORTED]
    head_path, head_problem, head_fix = shown[0]
    message = f"invalid {head_path}: {head_problem}; {head_fix}"
    if len(shown) > 1:
        rest = "; ".join(f"{p}: {problem}" for p, problem, _ in shown[1:])
        more = len(problems) - len(shown)
        message += f" (also {rest}" + (f", and {more} more)" if more else ")")
    return InvalidArgument(message, field=head_path, errors=shown)


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and ``Optional`` (pydantic adds no path item for either)."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
            continue
        if origin in (Union, types.UnionType):
            members = [a for a in get_args(tp) if a is not type(None)]
            if len(members) == 1:
                tp = members[0]
                continue
        return tp


def _path(model: type[BaseModel] | None, loc: tuple[int | str, ...],
          prefix: str) -> tuple[str, type[BaseModel] | None]:
    """The dotted path of ``loc`` in ``model``'s data, and the model that owns the last item.

    Walking the field types tells a field name from a union member's tag (which pydantic puts
    in ``loc`` too, and which is no part of where the value sits).
    """
    out = prefix
    tp: Any = model
    owner: type[BaseModel] | None = None
    for item in loc:
        tp = _unwrap(tp)
        origin = get_origin(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            owner = tp
            out += f".{item}" if out else str(item)
            info = tp.model_fields.get(str(item))
            tp = info.annotation if info is not None else None
        elif origin in (list, tuple, set, frozenset, Sequence) or tp in (list, tuple):
            out += f"[{item}]"
            args = [a for a in get_args(tp) if a is not Ellipsis]
            tp = args[0] if args else None
        elif origin in (dict, Mapping) or tp is dict:
            if item == "[key]":  # the problem is the key itself, already in the path
                continue
            out += f"[{item!r}]"
            pair = get_args(tp)
            tp = pair[1] if len(pair) == 2 else None
        elif origin in (Union, types.UnionType):
            tp = None  # a union member's tag: not part of the path
        elif tp is None or tp is Any:
            if item == "[key]":
                continue
            out += f"[{item}]" if isinstance(item, int) else (f".{item}" if out else str(item))
        else:
            # A leaf (str, int, Literal, enum) with a trailing tag (e.g. a validator's): done.
            break
    return out, owner


def _got(err: Mapping[str, Any]) -> str:
    return f" (got {_SHORT.repr(err.get('input'))})" if "input" in err else ""


def _fields_of(owner: type[BaseModel] | None) -> list[str]:
    return sorted(owner.model_fields) if owner is not None else []


def _describe(err: Mapping[str, Any], owner: type[BaseModel] | None) -> tuple[str, str]:
    """``(problem, fix)`` for one pydantic error: the fix says what to pass instead."""
    kind = str(err.get("type", ""))
    ctx: dict[str, Any] = dict(err.get("ctx") or {})
    got = _got(err)
    loc = tuple(err.get("loc", ()))
    if kind in ("value_error", "assertion_error"):
        cause = ctx.get("error")
        if isinstance(cause, Problem):
            return f"{cause.problem}{got}", cause.fix
        return f"{cause or err.get('msg')}{got}", _SEE_DOCS
    if kind == "missing":
        return "is required", "pass it"
    if kind == "extra_forbidden":
        valid = _fields_of(owner)
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1) if loc and valid else []
        fix = "remove it" + (f" or rename it to {close[0]!r}" if close else "")
        return (f"is not a field of {owner.__name__ if owner else 'this model'}",
                fix + (f"; the fields are {', '.join(valid)}" if valid else ""))
    if kind in ("literal_error", "enum"):
        expected = ctx.get("expected", "")
        return f"is not one of the choices{got}", f"pass one of {expected}"
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
              "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}
    if kind in bounds:
        op, key = bounds[kind]
        return f"is out of range{got}", f"pass a value {op} {_num(ctx.get(key))}"
    if kind == "string_too_long":
        return f"is too long{got}", f"pass at most {ctx.get('max_length')} characters"
    if kind == "string_pattern_mismatch":
        return (f"does not match {ctx.get('pattern')}{got}",
                "pass a value of that form (e.g. an environment variable name such as "
                "'OPENAI_API_KEY' for api_key_env)")
    if kind == "string_too_short":
        return f"is too short{got}", f"pass at least {ctx.get('min_length')} character(s)"
    if kind == "too_long":
        return f"has too many items{got}", f"pass at most {ctx.get('max_length')} items"
    if kind == "too_short":
        return f"has too few items{got}", f"pass at least {ctx.get('min_length')} item(s)"
    if kind.startswith("int_"):
        return f"is not an integer{got}", "pass an integer such as 3 (not a bool or a float)"
    if kind.startswith("bool_"):
        return f"is not a boolean{got}", "pass True or False"
    if kind == "finite_number":
        return f"is not finite{got}", "pass a finite number (not NaN or infinity)"
    if kind.startswith("float_"):
        return f"is not a number{got}", "pass a number such as 1.5 (not a bool or a string)"
    if kind.startswith("decimal_"):
        return f"is not a decimal amount{got}", "pass a decimal amount such as '0.25'"
    if kind.startswith("string_"):
        return f"is not a string{got}", "pass a string"
    if kind.startswith("bytes_"):
        return f"is not text{got}", "pass a string or bytes"
    if kind in ("list_type", "tuple_type", "set_type", "frozen_set_type", "iterable_type"):
        return f"is not a list{got}", "pass a list"
    if kind in ("dict_type", "mapping_type"):
        return f"is not a mapping{got}", "pass a mapping (a dict)"
    if kind in ("model_type", "model_attributes_type", "dataclass_type"):
        name = ctx.get("class_name") or (owner.__name__ if owner else "model")
        return f"is not a {name}{got}", f"pass a ledger.{name} or a mapping of its fields"
    if kind == "is_instance_of":
        return f"is not a {ctx.get('class')}{got}", f"pass a {ctx.get('class')}"
    if kind in ("frozen_instance", "frozen_field"):
        name = owner.__name__ if owner else "the model"
        return (f"cannot be assigned: {name} is frozen",
                f"build a new {name} with the changed value")
    return f"{err.get('msg', 'is invalid')}{got}", _SEE_DOCS


def _num(value: Any) -> str:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    return str(int(f)) if f.is_integer() and abs(f) < 1e16 else f"{f:g}"


# -- calls that fit no signature ----------------------------------------------------------------
#
# Python refuses an unknown keyword with a TypeError that names no field and suggests nothing.
# The public entry points are wrapped once (per class, or per function) so that such a call
# raises ArgumentMismatch naming the argument and its likely spelling. The check costs nothing
# on a call that fits: the signature is bound only after a TypeError, to tell a call that does
# not fit from a TypeError raised inside the body (which is re-raised unchanged).

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)


def _mismatch(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> ArgumentMismatch | None:
    """The ArgumentMismatch of calling ``fn`` so, or ``None`` when the call fits."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        return _describe_mismatch(fn, sig, args, kwargs, e)
    return None


def _describe_mismatch(fn: Callable[..., Any], sig: inspect.Signature, args: tuple[Any, ...],
                       kwargs: dict[str, Any], error: TypeError) -> ArgumentMismatch:
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", "function"))
    params = sig.parameters
    P = inspect.Parameter
    by_keyword = [n for n, p in params.items()
                  if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and n != "self"]
    open_keywords = any(p.kind is P.VAR_KEYWORD for p in params.values())
    for key in kwargs:
        if not open_keywords and key not in by_keyword:
            close = difflib.get_close_matches(key, by_keyword, n=1)
            fix = (f"did you mean {close[0]!r}?" if close
                   else f"its arguments are {', '.join(by_keyword) or 'none'}")
            return ArgumentMismatch(f"{name}() has no argument {key!r}; {fix}", field=key,
                                    function=name)
    given = set(kwargs)
    positional = [n for n, p in params.items() if p.kind in (P.POSITIONAL_ONLY,
                                                           P.POSITIONAL_OR_KEYWORD)]
    given.update(positional[:len(args)])
    for n, p in params.items():
        if (p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)
                and n not in given):
            return ArgumentMismatch(f"{name}() needs the argument {n!r}; pass it", field=n,
                                    function=name)
    return ArgumentMismatch(f"{name}(): {error}; pass the arguments its signature lists "
                            f"({', '.join(by_keyword)})", field="args", function=name)


def checked_call(fn: F) -> F:
    """``fn``, raising :class:`ArgumentMismatch` for a call that does not fit its signature."""
    if getattr(fn, "__ledger_checked__", False):
        return fn
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def acall(*args: Any, **kwargs: Any) -> Any:
            try:
                coro = fn(*args, **kwargs)
            except TypeError:
                found = _mismatch(fn, args, kwargs)
                if found is not None:
                    raise found from None
                raise
            try:
                return await coro
            except TypeError:
                # A wrapper that forwards (*args, **kwargs) fails only when it calls through.
                found = _mismatch(fn, args, kwargs)
                if found is not None:
                    raise found from None
                raise

        acall.__ledger_checked__ = True  # type: ignore[attr-defined]
        return cast(F, acall)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TypeError:
            found = _mismatch(fn, args, kwargs)
            if found is not None:
                raise found from None
            raise

    call.__ledger_checked__ = True  # type: ignore[attr-defined]
    return cast(F, call)


def checked_calls(cls: C) -> C:
    """``cls`` with every public method (and ``__init__``) wrapped by :func:`checked_call`."""
    for name, member in list(vars(cls).items()):
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(member, classmethod):
            setattr(cls, name, classmethod(checked_call(member.__func__)))
        elif isinstance(member, staticmethod):
            setattr(cls, name, staticmethod(checked_call(member.__func__)))
        elif inspect.isfunction(member):
            setattr(cls, name, checked_call(member))
    return cls



def check_known_keys(given: Iterable[str], known: Sequence[str], what: str) -> None:
    """Refuse any key of ``given`` that is not one of ``known``.

    The :class:`~ledger.errors.ArgumentMismatch` names the key, its likely spelling and the
    valid keys; ``what`` names one key in the message, e.g. ``"an attempt filter"``.
    """
    unknown = sorted(set(given) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        raise ArgumentMismatch(
            f"{unknown[0]!r} is not {what}; "
            + (f"did you mean {close[0]!r}? " if close else "")
            + f"pass only {', '.join(known)}", field=unknown[0])


def check_secret_provider(secrets: Any) -> None:
    """``secrets`` must be a SecretProvider (``get(profile_id, protocol=...)``), not a dict."""
    if secrets is not None and (isinstance(secrets, Mapping)
                                or not callable(getattr(secrets, "get", None))):
        # A dict has a get() too, but not get(profile_id, protocol=...): wrap it instead.
        raise InvalidArgument("secrets must be a SecretProvider (with get(profile_id, "
                              "protocol=...)); pass e.g. EnvSecretProvider(), or "
                              "StaticSecretProvider(...) for keys held in memory",
                              field="secrets")


__all__ = [
    "MAX_ID_LENGTH",
    "MAX_TEXT",
    "Count",
    "HttpStatus",
    "Id",
    "Instant",
    "Problem",
    "Seconds",
    "StrictModel",
    "Text",
    "check_known_keys",
    "check_secret_provider",
    "checked_call",
    "checked_calls",
    "invalid_argument",
    "validate_as",
]
