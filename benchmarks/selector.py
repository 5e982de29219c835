"""``python -m benchmarks select``: the selector's cost per decision, in microseconds.

:func:`ledger.decide.select.select` is pure (no clock, no store), so this benchmark needs no
database. It times ``select`` on prepared inputs over many iterations and reports p50, p95 and
mean wall time per call. A realistic envelope (a user question, an earlier model answer as a
``model_derived`` part with recorded provenance, a follow-up question, one tool) is checked by
every candidate's preflight. Cases:

* **deep walk, failover**: a 503 on the first of 10 candidates; every candidate but the last is
  ineligible, each for another reason: the route that just failed, one already tried in this
  turn, a group marked unavailable, a group cooling behind a waiting floor, a cooling route,
  no tool support, a context window too small, a role it is not qualified for, a recipient the
  grant does not approve for model-derived data. The last one is chosen.
* **deep walk, new turn**: the first decision of a turn over 10 candidates, nine ineligible
  (two unavailable groups of different kinds, a cooling and a disabled route, two capability
  misses, a role, an unapproved recipient, a model-derived part whose recorded hash differs).
* **deep walk, failover, 1-part request**: the same walk for the smallest request (one user
  part and a sampling parameter; the capability miss is an unsupported parameter), so the cost
  of preflight over a richer envelope can be told apart from the walk itself.
* **first fit, new turn** and **first fit, failover**: the first candidate considered passes.

Before timing, each case's decision is checked (chosen route and skip reasons), so the
benchmark measures the walk it claims. Target (issue 13): deep walk under 50 us p50.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks import defaults
from benchmarks.common import (
    BenchError,
    Column,
    MachineProbe,
    Progress,
    Report,
    fmt,
    mean,
    percentile,
    quiet,
)
from ledger.decide.classify import classify
from ledger.decide.preflight import Denials
from ledger.decide.select import Decision, RunPermissions, SelectionInput, select
from ledger.domain.envelope import (
    MODEL_DERIVED,
    TOOL_DESCRIPTION,
    USER_INPUT,
    Envelope,
    Part,
    ToolSpec,
)
from ledger.domain.facts import Observation, Phase, WireProtocol
from ledger.domain.values import Capabilities, Grant, GroupMode, GroupProjection, Health, Route
from ledger.policy.load import preset

DEFAULT_ITERATIONS = defaults.SELECT_ITERATIONS
WARMUP = 500
DEEP_TARGET_US = 50.0
NOW = 1_700_000_000.0


@dataclass(frozen=True)
class SelectRow:
    """One case."""

    case: str
    candidates: int
    chosen: str
    skipped: int
    iterations: int
    p50_us: float
    p95_us: float
    mean_us: float
    target_us: float | None

    @property
    def ok(self) -> bool | None:
        """Whether the p50 meets the target, where there is one."""
        return None if self.target_us is None else self.p50_us < self.target_us


COLUMNS = (
    Column("case", lambda r: r.case, left=True),
    Column("candidates", lambda r: str(r.candidates)),
    Column("skipped", lambda r: str(r.skipped)),
    Column("chosen", lambda r: r.chosen, left=True),
    Column("iterations", lambda r: f"{r.iterations:,}"),
    Column("p50 us", lambda r: fmt(r.p50_us, 1)),
    Column("p95 us", lambda r: fmt(r.p95_us, 1)),
    Column("mean us", lambda r: fmt(r.mean_us, 1)),
    Column("", lambda r: "" if r.ok is None else ("ok" if r.ok else f"over {r.target_us:g} us"),
           left=True),
)


@dataclass(frozen=True)
class Case:
    """A prepared selection and the decision it must produce."""

    name: str
    inp: SelectionInput
    chosen: str
    skips: list[tuple[str, str]]  # (route, reason) in order
    target_us: float | None


def _route(i: int, **kw: object) -> Route:
    fields: dict[str, object] = {
        "id": f"r{i}", "provider": f"p{i}", "model": f"m{i}", "group": f"g{i}",
        "recipient": f"rcpt{i}", "protocol": WireProtocol.OPENAI,
        "capabilities": Capabilities(tools=True, context_window=128_000, streaming=True),
    }
    fields.update(kw)
    return Route.model_validate(fields)


ANSWER = Part(role="assistant", content="The filing lists three risks: supply, FX and rates.",
              data_class=MODEL_DERIVED, provenance="att-earlier")


def _envelope(answer: Part = ANSWER) -> Envelope:
    return Envelope(
        parts=[Part(content="Read the Q3 filing and list its main risks."), answer,
               Part(content="Which of those grew since Q2? Cite the pages.")],
        tools=[ToolSpec(name="search", description="full-text search over the filings",
                        parameters={"type": "object",
                                    "properties": {"q": {"type": "string"}}})],
        max_output_tokens=512,
    )


def _grant(plan: Sequence[Route], narrow: set[str],
           narrow_classes: Sequence[str] = (USER_INPUT, TOOL_DESCRIPTION)) -> Grant:
    """Every recipient approved for every class the cases send, except ``narrow`` ones."""
    wide = [USER_INPUT, MODEL_DERIVED, TOOL_DESCRIPTION]
    return Grant(recipients={r.recipient: (list(narrow_classes) if r.recipient in narrow
                                           else wide) for r in plan})


def cases() -> list[Case]:
    """The benchmark's cases, each with the decision it must produce."""
    policy = preset("failure-domain")
    env = _envelope()
    provenance = {"att-earlier": {ANSWER.content_hash}}
    fact = classify(Observation(status=503, protocol=WireProtocol.OPENAI, provider="p0",
                                phase=Phase.AFTER_HEADERS, body='{"error": {"message": "busy"}}'),
                    policy, now=NOW)
    fresh = NOW - 1.0

    def deep_failover(name: str, request: Envelope, no_tool: Capabilities,
                      narrow: list[str]) -> Case:
        # 0 failed, 1..8 each ineligible for another reason, 9 chosen.
        plan = [
            _route(0), _route(1), _route(2), _route(3), _route(4),
            _route(5, capabilities=no_tool),
            _route(6, capabilities=Capabilities(context_window=2)),
            _route(7, roles=["reviewer"]),
            _route(8), _route(9),
        ]
        return Case(
            name, SelectionInput(
                plan=plan, permissions=RunPermissions(retries_left=5, calls_left=10,
                                                      tried=frozenset({"r1"})),
                policy=policy, now=NOW, request=request, role="research",
                grant=_grant(plan, {"rcpt8"}, narrow),
                groups={"g2": GroupProjection(group="g2", mode=GroupMode.UNAVAILABLE,
                                              sampled_at=fresh),
                        "g3": GroupProjection(group="g3", mode=GroupMode.COOLDOWN,
                                              until=NOW + 30, sampled_at=fresh)},
                health={"r4": Health(key="r4", cooldown_until=NOW + 60, error_count=1)},
                current="r0", failure=fact, provenance=provenance),
            "r9", [("r0", "already_tried"), ("r1", "already_tried"),
                   ("r2", "same_group_unavailable"), ("r3", "same_group_unavailable"),
                   ("r4", "route_cooldown"), ("r5", "capability"), ("r6", "capability"),
                   ("r7", "not_qualified"), ("r8", "disclosure")], DEEP_TARGET_US)

    deep_case = deep_failover("deep walk, failover", env, Capabilities(tools=False),
                              [USER_INPUT, TOOL_DESCRIPTION])
    # The same walk for the smallest request: one user part and a sampling parameter.
    small = Envelope(parts=[Part(content="List the filing's main risks.")],
                     params={"temperature": 0.2})
    small_case = deep_failover("deep walk, failover, 1-part request", small,
                               Capabilities(parameters=["top_p"]), [TOOL_DESCRIPTION])

    # -- new-turn deep walk: 0..8 ineligible, 9 chosen.
    turn_plan = [
        _route(0), _route(1), _route(2), _route(3),
        _route(4, capabilities=Capabilities(tools=False)),
        _route(5, capabilities=Capabilities(context_window=2)),
        _route(6, roles=["reviewer"]), _route(7), _route(8), _route(9),
    ]
    turn_case = Case(
        "deep walk, new turn", SelectionInput(
            plan=turn_plan, permissions=RunPermissions(retries_left=5, calls_left=10),
            policy=policy, now=NOW, request=env, role="research",
            grant=_grant(turn_plan, {"rcpt7"}),
            groups={"g0": GroupProjection(group="g0", mode=GroupMode.UNAVAILABLE,
                                          sampled_at=fresh),
                    "g1": GroupProjection(group="g1", mode=GroupMode.COOLDOWN, until=NOW + 30,
                                          sampled_at=fresh)},
            health={"r2": Health(key="r2", cooldown_until=NOW + 60, error_count=1),
                    "r3": Health(key="r3", disabled_until=NOW + 3600, disabled_reason="auth")},
            # Route 8's recipient is approved by the frozen grant but revoked right now.
            denials=Denials(recipients=frozenset({"rcpt8"})), provenance=provenance),
        "r9", [("r0", "same_group_unavailable"), ("r1", "same_group_unavailable"),
               ("r2", "route_cooldown"), ("r3", "route_cooldown"), ("r4", "capability"),
               ("r5", "capability"), ("r6", "not_qualified"), ("r7", "disclosure"),
               ("r8", "disclosure")], DEEP_TARGET_US)

    # -- first fits.
    fit = [_route(i) for i in range(10)]
    fit_turn = Case(
        "first fit, new turn", SelectionInput(
            plan=fit, permissions=RunPermissions(retries_left=5, calls_left=10), policy=policy,
            now=NOW, request=env, role="research", grant=_grant(fit, set()),
            provenance=provenance),
        "r0", [], None)
    fit_fail = Case(
        "first fit, failover", SelectionInput(
            plan=fit, permissions=RunPermissions(retries_left=5, calls_left=10), policy=policy,
            now=NOW, request=env, role="research", grant=_grant(fit, set()), current="r0",
            failure=fact, provenance=provenance),
        "r1", [("r0", "already_tried")], None)
    return [deep_case, small_case, turn_case, fit_turn, fit_fail]


