"""One way to validate: pydantic, for values and for calls, and one error mapper.

Every public value model (routes, budgets, grants, envelopes, facts, ...) derives from
:class:`StrictModel`, and every public function and method is decorated with :func:`checked`
(:func:`pydantic.validate_call`, its validator built once per signature, on the first call).
Both read the same annotated types (:data:`Id`, :data:`Money`, :data:`Time`, :func:`integers`,
:func:`duration`, :func:`one_of`, ...), whose ranges are :mod:`ledger.domain.bounds`, so a
model and an argument accept exactly the same values. A problem is
:class:`~ledger.errors.InvalidArgument` and never pydantic's error:

- ``field`` is the argument or the dotted path inside it (``budget.max_cost``,
  ``plan[0].group``, ``profiles[1].id``, ``labels['team']``);
- ``errors`` lists every problem as ``(path, problem, fix)``, like ``PolicyError.errors``;
- the message says what was wrong and what to pass instead.

A call that does not fit the signature (an unknown keyword, a missing argument, one too many)
is :class:`~ledger.errors.ArgumentMismatch` naming the argument and its likely spelling.

A nested model validated as part of an outer one reports the outer path: pydantic validates the
whole value in one pass (the nested model's ``__init__`` is not called), and the path is read
from its error. ``model_construct`` and ``model_copy(update=...)`` skip validation, as pydantic
documents; build a new model to have a changed value checked.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import math
import reprlib
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from enum import Enum
from typing import (
    Annotated,
    Any,
    Generic,
    NotRequired,
    Required,
    Self,
    TypeVar,
    Union,
    Unpack,
    cast,
    get_args,
    get_origin,
    get_type_hints,
)

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    validate_call,
)
from pydantic_core import core_schema

from ledger.domain.bounds import (
    MAX_AMOUNT,
    MAX_COUNT,
    MAX_HEALTH_KEY_LENGTH,
    MAX_ID_LENGTH,
    MAX_LABELS,
    MAX_RECIPIENT_LENGTH,
    MAX_TIME,
    MAX_TOKENS,
)
from ledger.errors import ArgumentMismatch, InvalidArgument
from ledger.forking import in_child

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

MAX_REPORTED = 5
MAX_TEXT = 200
_SEE_DOCS = "pass a value as the field's documentation says (docs/concepts.md)"

_SHORT = reprlib.Repr()
_SHORT.maxstring = 40
_SHORT.maxother = 40
_SHORT.maxlist = 4
_SHORT.maxdict = 4


class Problem(ValueError):
    """Raised by a validator: what is wrong with the value, and what to pass instead.

    A plain ``ValueError`` works too (its text becomes the problem); this one also says the fix,
    ``at`` where inside the value the problem sits (``[2]`` of a list), and ``fields`` what the
    :class:`~ledger.errors.InvalidArgument` carries besides (``choices=[...]``).
    """

    def __init__(self, problem: str, fix: str, at: str = "", **fields: Any) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix, self.at, self.fields = problem, fix, at, fields


# -- the rules ----------------------------------------------------------------------------------
#
# A rule is a function of a value that returns it as the ledger uses it or raises a Problem. It is
# called directly, and it is an annotation: ``Annotated[float, duration(60)]`` has pydantic run it,
# for a model's field and for a call's argument alike.

R = TypeVar("R")


class Rule(Generic[R]):
    """A validator: call it on a value, or put it in ``Annotated[...]`` for pydantic to run.

    ``before``: the rule runs first and pydantic's own validation of the annotated type after
    it (so a model field keeps its JSON schema); otherwise the rule is the whole validation.
    """

    def __init__(self, check: Callable[[Any], R], *, before: bool = False) -> None:
        self.check = check
        self.before = before

    def __call__(self, value: Any) -> R:
        """``value`` as the rule accepts it, else :class:`Problem`."""
        return self.check(value)

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        if self.before:
            return core_schema.no_info_before_validator_function(self.check, handler(source))
        return core_schema.no_info_plain_validator_function(self.check)


def rule(check: Callable[[Any], R]) -> Rule[R]:
    """``check`` as a :class:`Rule` (a decorator)."""
    return Rule(check)


def that(test: Callable[[Any], bool], problem: str, fix: str) -> Rule[Any]:
    """A value ``test`` accepts, as it is; else ``problem``, and ``fix`` says what to pass."""

    def check(value: Any) -> Any:
        if not test(value):
            raise Problem(problem, fix)
        return value

    return Rule(check)


def instance(cls: type[Any] | tuple[type[Any], ...], what: str, fix: str) -> Rule[Any]:
    """An instance of ``cls`` (``what`` names it in the message)."""
    return that(lambda v: isinstance(v, cls), f"is not {what}", fix)


def function(what: str) -> Rule[Any]:
    """A callable: ``what`` says what it is called with."""
    return that(callable, "is not callable", f"pass {what}")


def methods(*names: str, fix: str) -> Rule[Any]:
    """An object with the methods ``names`` (a clock, a sleeper, ...)."""
    return that(lambda v: all(callable(getattr(v, n, None)) for n in names),
                f"has no {'() and '.join(names)}() method", fix)


flag = that(lambda v: isinstance(v, bool), "is not True or False", "pass True or False")
"""``True`` or ``False`` (not 0/1, not a string)."""


def text(maximum: int = MAX_TEXT, *, empty: bool = True, fix: str = "pass a string"
         ) -> Rule[str]:
    """A printable text of at most ``maximum`` characters (not blank unless ``empty``)."""

    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise Problem("is not a string", fix)
        if not empty and not value.strip():
            raise Problem("is empty", fix)
        if len(value) > maximum:
            raise Problem(f"is {len(value)} characters long",
                          f"pass a shorter one, of at most {maximum} characters")
        if not value.isprintable():
            # str.isprintable: no NUL, newline, other control or format characters, no lone
            # surrogates: what both backends store and compare alike.
            bad = next(c for c in value if not c.isprintable())
            what = ("a lone surrogate" if "\ud800" <= bad <= "\udfff"
                    else "control characters (NUL, newline, ...)")
            raise Problem(f"contains {what}", "use printable text only")
        return value

    return Rule(check, before=True)


as_id = text(MAX_ID_LENGTH, empty=False, fix="pass a non-empty string such as 'run-1'")
"""An identifier: 1 to 200 printable characters, not only whitespace (the rule of :data:`Id`)."""

as_health_key = text(MAX_HEALTH_KEY_LENGTH, empty=False,
                     fix="pass a key `failover-ledger health` lists: a route id, a profile id "
                         "or provider:<name>")
"""A health key: 1 to 609 printable characters (the rule of :data:`HealthKey`)."""


def _new_id(value: Any) -> str:
    ident: str = as_id(value)
    if ident in (".", ".."):
        # A browser resolves a path segment "." or ".." before it sends a request, so the
        # dashboard's close and settle forms could never reach such a Run or Attempt. Rows an
        # earlier version admitted stay readable: only the id of a new row is refused.
        raise Problem("is a dot segment", "choose an id other than '.' or '..', which URLs "
                      "cannot carry as a path segment")
    return ident


as_new_id = Rule(_new_id, before=True)
"""The id of a row a call creates (a Run, an Attempt): an identifier (:data:`Id`) other than
``.`` and ``..`` (the rule of :data:`NewId`)."""


def _label_key(value: Any) -> str:
    key: str = as_id(value)
    if '"' in key or "\\" in key:
        # SQLite reads a label as json_extract(labels, '$."key"'): a quote or a backslash in
        # the key would end or escape that path, so no total by the label could read it.
        raise Problem("contains a double quote or a backslash",
                      "use a label key without them, e.g. 'team'")
    return key


label_key = Rule(_label_key, before=True)
"""A Run label's key: an identifier (:data:`Id`) without ``"`` or ``\\``, so that the audit can
total and split budgets by it on both databases (the rule of :data:`LabelKey`)."""


def _few_labels(value: Any) -> Any:
    # Counted before the keys and values are checked one by one: a huge map is refused at once.
    if isinstance(value, Mapping) and len(value) > MAX_LABELS:
        raise Problem(f"has {len(value)} labels, over the limit of {MAX_LABELS}",
                      f"pass at most {MAX_LABELS} labels (each Attempt copies them): keep the "
                      "keys the audit totals by, e.g. team or feature")
    return value


def is_id(value: Any) -> bool:
    """Whether ``value`` is an identifier (:data:`Id`)."""
    try:
        as_id(value)
    except Problem:
        return False
    return True


def integers(low: int = 0, high: int = MAX_COUNT, fix: str | None = None) -> Rule[int]:
    """An integer in ``[low, high]``; ``True``/``False`` are not integers here."""
    said = fix or f"pass an integer between {low} and {high}"

    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Problem("is not an integer", said)
        if not low <= value <= high:
            raise Problem("is out of range", said)
        return value

    return Rule(check)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        v = float(value)
    except OverflowError:  # an int beyond a float's range
        return None
    return v if math.isfinite(v) else None


def duration(maximum: float = math.inf, *, positive: bool = False,
             fix: str | None = None) -> Rule[float]:
    """Finite seconds in ``[0, maximum]`` (``(0, maximum]`` with ``positive``), as a float.

    ``fix`` says what to pass instead (default: the range in seconds).
    """
    fix = fix or f"pass a finite number of seconds {'above 0' if positive else 'from 0'}" + (
        f" up to {maximum:g}" if math.isfinite(maximum) else "")

    def check(value: Any) -> float:
        v = _finite(value)
        if v is None or v < 0 or (positive and v == 0) or v > maximum:
            raise Problem("is not a usable duration", fix)
        return v

    return Rule(check)


@rule
def epoch(value: Any) -> float:
    """A time an argument names: finite epoch seconds in ``[0, MAX_TIME)``, as a float."""
    v = _finite(value)
    if v is None or not 0 <= v < MAX_TIME:
        raise Problem("is not a usable time", "pass finite epoch seconds (a float such as "
                      f"clock.now() + 60) between 0 and {MAX_TIME:g}")
    return v


@rule
def money(value: Any) -> Decimal:
    """Money: a finite decimal in ``[0, MAX_AMOUNT]`` from a Decimal, int, float or string."""
    fix = f"pass a decimal amount between 0 and {MAX_AMOUNT} such as Decimal('0.25') or '0.25'"
    if isinstance(value, bool) or not isinstance(value, Decimal | int | float | str):
        raise Problem("is not an amount", fix)
    try:
        d = value if isinstance(value, Decimal) else Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        raise Problem("is not an amount", fix) from None
    if not d.is_finite():
        raise Problem("is not finite", fix)
    if not 0 <= d <= MAX_AMOUNT:
        raise Problem("is out of range", fix)
    return d


def amount_in_range(value: Any) -> bool:
    """Whether a provider-reported cost can be stored (never raises)."""
    try:
        money(value)
    except Problem:
        return False
    return True


def tokens_in_range(value: Any) -> bool:
    """Whether a provider-reported token count can be stored (never raises)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS


