"""The policy model: a declarative file validated into typed, frozen models.

Every number a preset uses is a field here, not a constant in code; the engine reads the three
presets (``policies/*.yaml``) through these fields alone, so a preset is data, not a branch.
Validators refuse degenerate configuration with a :class:`PolicyValueError` that carries the
fix, which :mod:`ledger.policy.load` turns into a :class:`ledger.errors.PolicyError`.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    Strict,
    StrictBool,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from ledger.domain.facts import Category, Phase, Scope, Transport
from ledger.domain.media import MAX_BINARY_BYTES
from ledger.domain.validation import Problem, StrictModel, instance
from ledger.domain.values import ProfileType

# Scalars are strict: a quoted "yes" or "60" in a policy file is a mistake to point out, not a
# value to guess at (a whole number still passes for a float).
Number = Annotated[float, Strict()]
# Durations are seconds; infinities and NaN would make every comparison against them lie.
Seconds = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
PositiveSeconds = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
Pattern = Annotated[str, Field(min_length=1)]


def _whole(v: object) -> object:
    """An integer-valued float (``2.0``) as the integer; anything else unchanged.

    JSON has one number type and JSON Schema's ``integer`` accepts ``2.0``; ``2.5``, a bool and
    text are left to the field to refuse.
    """
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


# A whole number, strictly: no bool, no text; ``2.0`` is 2, as JSON Schema reads it.
WholeNumber = Annotated[int, BeforeValidator(_whole), Strict()]
_NON_EMPTY: JsonDict = {"minItems": 1}
# The loader refuses a blank name (and a blank role or provider): "not only whitespace".
_NOT_BLANK = r"\S"


#: Categories only the caller reports (``Observation.cancelled``, ``over_token_budget``): the
#: request stops on them, whatever a rule says, so no rule about a route's failures may name them.
CALLER_CATEGORIES: tuple[Category, ...] = (Category.CANCELLED, Category.BUDGET_EXCEEDED)


class PolicyValueError(Problem):
    """A refused value: what is wrong, how to fix it, and optionally the sub-field it concerns.

    Raised inside validators; the loader reads ``problem``, ``fix`` and ``field`` back out of
    pydantic's error context so the user sees the exact path and the fix. A :class:`Problem`,
    so a model built in code (``Policy(...)``) names the same path and fix in its
    :class:`~ledger.errors.InvalidArgument`.
    """

    def __init__(self, problem: str, fix: str, field: str | None = None) -> None:
        at = "" if not field else field if field.startswith("[") else f".{field}"
        super().__init__(problem, fix, at=at)
        self.field = field


#: The validation context under which a Run's frozen policy is read back: the rules added to
#: the loader after a Run was admitted are not applied to it (invariant 5: the policy a Run
#: was admitted with is the one it is read and decided by, whatever the loader refuses since).
FROZEN = {"frozen": True}


def _admitting(info: ValidationInfo) -> bool:
    """Whether a rule added since Runs were first admitted applies: not to a frozen read."""
    return not (isinstance(info.context, dict) and info.context.get("frozen"))


def _why(category: Category) -> str:
    """Why a caller's own fact is the caller's."""
    return ("the caller cancelled the call" if category is Category.CANCELLED
            else "the request is over the Run's token budget")


def _not_a_caller_fact(category: Category, info: ValidationInfo) -> Category:
    if category in CALLER_CATEGORIES and _admitting(info):
        # The retry owner obeys its rules: a cancelled call would be retried, a request over its
        # token budget served by a backup, against what the caller asked for.
        raise PolicyValueError(
            f"{category.value!r} is the caller's own fact ({_why(category)}), not a route's "
            "failure: the request stops on it and never retries, moves on, cools or disables a "
            "key",
            f"remove {category.value!r} from this list",
        )
    return category


class _Excluded:
    """The schema of a category that may be any but ``categories``."""

    def __init__(self, categories: Iterable[Category]) -> None:
        self.categories = tuple(categories)

    def __get_pydantic_json_schema__(self, schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        out = handler(schema)
        out["not"] = {"enum": [c.value for c in self.categories]}
        return out


#: The schema of a rule's category: any but :data:`CALLER_CATEGORIES`.
_CallerFactsExcluded = _Excluded(CALLER_CATEGORIES)

#: The ledger's own facts: a transport kind only this process reports, and the category the
#: classifier always gives it, before reading any table (``cannot_build``: no secret, no usable
#: endpoint, a body that cannot be encoded; nothing was sent).
LEDGER_FACTS: Mapping[Transport, Category] = MappingProxyType(
    {Transport.CANNOT_BUILD: Category.UNUSABLE})
#: Categories only :data:`LEDGER_FACTS` establish: no provider's response is one.
LEDGER_CATEGORIES: tuple[Category, ...] = tuple(dict.fromkeys(LEDGER_FACTS.values()))

#: A category a move rule (moves_on) may name.
RuleCategory = Annotated[Category, AfterValidator(_not_a_caller_fact), _CallerFactsExcluded]


def _not_a_route_rule_fact(category: Category, info: ValidationInfo) -> Category:
    _not_a_caller_fact(category, info)
    if category in LEDGER_CATEGORIES and _admitting(info):
        # The turn never retries a route it could not build, and settling never cools or
        # disables one (nothing reached the route): a rule naming it would load and never act.
        raise PolicyValueError(
            f"{category.value!r} is the ledger's own fact (this process could not build the "
            "request, transport cannot_build): such a route is skipped and never retried, "
            "cooled or disabled, so this rule would never act on it",
            f"remove {category.value!r} from this list",
        )
    return category


#: A category a rule about the route itself (same_route_retry, cooldown, disables) may name:
#: neither the caller's own fact nor the ledger's.
RouteRuleCategory = Annotated[Category, AfterValidator(_not_a_route_rule_fact),
                              _Excluded(CALLER_CATEGORIES + LEDGER_CATEGORIES)]


def _classified_as_caller_fact(category: Category, info: ValidationInfo,
                               field: str | None = None) -> Category:
    if category in CALLER_CATEGORIES and _admitting(info):
        # The classifier decides the caller's facts from the caller's own report first; a
        # provider's response classified as one would stop the request as if the caller had
        # cancelled it (or run out of budget), against every rule.
        raise PolicyValueError(
            f"{category.value!r} is the caller's own fact ({_why(category)}): no provider "
            "response or transport failure is one, and the request would stop as if it were",
            "classify it as a route's failure (e.g. server_error or unknown), or remove it",
            field=field,
        )
    return category


def _classified_as_ledger_fact(category: Category, info: ValidationInfo,
                               field: str | None = None) -> Category:
    if category in LEDGER_CATEGORIES and _admitting(info):
        # The classifier gives `unusable` a route, skipped whatever moves_on says and with its
        # health untouched: a provider's answer classified so would bypass both.
        raise PolicyValueError(
            f"{category.value!r} is the ledger's own fact (this process could not build the "
            "request, transport cannot_build): no provider response or other transport failure "
            "is one, and classified as one it would skip the route whatever moves_on says, "
            "and never cool or disable it",
            "classify it as the failure it is (e.g. auth, format or unknown), or remove the "
            "entry",
            field=field,
        )
    return category


def _classified(category: Category, info: ValidationInfo, field: str | None = None) -> Category:
    _classified_as_caller_fact(category, info, field)
    return _classified_as_ledger_fact(category, info, field)


def _not_a_provider_fact(category: Category, info: ValidationInfo) -> Category:
    return _classified(category, info)


def _not_a_caller_fact_classified(category: Category, info: ValidationInfo) -> Category:
    return _classified_as_caller_fact(category, info)


#: The schema of a classified category: neither the caller's nor the ledger's own fact.
_ClassifiedExcluded = _Excluded(CALLER_CATEGORIES + LEDGER_CATEGORIES)

#: A category the classification maps a provider's response or a transport failure onto.
ClassifiedCategory = Annotated[Category, AfterValidator(_not_a_provider_fact),
                               _ClassifiedExcluded]
class _LedgerFactsKept:
    """The schema of ``classification.transports``: only a ledger's own kind may say its fact.

    Every other kind may be any category a provider's failure may be; ``cannot_build`` any but
    the caller's (the classifier reads it as ``unusable`` before the table).
    """

    def __get_pydantic_json_schema__(self, schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        out = handler(schema)
        value = out["additionalProperties"]
        out["properties"] = {t.value: dict(value) for t in LEDGER_FACTS}
        out["additionalProperties"] = {
            **value, "not": {"enum": [c.value for c in CALLER_CATEGORIES + LEDGER_CATEGORIES]}}
        return out


#: A ``classification.transports`` value: the ledger's own facts are checked per entry, since
#: the table may say what :data:`LEDGER_FACTS` says (every preset lists ``cannot_build``).
_TransportCategory = Annotated[Category, AfterValidator(_not_a_caller_fact_classified),
                               _CallerFactsExcluded]


class _EachOnce:
    """A list setting whose entries are each listed once, refused at load otherwise.

    Every list of a policy that names things (roles, providers, categories, phases, transport
    kinds, statuses, patterns, profile types) means a set with, at most, an order: a second
    entry for one thing changes nothing, or (``type_order``) silently moves the first one, and
    in either case stands where another was likely meant. ``case`` says how text entries are
    compared where they are used (case-insensitively): two spellings are then one entry.
    ``delays_s`` is a sequence, not a set, and does not use it.
    """

    def __init__(self, what: str, case: str | None = None) -> None:
        self.what = what
        self.case = case

    def __get_pydantic_core_schema__(self, source: Any,
                                     handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.with_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        out = handler(schema)
        # Exact repeats only: a schema cannot say "case-insensitively"; loading does.
        out["uniqueItems"] = True
        return out

    def _check(self, values: list[Any], info: ValidationInfo) -> list[Any]:
        if not _admitting(info):
            return values
        seen: dict[object, int] = {}
        for i, value in enumerate(values):
            key = value.casefold() if self.case and isinstance(value, str) else value
            first = seen.setdefault(key, i)
            if first == i:
                continue
            earlier = values[first]
            shown = str(value) if isinstance(value, int) else repr(str(value))
            if earlier == value:
                problem = f"the {self.what} {shown} is listed twice (at [{first}] and [{i}])"
            else:
                problem = (f"{str(earlier)!r} (at [{first}]) and {shown} are one {self.what}: "
                           f"{self.case}")
            raise PolicyValueError(
                problem, f"list each {self.what} once: remove [{i}], or correct it to the "
                "one that was meant", field=f"[{i}]")
        return values


_CATEGORIES = _EachOnce("category")
_TRANSPORTS = _EachOnce("transport kind")
_PATTERNS = _EachOnce("pattern", "patterns are matched case-insensitively")
_NAME = Annotated[str, Field(json_schema_extra={"pattern": _NOT_BLANK})]


# Seed 003 section 8's roles that are "outside the scope of automatically broadening this
# failover strategy", with the forms a host is likely to name them by.
SEED_EXCLUDED_ROLES: tuple[str, ...] = (
    "evaluation", "evaluations", "eval", "evals", "evaluator", "fixed_model_evaluation",
    "reviewer", "reviewers", "review", "independent_reviewer",
    "diagnostic", "diagnostics", "diagnosis",
    "scheduled", "scheduled_task", "scheduled_tasks", "schedule", "scheduler",
    "compaction", "compactions", "compact", "context_compaction", "compactor",
)


def _one_key_each(v: Mapping[str, Any], info: ValidationInfo, what: str) -> None:
    """Refuse two keys of ``v`` that differ only in case.

    Where it is used, a ``what`` (a code, a provider) is compared case-insensitively, and the
    first key that matches is taken, so the entry of the other spelling would silently never
    apply. A frozen read keeps what it was admitted with (the decision then takes the entry
    it took before).
    """
    if not _admitting(info):
        return
    seen: dict[str, str] = {}
    for key in v:
        first = seen.setdefault(key.casefold(), key)
        if first != key:
            raise PolicyValueError(
                f"{first!r} and {key!r} are the same {what} ({what}s are compared "
                "case-insensitively), so one of the two entries would never apply",
                f"keep one entry for {key!r}",
                field=key,
            )


def _no_blank_keys(v: Mapping[str, Any], info: ValidationInfo, what: str) -> None:
    """Refuse a blank key of ``v``: matched against real names, its entry applies to nothing."""
    for key in v:
        if not key.strip() and _admitting(info):
            raise PolicyValueError(f"the {what} name {key!r} is blank, so its entry matches "
                                   "nothing", "remove the entry, or write the name", field=key)


def _no_blanks(v: list[str], info: ValidationInfo, what: str) -> list[str]:
    for i, name in enumerate(v):
        if not name.strip() and _admitting(info):
            # Matched against real names: a blank one excludes or exempts nothing.
            raise PolicyValueError(f"the {what} name {name!r} is blank, so it matches nothing",
                                   "remove it, or write the name", field=f"[{i}]")
    return v


# defer_build: a model's validator is built when it first validates a policy, so a process
# that only names the Policy type (a reporting command, ``import ledger``) never builds them.
# StrictModel: a policy built in code fails as every public model does, with InvalidArgument;
# the loader validates files and mappings past it, to report PolicyError with its own paths.
class _Section(StrictModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    @model_validator(mode="before")
    @classmethod
    def _no_sets(cls, data: object) -> object:
        return _without_sets(data)


def _without_sets(data: object) -> object:
    """``data``, refused if a field (or a mapping field's value) holds a set.

    A list validated from a set follows its iteration order, which PYTHONHASHSEED picks: the
    same policy, built in code, would hash differently in each process, and a Run resumed by
    another process would be refused for a policy it was admitted with.
    """
    if not isinstance(data, Mapping):
        return data
    for name, value in data.items():
        inner = value.items() if isinstance(value, Mapping) else [(None, value)]
        for key, v in inner:
            if isinstance(v, AbstractSet):
                raise PolicyValueError(
                    "a set has no order, so the policy's hash would differ from one process "
                    "to the next",
                    "pass a list [a, b] (sorted, if the order means nothing)",
                    field=str(name) if key is None else f"{name}.{key}",
                )
    return data


# --------------------------------------------------------------------------- failover


class FailoverPolicy(_Section):
    """The master switch and the rules about when a request may move to another route."""

    enabled: StrictBool = True
    # Roles that never fail over, compared case-insensitively. Seed 003's words ("independent
    # reviewers, fixed-model evaluations, diagnostic invocations, scheduled tasks, and context
    # compaction") and their common forms.
    excluded_roles: Annotated[
        list[_NAME], _EachOnce("role", "roles are compared case-insensitively")] = Field(
        default_factory=lambda: list(SEED_EXCLUDED_ROLES))
    # "stop": effective output rules out another route; "discard": discard it, tell the caller,
    # move on (goclaw). A started tool always stops.
    after_effective_output: Literal["stop", "discard"] = "stop"
    # Whether a request whose execution is unknown (timeout after send) may be sent again as a
    # new Attempt (goclaw and fased do, the default never does).
    resubmit_unknown_execution: StrictBool = False
    last_candidate_always_tried: StrictBool = False
    new_turn: Literal["first_entry", "keep_current"] = "keep_current"
    group_aware: StrictBool = True
    group_fact_max_age_s: Seconds = 30.0
    # When admission rejects, before dispatch, the Attempt that would continue after a failure:
    # "reselect" chooses again (another group may admit it); "stop" ends the turn with reason
    # `rejected_before_dispatch`, the original failure kept as its cause (seed 003: "Rejected
    # before dispatch -> Return to original recovery").
    after_rejection: Literal["reselect", "stop"] = "reselect"
    # When every candidate of a turn is cooling (route or profile health, a group's waiting
    # floor), wait for the earliest reopening within ``admission.max_capacity_wait_s`` and the
    # Run's deadline, then try it (recorded as a probe), instead of stopping with no attempt;
    # also after a failure. Without it only a new turn waits, and only for group floors.
    wait_for_reopening: StrictBool = False

    @field_validator("excluded_roles")
    @classmethod
    def _roles_named(cls, v: list[str], info: ValidationInfo) -> list[str]:
        return _no_blanks(v, info, "role")

    @model_validator(mode="after")
    def _group_facts_can_be_fresh(self, info: ValidationInfo) -> FailoverPolicy:
        if self.group_aware and self.group_fact_max_age_s == 0 and _admitting(info):
            # A fact is always read some time after it was sampled: at a zero age limit every
            # one is stale, so group_aware would silently eliminate nothing.
            raise PolicyValueError(
                "group_fact_max_age_s is 0 while group_aware is true: every capacity-group "
                "fact would be stale when read, so no group evidence would ever count",
                "set a positive age (e.g. 30), or group_aware: false to ignore group evidence",
                field="group_fact_max_age_s",
            )
        return self


#: A status a rule names (range checked by _http_statuses, shown by the schema).
HttpStatus = Annotated[WholeNumber, Field(json_schema_extra={"minimum": 100, "maximum": 599})]


def _http_statuses(codes: Iterable[int]) -> None:
    for code in codes:
        if not 100 <= code <= 599:
            raise PolicyValueError(
                f"{code} is not an HTTP status",
                "use status codes between 100 and 599",
            )


class MoveRule(_Section):
    """A failure that makes the request eligible for another route.

    It matches a failure of one of ``categories`` in one of ``phases`` (``None``: any phase)
    and, when ``transports`` is given, only one observed as one of those transport kinds: a
    connection refused is ``network`` like a connection reset, but only the refusal provably
    carried nothing of the request. When ``statuses`` is given, only a failure that came with
    one of those HTTP statuses matches: a 504 is ``server_error`` like a 500, but it says a
    gateway timed out, which a policy may move on like a timeout (fased).
    """

    categories: Annotated[list[RuleCategory], _CATEGORIES] = Field(json_schema_extra=_NON_EMPTY)
    # None = any phase
    phases: Annotated[list[Phase], _EachOnce("phase")] | None = Field(
        default=None, json_schema_extra=_NON_EMPTY)
    # None = whatever the transport kind (or none)
    transports: Annotated[list[Transport], _TRANSPORTS] | None = Field(
        default=None, json_schema_extra=_NON_EMPTY)
    # None = whatever the HTTP status (or none)
    statuses: Annotated[list[HttpStatus], _EachOnce("status")] | None = Field(
        default=None, json_schema_extra=_NON_EMPTY)
    scope: Scope = Scope.ROUTE

    @field_validator("categories")
    @classmethod
    def _some_categories(cls, v: list[RuleCategory]) -> list[RuleCategory]:
        if not v:
            raise PolicyValueError(
                "a move rule with no categories matches nothing",
                "list at least one category, or delete the rule",
            )
        return v

    @field_validator("phases")
    @classmethod
    def _some_phases(cls, v: list[Phase] | None) -> list[Phase] | None:
        if v is not None and not v:
            raise PolicyValueError(
                "an empty phase list matches no failure",
                "list the phases, or leave `phases` out to match every phase",
            )
        return v

    @field_validator("transports")
    @classmethod
    def _some_transports(cls, v: list[Transport] | None) -> list[Transport] | None:
        if v is not None and not v:
            raise PolicyValueError(
                "an empty transport list matches no failure",
                "list the transport kinds, or leave `transports` out to match any",
            )
        return v

    @field_validator("statuses")
    @classmethod
    def _some_statuses(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if v is not None and not v:
            raise PolicyValueError(
                "an empty status list matches no failure",
                "list the HTTP statuses, or leave `statuses` out to match any",
            )
        if v is not None and _admitting(info):
            _http_statuses(v)
        return v


# --------------------------------------------------------------------------- same-route retry


class RetryRule(_Section):
    """Same-route retries before moving on.

    ``delays_s[i]`` is the nominal wait before retry ``i + 1``; the wait is drawn uniformly from
    ``delay * (1 +- jitter)``. A Retry-After hint longer than the nominal wait replaces it exactly
    when ``honor_retry_after``; a hint above ``retry_after_cap_s`` then means no retry at all.
    Without ``honor_retry_after`` hints are not read, so a cap is refused there.
    """

    categories: Annotated[list[RouteRuleCategory], _CATEGORIES] = Field(default_factory=list)
    transports: Annotated[list[Transport], _TRANSPORTS] = Field(default_factory=list)
    max: WholeNumber = Field(default=0, ge=0)
    delays_s: list[Seconds] = Field(default_factory=list)
    # Bounds checked by _jitter_range (its message says what jitter means); shown here.
    jitter: Number = Field(default=0.0, allow_inf_nan=False,
                           json_schema_extra={"minimum": 0, "exclusiveMaximum": 1})
    honor_retry_after: StrictBool = False
    retry_after_cap_s: Seconds | None = None

    @field_validator("jitter")
    @classmethod
    def _jitter_range(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:
            raise PolicyValueError(
                f"jitter must be in [0, 1) (got {v})",
                "use a fraction such as 0.2 for +-20%; 0 disables jitter",
            )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RetryRule:
        if not self.categories and not self.transports:
            raise PolicyValueError(
                "the rule matches no failure",
                "list `categories` and/or `transports` it applies to",
                field="categories",
            )
        if self.max > len(self.delays_s):
            raise PolicyValueError(
                f"max is {self.max} but only {len(self.delays_s)} delay(s) are given",
                f"give one delay per retry in `delays_s` ({self.max} values), or lower `max`",
                field="max",
            )
        return self

    @model_validator(mode="after")
    def _cap_reads_hints(self, info: ValidationInfo) -> RetryRule:
        # A cap given without honor_retry_after would never refuse a retry: hints are read only
        # to be honored (decide.retry), so the file would promise what the ledger never does.
        # The default (null) says nothing, and a Run frozen with such a rule keeps deciding as
        # it did.
        if (self.retry_after_cap_s is not None and not self.honor_retry_after
                and _admitting(info)):
            raise PolicyValueError(
                f"retry_after_cap_s ({self.retry_after_cap_s:g}) is set but honor_retry_after is "
                "false: the rule does not read Retry-After hints at all, so a longer hint would "
                "be retried anyway and the cap would never apply",
                "set honor_retry_after: true to wait hints out up to the cap (a longer one "
                "means no retry), or remove retry_after_cap_s",
                field="retry_after_cap_s",
            )
        return self


# --------------------------------------------------------------------------- classification

CodeField = Literal["openai.code", "openai.type", "anthropic.error_code", "anthropic.type",
                    "gemini.reason", "gemini.status"]


# Gemini's reasons for withholding an answer for its content, read as ``gemini.status``.
_GEMINI_CONTENT_REFUSALS = ("SAFETY", "BLOCKLIST", "PROHIBITED_CONTENT", "IMAGE_SAFETY",
                           "RECITATION", "SPII", "IMAGE_PROHIBITED_CONTENT", "IMAGE_RECITATION")
# Gemini's other reasons for an answer with nothing in it, read the same way: the model botched
# a function call or the answer (a bad answer, as a malformed event is ``format``), or it does
# not serve the request's language (this request does not fit this model). ``OTHER``,
# ``NO_IMAGE`` and the rest stay unmapped: Gemini names no reason, so they are ``unknown``.
_GEMINI_EMPTY_ANSWERS = dict.fromkeys(
    ("MALFORMED_FUNCTION_CALL", "UNEXPECTED_TOOL_CALL", "TOO_MANY_TOOL_CALLS",
     "MALFORMED_RESPONSE", "LANGUAGE"), Category.FORMAT)


class ProviderCodes(_Section):
    """Maps from a provider's structured error field to a category (compared case-insensitively).

    OpenAI-compatible bodies carry ``error.code`` and ``error.type``; Anthropic ``error.type``
    and sometimes ``error.details.error_code`` (``anthropic_error_code``: a spend limit is a
    ``rate_limit_error`` whose detail says ``enforced_spend_limit_reached``); Gemini
    ``error.status`` and, in ``error.details``, a ``google.rpc.ErrorInfo`` whose ``reason``
    (``gemini_reason``) refines it (a bad key is ``INVALID_ARGUMENT`` with reason
    ``API_KEY_INVALID``). A detail is looked up before the field it refines. For protocol
    ``generic`` every field is tried in this order. A Gemini 2xx answer that withheld itself
    carries no error object: its ``promptFeedback.blockReason``, else its first candidate's
    ``finishReason`` (``SAFETY``, ``RECITATION``, ``PROHIBITED_CONTENT``, ...), is read as
    ``gemini.status`` instead; the defaults and every preset map those reasons to
    ``content_policy``, and a candidate that ends empty with ``MALFORMED_FUNCTION_CALL`` or
    another botched call or answer (a bad answer) or ``LANGUAGE`` (a language the model does
    not serve) to ``format``; ``OTHER`` and the rest are unmapped (``unknown``). A Gemini 403
    ``PERMISSION_DENIED`` whose ``ErrorInfo`` reason is ``BILLING_DISABLED`` (the project's
    billing is off) is ``billing``, as Anthropic's spend limit and OpenAI's
    ``insufficient_quota`` are, not ``auth``. A table left out is empty: a
    Run frozen before the detail tables existed reads back deciding as it did.
    """

    openai_code: dict[str, ClassifiedCategory] = Field(default_factory=dict)
    openai_type: dict[str, ClassifiedCategory] = Field(default_factory=dict)
    anthropic_error_code: dict[str, ClassifiedCategory] = Field(default_factory=dict)
    anthropic_type: dict[str, ClassifiedCategory] = Field(default_factory=dict)
    gemini_reason: dict[str, ClassifiedCategory] = Field(default_factory=dict)
    gemini_status: dict[str, ClassifiedCategory] = Field(default_factory=dict)

    @field_validator("openai_code", "openai_type", "anthropic_error_code", "anthropic_type",
                     "gemini_reason", "gemini_status")
    @classmethod
    def _one_entry_per_code(cls, v: dict[str, Category],
                            info: ValidationInfo) -> dict[str, Category]:
        # The classifier compares codes case-insensitively and takes the first entry that
        # matches: a second spelling of one code would be silently ignored.
        _one_key_each(v, info, "code")
        return v


class OverflowRule(_Section):
    """A structured signal of context overflow, optionally narrowed by the error message."""

    field: CodeField
    equals: Pattern
    message_starts_with: Pattern | None = None
    message_contains: Pattern | None = None


class TextRule(_Section):
    """Free-text patterns (case-insensitive substrings) over the body and message."""

    category: ClassifiedCategory
    patterns: Annotated[list[Pattern], _PATTERNS] = Field(json_schema_extra=_NON_EMPTY)

    @field_validator("patterns")
    @classmethod
    def _some_patterns(cls, v: list[str]) -> list[str]:
        if not v:
            raise PolicyValueError(
                "a text rule with no patterns matches nothing",
                "list at least one pattern, or delete the rule",
            )
        return v


class StatusTextRule(_Section):
    """A status whose text says otherwise: e.g. goclaw's 429 that says 'overloaded'."""

    statuses: Annotated[list[HttpStatus], _EachOnce("status")] = Field(
        json_schema_extra=_NON_EMPTY)
    patterns: Annotated[list[Pattern], _PATTERNS] = Field(json_schema_extra=_NON_EMPTY)
    category: ClassifiedCategory

    @field_validator("statuses")
    @classmethod
    def _status_range(cls, v: list[int], info: ValidationInfo) -> list[int]:
        if _admitting(info):
            _http_statuses(v)
        return v

    @model_validator(mode="after")
    def _non_empty(self) -> StatusTextRule:
        for name in ("statuses", "patterns"):
            if not getattr(self, name):
                raise PolicyValueError(
                    f"`{name}` is empty, so the rule never applies",
                    f"list at least one value in `{name}`, or delete the rule",
                    field=name,
                )
        return self


def _default_transports() -> dict[Transport, Category]:
    return {
        Transport.DNS_FAILURE: Category.DNS,
        Transport.CONNECT_REFUSED: Category.NETWORK,
        Transport.CONNECTION_RESET: Category.NETWORK,
        Transport.STREAM_CUT: Category.NETWORK,
        Transport.PROTOCOL_ERROR: Category.NETWORK,
        Transport.CONNECT_TIMEOUT: Category.TIMEOUT,
        Transport.READ_TIMEOUT: Category.TIMEOUT,
        Transport.STREAM_STALL: Category.TIMEOUT,
        Transport.FIRST_TOKEN_TIMEOUT: Category.TIMEOUT,
        Transport.TOTAL_TIMEOUT: Category.TIMEOUT,
        Transport.TLS_ERROR: Category.TLS,
        Transport.MALFORMED_EVENT: Category.FORMAT,
        Transport.CANNOT_BUILD: Category.UNUSABLE,
    }


def _default_overflow() -> list[OverflowRule]:
    return [
        OverflowRule(field="openai.code", equals="context_length_exceeded"),
        OverflowRule(
            field="anthropic.type",
            equals="invalid_request_error",
            message_starts_with="prompt is too long",
        ),
        OverflowRule(
            field="gemini.status",
            equals="INVALID_ARGUMENT",
            message_contains="exceeds the maximum number of tokens",
        ),
    ]


def _default_codes() -> ProviderCodes:
    c = Category
    return ProviderCodes(
        openai_code={
            "insufficient_quota": c.BILLING,
            "rate_limit_exceeded": c.RATE_LIMIT,
            "model_not_found": c.MODEL_NOT_FOUND,
            "invalid_api_key": c.AUTH,
            "overloaded": c.OVERLOADED,
            "content_policy_violation": c.CONTENT_POLICY,
            "content_filter": c.CONTENT_POLICY,
            # A Responses `response.failed` or `error` event's code: the 500 of a 200 answer.
            "server_error": c.SERVER_ERROR,
        },
        anthropic_error_code={"enforced_spend_limit_reached": c.BILLING},
        anthropic_type={
            "overloaded_error": c.OVERLOADED,
            "rate_limit_error": c.RATE_LIMIT,
            "authentication_error": c.AUTH,
            "permission_error": c.AUTH,
            "not_found_error": c.MODEL_NOT_FOUND,
            "api_error": c.SERVER_ERROR,
        },
        gemini_reason={"API_KEY_INVALID": c.AUTH, "BILLING_DISABLED": c.BILLING},
        gemini_status={
            "UNAVAILABLE": c.OVERLOADED,
            "RESOURCE_EXHAUSTED": c.RATE_LIMIT,
            "UNAUTHENTICATED": c.AUTH,
            "PERMISSION_DENIED": c.AUTH,
            "NOT_FOUND": c.MODEL_NOT_FOUND,
            "DEADLINE_EXCEEDED": c.TIMEOUT,
            "INTERNAL": c.SERVER_ERROR,
            # Reasons of a 2xx answer withheld for its content (see ProviderCodes).
            **dict.fromkeys(_GEMINI_CONTENT_REFUSALS, c.CONTENT_POLICY),
            **_GEMINI_EMPTY_ANSWERS,
        },
    )


def _default_status() -> dict[int, Category]:
    c = Category
    return {
        400: c.FORMAT,
        401: c.AUTH,
        402: c.BILLING,
        403: c.AUTH,
        404: c.MODEL_NOT_FOUND,
        408: c.TIMEOUT,
        429: c.RATE_LIMIT,
        500: c.SERVER_ERROR,
        502: c.SERVER_ERROR,
        503: c.OVERLOADED,
        504: c.SERVER_ERROR,
        529: c.OVERLOADED,
    }


class ClassificationPolicy(_Section):
    """How an observation becomes a category, in the fixed precedence of the conformance rules.

    Caller facts, local 429s, transport kinds, context overflow, structured provider codes, HTTP
    status, then free text. Leaving ``text`` and ``context_overflow_text`` empty keeps the
    classifier on structured facts only (the failure-domain default).
    """

    transports: Annotated[dict[Transport, _TransportCategory], _LedgerFactsKept()] = Field(
        default_factory=_default_transports)
    context_overflow: list[OverflowRule] = Field(default_factory=_default_overflow)
    context_overflow_text: Annotated[list[Pattern], _PATTERNS] = Field(default_factory=list)
    codes: ProviderCodes = Field(default_factory=_default_codes)
    # Values checked by _status_range, to name the status as classification.status.499.
    status: dict[int, Annotated[Category, _ClassifiedExcluded]] = Field(
        default_factory=_default_status,
        json_schema_extra={"propertyNames": {"pattern": "^[1-5][0-9][0-9]$"}})
    # Unlisted 4xx / 5xx statuses; null leaves them to the text rules, then `unknown`.
    status_4xx: ClassifiedCategory | None = Category.FORMAT
    status_5xx: ClassifiedCategory | None = Category.SERVER_ERROR
    status_text: list[StatusTextRule] = Field(default_factory=list)
    # Whether `status_text` decides before `codes`: a status whose text says otherwise also
    # overrides the coarse structured code its body carries (goclaw: a 429 rate_limit_error
    # that says "overloaded" is an overload).
    status_text_first: bool = False
    text: list[TextRule] = Field(default_factory=list)
    # Hints beyond this are clamped, and so is every wait or group cooldown derived from one: a
    # Retry-After dated in year 9999 carries no more information than an hour-long one, and one
    # response must not close a capacity group for a day.
    retry_after_limit_s: PositiveSeconds = 3_600.0
    # Only this much of a body is parsed or scanned; error bodies are small, hostile ones are not.
    body_limit_bytes: WholeNumber = Field(default=262_144, ge=1)
    message_limit_chars: WholeNumber = Field(default=300, ge=16)

    @field_validator("status")
    @classmethod
    def _status_range(cls, v: dict[int, Category], info: ValidationInfo) -> dict[int, Category]:
        _http_statuses(v)
        for code, category in v.items():
            _classified(category, info, field=str(code))
        return v

    @field_validator("transports")
    @classmethod
    def _ledger_facts_kept(cls, v: dict[Transport, Category],
                           info: ValidationInfo) -> dict[Transport, Category]:
        for transport, category in v.items():
            if LEDGER_FACTS.get(transport) is not category:
                _classified_as_ledger_fact(category, info, field=transport.value)
        return v

    def transport_category(self, transport: Transport) -> Category | None:
        """The category the classifier gives a failure observed as ``transport``.

        ``None`` when the table leaves it to the later steps. A caller's facts and a local 429
        come first, whatever the transport kind; a rule about a route's failures names neither.
        """
        return LEDGER_FACTS.get(transport) or self.transports.get(transport)

    @field_validator("status", mode="wrap")
    @classmethod
    def _one_entry_per_status(cls, v: object, handler: ValidatorFunctionWrapHandler,
                              info: ValidationInfo) -> dict[int, Category]:
        out: dict[int, Category] = handler(v)
        if isinstance(v, Mapping) and len(out) < len(v) and _admitting(info):
            # "503" and 503 (or "503.0") are one status: the dict kept whichever came last.
            seen: dict[int, object] = {}
            for key, category in v.items():
                [code] = handler({key: category})
                if code in seen:
                    raise PolicyValueError(
                        f"{seen[code]!r} and {key!r} are the same status {code}, so one of the "
                        "two entries would be dropped",
                        f"keep one entry for {code}",
                        field=str(code),
                    )
                seen[code] = key
        return out


# --------------------------------------------------------------------------- health


class CooldownCurve(_Section):
    """``min(base_s * factor ** min(n - 1, max_exponent), cap_s)`` for the n-th counted failure."""

    base_s: PositiveSeconds = 60.0
    factor: Number = Field(default=5.0, ge=1.0, le=1000.0, allow_inf_nan=False)
    max_exponent: WholeNumber = Field(default=3, ge=0, le=64)
    cap_s: PositiveSeconds = 3_600.0

    @model_validator(mode="after")
    def _cap_not_below_base(self) -> CooldownCurve:
        if self.cap_s < self.base_s:
            raise PolicyValueError(
                f"cap_s ({self.cap_s}) is below base_s ({self.base_s}), so the curve never grows",
                "raise cap_s to at least base_s",
                field="cap_s",
            )
        return self


class DisableRule(_Section):
    """A failure that disables a key for long (fased billing): ``base * factor ** (k - 1)``.

    ``k`` counts this rule's failures since the last reset; ``base_s_by_provider`` overrides the
    base for named providers, matched case-insensitively (two keys that differ only in case
    name one provider, and are refused).
    """

    categories: Annotated[list[RouteRuleCategory], _CATEGORIES] = Field(
        json_schema_extra=_NON_EMPTY)
    base_s: PositiveSeconds = 18_000.0
    factor: Number = Field(default=2.0, ge=1.0, le=1000.0, allow_inf_nan=False)
    cap_s: PositiveSeconds = 86_400.0
    base_s_by_provider: dict[str, PositiveSeconds] = Field(default_factory=dict)

    @field_validator("categories")
    @classmethod
    def _some_categories(cls, v: list[Category]) -> list[Category]:
        if not v:
            raise PolicyValueError(
                "a disable rule with no categories disables nothing",
                "list the categories (e.g. [billing]), or delete the rule",
            )
        return v

    @field_validator("base_s_by_provider")
    @classmethod
    def _one_base_per_provider(cls, v: dict[str, float],
                               info: ValidationInfo) -> dict[str, float]:
        _no_blank_keys(v, info, "provider")
        _one_key_each(v, info, "provider")
        return v

    @model_validator(mode="after")
    def _bases_within_cap(self, info: ValidationInfo) -> DisableRule:
        if not _admitting(info):
            return self
        # The cap would silently win: a base above it never applies, however it was meant.
        if self.cap_s < self.base_s:
            raise PolicyValueError(
                f"cap_s ({self.cap_s:g}) is below base_s ({self.base_s:g}), so even the first "
                "disable would be cut to the cap",
                "raise cap_s to at least base_s, or lower base_s",
                field="cap_s",
            )
        for provider, base in self.base_s_by_provider.items():
            if base > self.cap_s:
                raise PolicyValueError(
                    f"base_s_by_provider[{provider!r}] ({base:g}) is above cap_s "
                    f"({self.cap_s:g}), so it would be cut to the cap",
                    f"lower it to at most cap_s ({self.cap_s:g}), or raise cap_s",
                    field=f"base_s_by_provider.{provider}",
                )
        return self


class HealthPolicy(_Section):
    """Per-key health: which failures cool or disable a route (or profile), and when it resets."""

    # "route": one row per route id; "profile": per credential profile where the route has
    # profiles, else per route; "provider": every route of one provider shares one row, keyed
    # ``provider:<name>`` (GoClaw's cooldowns and usage stats belong to the provider).
    key: Literal["route", "profile", "provider"] = "route"
    cooldown_categories: Annotated[list[RouteRuleCategory], _CATEGORIES] = Field(
        default_factory=lambda: [
            Category.OVERLOADED,
            Category.SERVER_ERROR,
            Category.MODEL_NOT_FOUND,
        ]
    )
    cooldown: CooldownCurve = Field(default_factory=CooldownCurve)
    disables: list[DisableRule] = Field(default_factory=list)
    # Counters reset before counting a failure this long after the previous one (null: never).
    failure_window_s: PositiveSeconds | None = 600.0
    reset_on_success: StrictBool = True
    # Counters reset before counting a failure once every cooldown/disable window has expired.
    reset_on_expiry: StrictBool = True
    # Routers that spread load over many upstreams: their keys are never cooled nor disabled.
    exempt_providers: Annotated[
        list[_NAME], _EachOnce("provider", "providers are compared case-insensitively")] = (
        Field(default_factory=list))
    # Record each key's last successful use. Profile rotation orders by it (fased); where no
    # decision reads it, leaving it off lets a success on a healthy key write nothing, so the
    # settles of many workers on one route do not queue on its health row.
    track_last_used: StrictBool = True
    # ``last_used`` is rewritten by a success only once it is this old: a healthy key then costs
    # one health write per interval, not one per call (0: every success records it exactly).
    last_used_interval_s: Seconds = 0.0
    # One failed call is not an outage: a key cools only once this many failures that would
    # cool it fell within ``cooldown_window_s`` (1: the first one cools it, as GoClaw and Fased
    # do). The failures before that are remembered (``Health.recent_failures``), not counted.
    # Bounds checked by _threshold and _window (their messages say why); shown here.
    cooldown_after: WholeNumber = Field(default=1, json_schema_extra={"minimum": 1})
    cooldown_window_s: Number | None = Field(default=None, json_schema_extra={"minimum": 1})
    # Whether each failed try of a same-route retry counts again. False: a route's failure is
    # counted once per request; a retry's failure restarts its window from the last try but does
    # not step the cooldown up (GoClaw: "when every try fails, the request fails, or moves on,
    # with the error it failed with before").
    count_same_route_retries: StrictBool = False
    # Whether a failure of a request that was already in flight when the key's outage was
    # counted steps the cooldown again. True (GoClaw and Fased: every failure counts): N workers
    # caught by one outage step the curve N times. False: such a failure restarts the running
    # window with the count it has; only a request begun after the counting failure
    # (Health.counted_at, which a restart leaves) steps it. Its success likewise is evidence from
    # before the outage: it leaves the key cooling (only a success of a request begun after the
    # counting failure clears it).
    count_overlapping_failures: StrictBool = True

    @field_validator("exempt_providers")
    @classmethod
    def _providers_named(cls, v: list[str], info: ValidationInfo) -> list[str]:
        return _no_blanks(v, info, "provider")

    @field_validator("cooldown_after", mode="before")
    @classmethod
    def _threshold(cls, v: object) -> object:
        v = _whole(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PolicyValueError(
                f"cooldown_after must be a whole number of failures of at least 1 (got {v!r}); "
                "a threshold of 0 would cool a key that never failed",
                "use 1 to cool on the first failure, or e.g. 3 with cooldown_window_s: 60",
            )
        return v

    @field_validator("cooldown_window_s", mode="before")
    @classmethod
    def _window(cls, v: object) -> object:
        if v is None:
            return v
        if (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
                or v < 1):
            raise PolicyValueError(
                f"cooldown_window_s must be a finite number of seconds of at least 1 (got {v!r})",
                "use e.g. 60; failures of one burst a second apart are one outage, not three",
            )
        return v

    @model_validator(mode="after")
    def _threshold_has_window(self) -> HealthPolicy:
        if self.cooldown_after > 1 and self.cooldown_window_s is None:
            raise PolicyValueError(
                f"cooldown_after is {self.cooldown_after} but no cooldown_window_s says within "
                "how long those failures must fall",
                "add cooldown_window_s (e.g. 60), or set cooldown_after: 1",
                field="cooldown_window_s",
            )
        return self

    @model_validator(mode="after")
    def _disjoint(self) -> HealthPolicy:
        # A failure's effect is read from the first disable rule that lists its category, and
        # only without one from cooldown_categories (decide.health.cooldown_effect): a second
        # listing is never read, whatever it says.
        cools = set(self.cooldown_categories)
        first_rule: dict[Category, int] = {}
        for i, rule in enumerate(self.disables):
            for category in rule.categories:
                name = category.value
                if category in cools:
                    raise PolicyValueError(
                        f"{name!r} is in cooldown_categories and in disables[{i}]: the disable "
                        "rule applies, so a failure of it disables the key and never cools it",
                        f"remove {name!r} from cooldown_categories to disable on it, or from "
                        "this rule to cool on it",
                        field=f"disables[{i}].categories",
                    )
                first = first_rule.setdefault(category, i)
                if first != i:
                    raise PolicyValueError(
                        f"{name!r} is listed by disables[{first}] already, and the first rule "
                        "that lists it applies: this one never does for it",
                        f"remove {name!r} here, or merge the two rules",
                        field=f"disables[{i}].categories",
                    )
        return self


# --------------------------------------------------------------------------- the rest


class ProbePolicy(_Section):
    """Probing a cooling primary to learn that it is back (goclaw)."""

    enabled: StrictBool = False
    interval_s: Seconds = 30.0
    margin_s: Seconds = 120.0
    ttl_s: PositiveSeconds = 86_400.0
    max_keys: WholeNumber = Field(default=256, ge=1)

    @model_validator(mode="after")
    def _probes_spaced(self, info: ValidationInfo) -> ProbePolicy:
        # Unused while probing is off, so 0 is left alone there.
        if self.enabled and self.interval_s == 0 and _admitting(info):
            # Every request to a cooling key would be its probe: the cooldown would hold
            # nothing back.
            raise PolicyValueError(
                "interval_s is 0 while probing is enabled: every request to a cooling key "
                "would be a probe, which defeats its cooldown",
                "set a positive interval (e.g. 30), or probe.enabled: false",
                field="interval_s",
            )
        return self

    @model_validator(mode="after")
    def _interval_within_ttl(self) -> ProbePolicy:
        if self.interval_s > self.ttl_s:
            # A probe time forgotten (TTL) while still inside its interval would let the
            # selector offer a probe the cluster-wide claim keeps refusing.
            raise PolicyValueError(
                f"interval_s ({self.interval_s:g}) exceeds ttl_s ({self.ttl_s:g}): probe state "
                "would be forgotten while it still throttles",
                "make ttl_s at least interval_s",
                field="interval_s",
            )
        return self


class ProfilePolicy(_Section):
    """Credential-profile rotation inside a route before model fallback (fased).

    ``auth_order`` is ``{provider: [profile ids]}``: an explicit order that also restricts a
    route to the listed profiles. Its provider keys are matched case-insensitively against a
    route's provider, as ``health.exempt_providers`` and a disable rule's
    ``base_s_by_provider`` are (two keys that differ only in case name one provider, and are
    refused).
    """

    rotate_before_model: StrictBool = False
    type_order: Annotated[list[ProfileType], _EachOnce("profile type")] = Field(
        default_factory=lambda: [ProfileType.OAUTH, ProfileType.TOKEN, ProfileType.API_KEY]
    )
    auth_order: dict[str, Annotated[list[str], Field(
        json_schema_extra={"minItems": 1, "uniqueItems": True})]] = Field(default_factory=dict)
    # A new turn keeps the profile the Run used last while it is usable, as if the caller had
    # passed ``pin="auto"`` (Fased's session stickiness); a recorded compaction drops it.
    sticky: StrictBool = False
    # Which failures mark a credential profile tried for the rest of the turn, so no other
    # route uses it: "any_failure", or only a "credential_failure" (one that cools or disables
    # the profile). Fased rotates on timeouts and format errors without marking the credential.
    mark_tried: Literal["any_failure", "credential_failure"] = "any_failure"

    @field_validator("auth_order")
    @classmethod
    def _orders_list_profiles(cls, v: dict[str, list[str]],
                              info: ValidationInfo) -> dict[str, list[str]]:
        # Providers are matched case-insensitively, as everywhere in a policy.
        _no_blank_keys(v, info, "provider")
        _one_key_each(v, info, "provider")
        for provider, ids in v.items():
            if not ids:
                raise PolicyValueError(
                    f"auth_order[{provider!r}] is empty: every route of {provider!r} would be "
                    "left without a credential",
                    f"list the profile ids of {provider!r} to use, in order, or remove the entry "
                    "to use them all", field=provider)
            twice = sorted({i for i in ids if ids.count(i) > 1})
            if twice:
                raise PolicyValueError(
                    f"auth_order[{provider!r}] names {', '.join(map(repr, twice))} more than once",
                    "name each profile once, in the order to try them", field=provider)
        return v


class AdmissionPolicy(_Section):
    """Capacity-group admission facts written by settle."""

    trust_provider_429: StrictBool = True
    default_group_cooldown_s: Seconds = 30.0
    max_capacity_wait_s: Seconds = 30.0


class StreamingPolicy(_Section):
    """Time limits adapters enforce so that no call is unbounded in time.

    ``read_timeout_s`` bounds the wait for the status line and each socket read of a whole
    body; a stream's body is held to ``first_token_timeout_s``, counted from the request's last
    byte written (an upload is not the model's silence), until its first content (a model may
    think silently; the first event of a tool the provider runs itself counts as content) and
    to ``idle_timeout_s`` for every gap after it, whatever the read limit; ``total_timeout_s``
    bounds the whole call.
    """

    connect_timeout_s: PositiveSeconds = 10.0
    read_timeout_s: PositiveSeconds = 120.0
    first_token_timeout_s: PositiveSeconds = 60.0
    idle_timeout_s: PositiveSeconds = 60.0
    total_timeout_s: PositiveSeconds = 600.0

    @model_validator(mode="after")
    def _total_holds_the_first_token(self, info: ValidationInfo) -> StreamingPolicy:
        if self.total_timeout_s < self.first_token_timeout_s and _admitting(info):
            # The total limit would always end a silent stream first: the first-token limit
            # (and its transport kind, first_token_timeout) could never apply.
            raise PolicyValueError(
                f"total_timeout_s ({self.total_timeout_s:g}) is below first_token_timeout_s "
                f"({self.first_token_timeout_s:g}), so the first-token limit never applies",
                "raise total_timeout_s to at least first_token_timeout_s, or lower "
                "first_token_timeout_s",
                field="total_timeout_s",
            )
        return self

    @model_validator(mode="after")
    def _total_holds_every_limit(self, info: ValidationInfo) -> StreamingPolicy:
        if not _admitting(info):
            return self
        for name, what in (("connect_timeout_s", "connect"), ("read_timeout_s", "read"),
                           ("idle_timeout_s", "idle")):
            limit = getattr(self, name)
            if limit > self.total_timeout_s:
                # The total limit always ends the call first: this one (and its transport kind)
                # could never apply, though the file says it does.
                raise PolicyValueError(
                    f"{name} ({limit:g}) is above total_timeout_s ({self.total_timeout_s:g}), "
                    f"so the {what} limit never applies",
                    f"lower {name} to at most total_timeout_s, or raise total_timeout_s",
                    field=name,
                )
        return self


class EnvelopePolicy(_Section):
    """Bounds on the images and documents a request carries, checked before anything is recorded.

    A turn whose envelope holds a binary part larger than ``max_part_bytes``, or binary parts
    together larger than ``max_envelope_bytes``, is refused with
    :class:`~ledger.errors.InvalidArgument` naming the part, before any Attempt is begun.
    Counted are the bytes the ledger holds (``data=`` and ``data:`` URLs); an ``https://`` link
    is fetched by the provider and weighs nothing here. These are raw bytes; the wire carries
    them as base64, 4/3 larger, so a part at the default 20 MiB is a body of about 26.7 MiB and
    an envelope at the default 32 MiB about 42.7 MiB: above Anthropic's 32 MB per request and
    Gemini's 20 MB inline, within OpenAI's 50 MB. The defaults do not guarantee a provider
    accepts the request; for a provider's own limit, set a bound of about 3/4 of it.
    """

    # Bounds checked by _byte_count (its message says the alternative); shown here.
    max_part_bytes: WholeNumber = Field(
        default=20 * 1024 * 1024, json_schema_extra={"minimum": 1, "maximum": MAX_BINARY_BYTES})
    max_envelope_bytes: WholeNumber = Field(
        default=32 * 1024 * 1024, json_schema_extra={"minimum": 1, "maximum": MAX_BINARY_BYTES})

    @field_validator("max_part_bytes", "max_envelope_bytes", mode="before")
    @classmethod
    def _byte_count(cls, v: object) -> object:
        v = _whole(v)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_BINARY_BYTES:
            raise PolicyValueError(
                f"a byte limit must be a whole number of bytes from 1 to {MAX_BINARY_BYTES} "
                f"(got {v!r}); 0 would refuse every image and document",
                "use e.g. 20971520 (20 MiB); to refuse binary parts on a route, declare "
                "Capabilities(image_input=False, pdf_input=False) instead",
            )
        return v

    @model_validator(mode="after")
    def _part_fits(self) -> EnvelopePolicy:
        if self.max_part_bytes > self.max_envelope_bytes:
            raise PolicyValueError(
                f"max_part_bytes ({self.max_part_bytes}) exceeds max_envelope_bytes "
                f"({self.max_envelope_bytes}): no envelope could hold such a part",
                "raise max_envelope_bytes to at least max_part_bytes, or lower max_part_bytes",
                field="max_part_bytes",
            )
        return self


class Policy(StrictModel):
    """A whole policy (one preset file)."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    name: str = Field(min_length=1, json_schema_extra={"pattern": _NOT_BLANK})
    description: str = ""
    failover: FailoverPolicy = Field(default_factory=FailoverPolicy)
    classification: ClassificationPolicy = Field(default_factory=ClassificationPolicy)
    # Empty by default; left out while failover is enabled, refused (_failover_can_move_on).
    moves_on: list[MoveRule] = Field(default_factory=list, json_schema_extra={"default": []})
    same_route_retry: list[RetryRule] = Field(default_factory=list)
    health: HealthPolicy = Field(default_factory=HealthPolicy)
    probe: ProbePolicy = Field(default_factory=ProbePolicy)
    profiles: ProfilePolicy = Field(default_factory=ProfilePolicy)
    admission: AdmissionPolicy = Field(default_factory=AdmissionPolicy)
    streaming: StreamingPolicy = Field(default_factory=StreamingPolicy)
    envelope: EnvelopePolicy = Field(default_factory=EnvelopePolicy)

    @model_validator(mode="after")
    def _every_retry_rule_reachable(self, info: ValidationInfo) -> Policy:
        if not _admitting(info):
            return self
        # The first rule that lists a failure's category (or transport kind) applies: a later
        # rule's entry for it is never read, whatever its max and delays say.
        seen: dict[str, int] = {}
        for i, rule in enumerate(self.same_route_retry):
            for name, values in (("categories", rule.categories),
                                 ("transports", rule.transports)):
                for value in values:
                    first = seen.setdefault(f"{name}:{value.value}", i)
                    if first != i:
                        raise PolicyValueError(
                            f"{value.value!r} is listed by same_route_retry[{first}] already, "
                            "and the first rule that lists it applies: this one never does "
                            "for it",
                            f"remove {value.value!r} here, or merge the two rules",
                            field=f"same_route_retry[{i}].{name}",
                        )
        # A rule is matched on the failure's category before its transport kind (decide.retry),
        # and a failure observed as a transport kind is classified by the table first: an
        # earlier rule listing that category takes every such failure.
        by_category: dict[Category, int] = {}
        for i, rule in enumerate(self.same_route_retry):
            for transport in rule.transports:
                category = self.classification.transport_category(transport)
                if category is not None and category in by_category:
                    taker = by_category[category]
                    raise PolicyValueError(
                        f"{transport.value!r} is classified {category.value!r} "
                        f"(classification.transports), which same_route_retry[{taker}] lists "
                        "already: the first rule that lists a failure's category or transport "
                        f"kind applies, so same_route_retry[{i}] never does for a "
                        f"{transport.value} failure",
                        f"put the transport rule first (move same_route_retry[{i}] above "
                        f"same_route_retry[{taker}]), or remove {transport.value!r} here",
                        field=f"same_route_retry[{i}].transports",
                    )
            for category in rule.categories:
                by_category.setdefault(category, i)
        return self

    @model_validator(mode="after")
    def _failover_can_move_on(self, info: ValidationInfo) -> Policy:
        if (self.failover.enabled and not self.moves_on and "moves_on" not in self.model_fields_set
                and _admitting(info)):
            # Only a moves_on rule makes a provider's failure eligible for another route: left
            # out, an enabled failover would silently stop on every failure a provider answers.
            # Said explicitly (moves_on: []), it is a choice: a request stays on its route once
            # sent, and a route that cannot be built is still skipped (classify), which
            # failover.enabled: false does not do.
            raise PolicyValueError(
                "failover.enabled is true but moves_on is left out, and it defaults to no rule: "
                "no failure a provider answers would ever be eligible for another route (only "
                "a route that cannot be built is skipped)",
                "add a moves_on rule, e.g. `moves_on: [{categories: [rate_limit, overloaded, "
                "server_error, timeout, network], scope: route}]`; or write `moves_on: []` to "
                "keep each request on its route once sent while still skipping routes that "
                "cannot be built; or set failover.enabled: false to stop on every failure",
                field="moves_on",
            )
        return self

    @field_validator("name")
    @classmethod
    def _named(cls, v: str, info: ValidationInfo) -> str:
        if not v.strip() and _admitting(info):
            # Snapshots and `policy check` name a Run's policy by it; blanks name nothing.
            raise PolicyValueError(
                f"the name {v!r} is blank",
                "name the policy, e.g. after the preset it started from (my-goclaw)",
            )
        return _shown_as_written(v, "name", info)

    @field_validator("description")
    @classmethod
    def _described(cls, v: str, info: ValidationInfo) -> str:
        return _shown_as_written(v, "description", info, lines=True)


# Unicode categories a terminal or a page does not print as themselves: controls (Cc), format
# characters (Cf: the bidi overrides, zero-width spaces), line and paragraph separators (Zl,
# Zp) and lone surrogates (Cs). Spaces (Zs: U+00A0, U+202F, U+3000 of French, Japanese or
# Chinese text) print as spaces; private-use and unassigned code points as glyphs or boxes.
_NOT_SHOWN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def _shown_as_written(v: str, name: str, info: ValidationInfo, *, lines: bool = False) -> str:
    """``v`` unless it holds a character that is not printed as itself.

    A terminal escape, a bidi override or a zero-width character: ``policy check``, ``policy
    show`` and the dashboard print the policy's name and description, where such a character
    would rewrite what an operator reads. ``lines``: line breaks and tabs are text there.
    """
    bad = next((i for i, c in enumerate(v)
                if unicodedata.category(c) in _NOT_SHOWN and not (lines and c in "\n\t")),
               None)
    if bad is not None and _admitting(info):
        raise PolicyValueError(
            f"the {name} holds U+{ord(v[bad]):04X} at position {bad}, a character that is not "
            "printed as itself (a control, format, bidi or line separator character)",
            f"write the {name} in printable characters" + (
                " (line breaks and tabs may stay)" if lines else ""),
        )
    return v


PolicyArg = Annotated[Policy, instance(
    Policy, "a ledger.Policy",
    "pass a ledger.Policy, e.g. preset('goclaw') or the Run's ledger.run_policy(run_id)")]
"""A function's policy argument: a :class:`Policy` itself (a name or a path goes to
``load_policy`` first)."""


__all__ = [
    "SEED_EXCLUDED_ROLES",
    "AdmissionPolicy",
    "ClassificationPolicy",
    "CooldownCurve",
    "DisableRule",
    "EnvelopePolicy",
    "FailoverPolicy",
    "HealthPolicy",
    "MoveRule",
    "OverflowRule",
    "Policy",
    "PolicyArg",
    "PolicyValueError",
    "ProbePolicy",
    "ProfilePolicy",
    "ProviderCodes",
    "RetryRule",
    "StatusTextRule",
    "StreamingPolicy",
    "TextRule",
]