def _verify(case: Case, d: Decision) -> None:
    got = [(sk.route, sk.reason.value) for sk in d.skipped]
    if d.route_id != case.chosen or got != case.skips:
        raise BenchError(f"select case {case.name!r} chose {d.route_id!r} skipping {got}; "
                         f"the case expects {case.chosen!r} skipping {case.skips}")


def time_case(case: Case, iterations: int, warmup: int = WARMUP,
              clock: Callable[[], int] = time.perf_counter_ns) -> SelectRow:
    """Check the case's decision, then time ``iterations`` calls of ``select``."""
    d = select(case.inp)
    _verify(case, d)
    inp = case.inp
    for _ in range(warmup):
        select(inp)
    gc.collect()  # start every case from the same heap state; collection stays enabled
    times = []
    for _ in range(iterations):
        t0 = clock()
        select(inp)
        times.append((clock() - t0) / 1000)
    return SelectRow(case=case.name, candidates=len(inp.plan), chosen=case.chosen,
                     skipped=len(d.skipped), iterations=iterations,
                     p50_us=round(percentile(times, 0.5), 2),
                     p95_us=round(percentile(times, 0.95), 2), mean_us=round(mean(times), 2),
                     target_us=case.target_us)


def run(*, iterations: int = DEFAULT_ITERATIONS, progress: Progress = quiet) -> Report:
    """The whole ``select`` benchmark (pure: no database)."""
    if iterations < 1:
        raise BenchError("need iterations >= 1")
    probe = MachineProbe()
    report = Report(
        bench="select", columns=COLUMNS,
        targets={"deep walk": f"p50 < {DEEP_TARGET_US:g} us at 10 candidates (issue 13: 72 us "
                              "before, first fit 23 us)"},
        notes=["wall time per select() call on prepared inputs (the input is built once; a "
               "driver also builds it per decision); garbage collection left on",
               "no database: the selector is pure, so this bench has no --db or --postgres"],
    )
    for case in cases():
        progress(f"bench select: {case.name}")
        report.rows.append(time_case(case, iterations))
    report.machine = probe.done()
    return report


__all__ = ["DEEP_TARGET_US", "DEFAULT_ITERATIONS", "Case", "SelectRow", "cases", "run",
           "time_case"]