E = TypeVar("E", bound=Enum)


def one_of(choices: type[E], among: Iterable[E] | None = None) -> Rule[E]:
    """A member of ``choices`` (or its value), narrowed to ``among``; the message lists them."""
    options = list(among) if among is not None else list(choices)
    by_value = {m.value: m for m in options}
    fix = f"pass one of {', '.join(repr(m.value) for m in options)}"

    def check(value: Any) -> E:
        member = value if isinstance(value, choices) else (
            by_value.get(value) if isinstance(value, str) else None)
        if member is None or member not in options:
            raise Problem("is not one of the choices", fix, choices=list(by_value))
        return member

    return Rule(check)


def listing(each: Callable[[Any], R], what: str, fix: str, maximum: int = 10_000
            ) -> Rule[list[R]]:
    """A list (tuple, set) of at most ``maximum`` items, each ``each``'s; not a lone string."""

    def check(value: Any) -> list[R]:
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple | set | frozenset):
            raise Problem(f"is not a list of {what}", fix)
        if len(value) > maximum:
            raise Problem(f"has {len(value)} items", f"pass at most {maximum}")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(each(v))
            except Problem as p:
                # Where inside the item too: the field names the value at fault
                # (``events[0].data.v``), not only its item.
                raise Problem(p.problem, p.fix, at=f"[{i}]{p.at}") from None
        return out

    return Rule(check)


# -- the types ----------------------------------------------------------------------------------

Id = Annotated[StrictStr, as_id]
"""An identifier: 1 to 200 printable characters, not only whitespace."""
HealthKey = Annotated[StrictStr, as_health_key]
"""A health key: a route or profile id, or ``provider:`` and a provider name, which its row
keeps case-folded and so up to three times as long
(:data:`~ledger.domain.bounds.MAX_HEALTH_KEY_LENGTH`)."""
NewId = Annotated[StrictStr, as_new_id]
"""The id of a Run or Attempt a call creates: an :data:`Id` other than ``.`` and ``..``."""
Text = Annotated[StrictStr, text()]
"""A short printable text (a name, a reason): at most 200 characters."""
Recipient = Annotated[StrictStr, text(
    MAX_RECIPIENT_LENGTH, empty=False,
    fix="pass the recipient's name (a provider such as 'openai', or a forwarding server's URL)")]
"""A data recipient as a grant names it: 1 to 2,048 printable characters (a server's URL fits:
:data:`~ledger.domain.bounds.MAX_RECIPIENT_LENGTH`)."""
LabelKey = Annotated[StrictStr, label_key]
"""A Run label's key (:data:`label_key`)."""
Labels = Annotated[Mapping[LabelKey, Text], Rule(_few_labels, before=True)]
"""A Run's labels: at most 64 (:data:`~ledger.domain.bounds.MAX_LABELS`), key to text."""
_WHY = ("say why, e.g. 'provider confirmed the incident is over' (kept with the action for the "
        "audit)")
Reason = Annotated[StrictStr, text(empty=False, fix=_WHY)]
"""Why an operator acts: a short printable text (at most 200 characters), not blank."""
Evidence = Annotated[StrictStr, text(500, empty=False, fix=_WHY)]
"""The evidence an operator acts on (a console link, a ticket): at most 500 characters, not
blank."""
Count = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]
"""A model's count: an integer in [0, 10^9]; ``True``/``False`` are not counts."""
Tokens = Annotated[int, integers(0, MAX_TOKENS)]
"""A token count: an integer in [0, 10^15]."""
Instant = Annotated[StrictFloat, Field(allow_inf_nan=False)]
"""A finite time in the clock's unit (epoch seconds), as the ledger computes and reads it."""
Time = Annotated[float, epoch]
"""A time an argument names (a deadline, a range's end): finite epoch seconds in [0, 10^11)."""
HttpStatus = Annotated[StrictInt, Field(ge=0, le=999)]
"""An HTTP status: the three digits of a status line, 0 to 999. Every one is kept as evidence
(a hostile server may send 042 or 999); each fits the status column on both backends."""
Money = Annotated[Decimal | int | float | str, money]
"""An amount (:func:`money`); a Decimal once validated."""
Flag = Annotated[bool, flag]
"""``True`` or ``False`` (not 0/1, not a string)."""
IdList = Annotated[Sequence[str], listing(as_id, "ids", "pass a list of ids such as ['r1']")]
"""A list (tuple, set) of at most 10 000 ids; a lone string is refused (not its characters)."""
HealthKeyList = Annotated[Sequence[str], listing(
    as_health_key, "health keys", "pass a list of health keys such as ['provider:openai']")]
"""A list (tuple, set) of at most 10 000 health keys (:data:`HealthKey`)."""
# A dict has a get() too, but not get(profile_id, protocol=...): wrap it instead.
Secrets = Annotated[Any, that(
    lambda v: not isinstance(v, Mapping) and callable(getattr(v, "get", None)),
    "is not a SecretProvider (with get(profile_id, protocol=...))", "pass e.g. "
    "EnvSecretProvider(), or StaticSecretProvider(...) for keys held in memory")]
"""A :class:`~ledger.adapters.SecretProvider` (``get(profile_id, protocol=...)``), not a dict."""


class As:
    """``Annotated[Budget | Mapping[str, Any], As(Budget)]``: validate the value as ``target``.

    The annotation says what a caller may pass (a model or a mapping of its fields); pydantic
    validates it into ``target``, with the paths of the model's own errors.
    """

    def __init__(self, target: Any) -> None:
        self.target = target

    def __get_pydantic_core_schema__(self, _source: Any, handler: Any) -> core_schema.CoreSchema:
        schema: core_schema.CoreSchema = handler.generate_schema(self.target)
        return schema


@contextlib.contextmanager
def _mapped(model: type[BaseModel]) -> Iterator[None]:
    """Raise pydantic's error in ``model``'s data as :class:`InvalidArgument`."""
    try:
        yield
    except ValidationError as e:
        # ``from None``: the pydantic error repeats the input, which may be private envelope
        # content; everything it says is in the InvalidArgument's ``errors``.
        raise _invalid([dict(x) for x in e.errors(include_url=False)], model,
                       model.__name__) from None


class StrictModel(BaseModel):
    """Base of the ledger's public value models.

    Frozen, no unknown fields, and every validation problem an :class:`InvalidArgument` naming
    the field (see the module docstring).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, /, **data: Any) -> None:
        with _mapped(type(self)):
            super().__init__(**data)

    # Not a "custom" __init__ for pydantic: nested models keep being validated in the outer
    # model's single pass, so their errors carry the outer path.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """Validate ``obj`` into this model; problems raise :class:`InvalidArgument`."""
        with _mapped(cls):
            return super().model_validate(obj, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Self:
        """Validate JSON text into this model; problems raise :class:`InvalidArgument`."""
        with _mapped(cls):
            return super().model_validate_json(json_data, **kwargs)

    @classmethod
    def model_validate_strings(cls, obj: Any, **kwargs: Any) -> Self:
        """Validate string data into this model; problems raise :class:`InvalidArgument`."""
        with _mapped(cls):
            return super().model_validate_strings(obj, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        with _mapped(type(self)):
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        with _mapped(type(self)):
            super().__delattr__(name)


# -- calls --------------------------------------------------------------------------------------

_CALLS = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

# pydantic's own deferred build (defer_build=True) is not safe from threads: concurrent first
# calls of one function share its namespace stack, and all but one raised NameError for an
# annotation's name. Each validator is built here instead, once, under this lock; a built one is
# read without it. Reentrant: a build never calls a checked function, but a lock that could
# deadlock its own thread is not worth the saving.
_BUILDING = threading.RLock()


@in_child
def _forked_building() -> None:
    # Held by another thread of the parent, building a validator, when the fork came: the
    # child's first call of that function would wait for it for ever.
    global _BUILDING
    _BUILDING = threading.RLock()


def _build(body: Callable[..., Any]) -> Callable[..., Any]:
    # validate_call reads the calling frame's locals as the lowest-priority namespace of the
    # annotations: this frame's are only ``body``.
    return validate_call(config=_CALLS)(body)


def checked(target: T) -> T:
    """``target`` (a function, or each public method and ``__init__`` of a class) validated.

    The arguments are validated against the annotations by :func:`pydantic.validate_call`
    (built on the first call) and the function receives them as validated (a mapping given for
    a model is the model). A problem is :class:`InvalidArgument` or, for a call that does not
    fit the signature, :class:`ArgumentMismatch`; nothing of the body runs then. A coroutine
    function raises them when awaited.
    """
    if isinstance(target, type):
        for name, member in list(vars(target).items()):
            if name.startswith("_") and name != "__init__":
                continue
            if isinstance(member, classmethod | staticmethod):
                setattr(target, name, type(member)(checked(member.__func__)))
            elif inspect.isfunction(member):
                setattr(target, name, checked(member))
        return target
    fn = cast(Callable[..., Any], target)
    if getattr(fn, "__ledger_checked__", False):
        return target

    def body(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    # pydantic reads the signature (through __wrapped__) and the annotations of the arguments;
    # the return annotation may name what only a type checker imports.
    body.__wrapped__ = fn  # type: ignore[attr-defined]
    body.__module__, body.__name__, body.__qualname__ = fn.__module__, fn.__name__, fn.__qualname__
    body.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k != "return"}
    built: list[Callable[..., Any]] = []

    def first() -> Callable[..., Any]:
        with _BUILDING:
            if not built:
                built.append(_build(body))
        return built[0]

    def refused(e: ValidationError) -> Exception:
        # An error of the validation itself, not one the body raised.
        return _call_error(e, fn, body) if e.title == fn.__qualname__ else e

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def awaited(*args: Any, **kwargs: Any) -> Any:
            try:
                coro = (built[0] if built else first())(*args, **kwargs)
            except ValidationError as e:
                raise refused(e) from None
            return await coro

        wrapper: Any = awaited
    else:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return (built[0] if built else first())(*args, **kwargs)
            except ValidationError as e:
                raise refused(e) from None

    wrapper.__ledger_checked__ = True
    return cast(T, wrapper)


# Errors that say the call does not fit the signature (a keyword of a **kwargs TypedDict is
# ``missing`` or ``extra_forbidden`` at the top level).
_MISFITS = {"unexpected_keyword_argument": 0, "extra_forbidden": 0,
            "unexpected_positional_argument": 1, "multiple_argument_values": 2,
            "missing_argument": 3, "missing_keyword_only_argument": 3,
            "missing_positional_only_argument": 3, "missing": 3}


def _call_error(error: ValidationError, fn: Callable[..., Any], body: Any) -> InvalidArgument:
    """The InvalidArgument (or ArgumentMismatch) of a call of ``fn`` that did not validate."""
    sig = inspect.signature(fn)
    P = inspect.Parameter
    positional = [n for n, p in sig.parameters.items()
                  if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    roots: dict[str, Any] = {}
    for n, tp in get_type_hints(body, include_extras=True).items():
        if get_origin(tp) is Unpack:  # **kwargs: Unpack[SomeTypedDict]: its keys are arguments
            roots.update(get_type_hints(get_args(tp)[0], include_extras=True))
        else:
            roots[n] = tp
    errors: list[dict[str, Any]] = []
    for found in error.errors(include_url=False):
        loc = tuple(found.get("loc", ()))
        if loc and isinstance(loc[0], int) and loc[0] < len(positional):
            loc = (positional[loc[0]], *loc[1:])
        errors.append({**found, "loc": loc})
    misfits = sorted((e for e in errors if _MISFITS.get(e["type"], -1) >= 0
                      and (len(e["loc"]) == 1 or e["type"] not in ("missing", "extra_forbidden"))),
                     key=lambda e: _MISFITS[e["type"]])
    if not misfits:
        return _invalid(errors, roots)
    first, name = misfits[0], fn.__name__
    key = str(first["loc"][0]) if first["loc"] else "args"
    keywords = [n for n, p in sig.parameters.items() if n not in ("self", "cls")
                and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    keywords += [k for k in roots if k not in keywords and k not in sig.parameters]
    kind = first["type"]
    if _MISFITS[kind] == 0:
        close = difflib.get_close_matches(key, keywords, n=1)
        fix = (f"did you mean {close[0]!r}?" if close
               else f"its arguments are {', '.join(keywords) or 'none'}")
        message = f"{name}() has no argument {key!r}; {fix}"
    elif _MISFITS[kind] == 3:
        message = f"{name}() needs the argument {key!r}; pass it"
    elif _MISFITS[kind] == 2:
        message = f"{name}() got the argument {key!r} twice; pass it once"
    else:
        key = "args"
        message = (f"{name}() got too many positional arguments; pass the arguments its "
                   f"signature lists ({', '.join(keywords)})")
    return ArgumentMismatch(message, field=key, function=name)


# -- turning pydantic's errors into InvalidArgument ---------------------------------------------


def _invalid(errors: list[dict[str, Any]], root: Any, name: str = "value") -> InvalidArgument:
    """The InvalidArgument of pydantic ``errors``, read against ``root``.

    ``root`` is a model class, or a call's parameter annotations by name.
    """
    problems: list[tuple[str, str, str]] = []
    fields: dict[str, dict[str, Any]] = {}
    for err in errors:
        path, owner = _path(root, tuple(err.get("loc", ())))
        problem, fix = _describe(err, owner)
        cause = (err.get("ctx") or {}).get("error")
        at = cause.at if isinstance(cause, Problem) else ""
        # A model validator's problem in one of the model's own fields names that field, not
        # the model (the policy sections' validators say which field they refuse).
        path = at[1:] if not path and at.startswith(".") else (path or name) + at
        if path in fields:
            # A union reports one error per member: the first one says enough.
            continue
        fields[path] = cause.fields if isinstance(cause, Problem) else {}
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
    return InvalidArgument(message, field=head_path, errors=shown, **fields[head_path])


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` (or read its :class:`As`), ``Required`` and ``Optional``.

    pydantic adds no path item for any of them.
    """
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            target = next((m.target for m in tp.__metadata__ if isinstance(m, As)), None)
            tp = target if target is not None else get_args(tp)[0]
            continue
        if origin in (Required, NotRequired):
            tp = get_args(tp)[0]
            continue
        if origin in (Union, types.UnionType):
            members = [a for a in get_args(tp) if a is not type(None)]
            if len(members) == 1:
                tp = members[0]
                continue
        return tp


def _path(root: Any, loc: tuple[int | str, ...]) -> tuple[str, type[BaseModel] | None]:
    """The dotted path of ``loc`` in ``root``'s data, and the model that owns the last item.

    Walking the field types tells a field name from a union member's tag (which pydantic puts
    in ``loc`` too, and which is no part of where the value sits).
    """
    out = ""
    tp: Any = root
    owner: type[BaseModel] | None = None
    for item in loc:
        if isinstance(tp, dict):  # a call's parameters
            out, tp = str(item), tp.get(str(item))
            continue
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
    if "input" not in err:
        return ""
    value = err["input"]
    # An object's default repr, cut short, is a module path and an address: its type says more.
    default = getattr(type(value), "__repr__", None) is object.__repr__
    shown = type(value).__name__ if default else _SHORT.repr(value)
    return f" (got {shown})"


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
    if kind == "string_unicode":
        # A str with a lone surrogate (or bytes that are not UTF-8): a string all the same.
        return (f"contains a lone surrogate or is not UTF-8{got}",
                "pass text of whole Unicode characters (no lone surrogates)")
    if kind.startswith("string_"):
        return f"is not a string{got}", "pass a string"
    if kind.startswith("bytes_"):
        return f"is not text{got}", "pass a string or bytes"
    if kind in ("list_type", "tuple_type", "set_type", "frozen_set_type", "iterable_type",
                "sequence_str"):
        return f"is not a list{got}", "pass a list"
    if kind in ("dict_type", "mapping_type"):
        return f"is not a mapping{got}", "pass a mapping (a dict)"
    if kind in ("model_type", "model_attributes_type", "dataclass_type"):
        name = ctx.get("class_name") or (owner.__name__ if owner else "model")
        return f"is not a {name}{got}", f"pass a ledger.{name} or a mapping of its fields"
    if kind == "callable_type":
        return f"is not callable{got}", "pass a function"
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




__all__ = [
    "MAX_TEXT",
    "As",
    "Count",
    "Evidence",
    "Flag",
    "HealthKey",
    "HealthKeyList",
    "HttpStatus",
    "Id",
    "IdList",
    "Instant",
    "LabelKey",
    "Labels",
    "Money",
    "NewId",
    "Problem",
    "Reason",
    "Recipient",
    "Rule",
    "Secrets",
    "StrictModel",
    "Text",
    "Time",
    "Tokens",
    "amount_in_range",
    "as_health_key",
    "as_id",
    "as_new_id",
    "checked",
    "duration",
    "epoch",
    "flag",
    "function",
    "instance",
    "integers",
    "is_id",
    "label_key",
    "listing",
    "methods",
    "money",
    "one_of",
    "rule",
    "text",
    "that",
    "tokens_in_range",
]
