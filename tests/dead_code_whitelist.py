"""Names used only from outside the library's own code, which vulture cannot see used.

Read by vulture (``[tool.vulture]`` in pyproject.toml, and ``tests/test_dead_code.py``), never
imported. Each line marks one name as used and says who uses it. Keep it short: a name whose
only reason is "a test calls it" does not belong here unless it is documented public API.
"""
# ruff: noqa: B018  (each line is an expression naming a use; that is the file's whole point)

from vulture.whitelist_utils import Whitelist

_ = Whitelist()

# -- hooks Python itself calls ----------------------------------------------------------------
_.__getattr__  # ledger/__init__.py: PEP 562, the lazy package root
_.__dir__  # ledger/__init__.py: PEP 562, dir(ledger) lists the lazy names
_.__wrapped__  # facade.py: inspect.signature follows it to the sync method's signature
_.is_disconnect  # storage/engine.py: read by SQLAlchemy's handle_error hook
_.__signature__  # api/calls.py: inspect.signature reads a bound operation's signature there
_.__call__  # api/calls.py: an op or query read on its class is callable as an unbound method is
#            (Ledger.get_run(led, ...)), so inspect.signature and help() read its __signature__
_.derive  # errors.py: ExceptionGroup.derive, called by except* when it splits the group
# forking.py: module state renewed in a forked child, registered with @in_child and called
# through os.register_at_fork
_._forked_executors, _._forked_own, _._forked_mine, _._forked_registry, _._forked_channels
_._forked_tls, _._forked_building, _._forked_lock, _._forked_memory_lock
_._forked_registry_lock, _._forked_install_lock

# -- hooks of the libraries we build on -------------------------------------------------------
_.__pydantic_base_init__  # domain/validation.py: pydantic reads it off a model's __init__
_.maxstring, _.maxother, _.maxlist, _.maxdict  # reprlib.Repr limits, read by reprlib
_.maxset, _.maxtuple, _.maxlevel  # (policy/load.py sets these too)
_._negative_number_matcher  # cli/recover_cmd.py: argparse reads it to tell -1,2 from an option
_.inherit_cache  # storage/statements.py: SQLAlchemy reads it to cache our constructs' SQL
_.comparison_options  # storage/migrate.py: migrations/env.py configures Alembic with it
_.parent_names, _.compare_to  # its include_name / include_object hooks' parameters (Alembic's)
# integrations/pydantic_ai.py: the pydantic-ai Model / StreamedResponse interface
_.unsupported_settings  # read by pydantic-ai to warn about settings the model ignores
_.request_stream  # Model.request_stream, called by the agent for a streamed request
_.run_context  # its parameter, passed by pydantic-ai
_._get_event_iterator  # StreamedResponse's event source, iterated by pydantic-ai
_.close_stream  # StreamedResponse.close_stream, called when the agent stops early
_.provider_url  # StreamedResponse.provider_url, read by pydantic-ai
_.failed_attempts  # ModelResponse.failed_attempts (docs/integrations/pydantic-ai.md)
_.collect  # dashboard/metrics.py: prometheus-client's registry calls a Collector's collect
_.prepare_threshold  # storage/pgpool.py: psycopg reads it off a connection
_.set_cookie, _.extract_cookies, _.cookie  # adapters/transport.py: httpx's Cookies call _NoCookies'
# integrations/langchain.py: LangChain's BaseChatModel and AgentMiddleware interface
_._llm_type, _._identifying_params  # read by LangChain for tracing and caching keys
_.bind_tools, _._agenerate  # called by create_agent and by ainvoke
_._astream  # called by astream (and by an agent streaming its model node)
_.wrap_model_call, _.awrap_model_call  # called by create_agent's model node
_.is_retryable  # ModelError.is_retryable, read by ModelRetryMiddleware
_.temperature, _.top_p  # LedgerChatModel fields, read by name into each request
# integrations/openai_agents.py: the Agents SDK's Model / ModelProvider interface
_.get_response, _.stream_response, _.get_model  # called by the SDK's runner
_.get_retry_advice  # called by the SDK's runner after a failed model call
_.tracing  # Model.get_response's parameter, passed by the runner (the ledger has its own)

# -- fields of public records, read by their users --------------------------------------------
_.provider_code  # FailureFact.provider_code: the provider's error code, kept as evidence
_.from_route, _.to_route, _.stored_mode  # ops/audit.py records (docs/audit.md)
_.first_at, _.last_attempt  # ops/audit.py UnusableRoute (docs/audit.md)
_.ended  # RunSession.ended: the status the block finished the Run with (docs/quickstart.md)
_.SESSION_EXPIRED  # Category member: policy files name it (policies/fased.yaml)
_.MEMORY, _.PRIVATE_DOCUMENT  # data-class names for hosts' parts (docs/disclosure.md)
_.renewals  # LeaseKeeper.renewals: how often the keeper renewed, for its owner to watch
_.received_at  # ReceivedRequest.received_at, in the fake provider's request log
_.filename  # ReceivedMedia.filename: the file name a request sent (docs/adapters.md)

# -- documented public API the library itself does not call -----------------------------------
_.LedgerMiddleware  # integrations/langchain.py (docs/integrations/langchain.md)
_.LedgerModelProvider  # integrations/openai_agents.py (docs/integrations/openai-agents.md)
_.compacted  # RunSession.compacted (docs/policies.md, docs/presets/fased.md)
_.require  # PreflightResult.require raises PreflightRefused (docs/disclosure.md)
_.checks  # PreflightResult.checks: the checks that failed (docs/disclosure.md)
_.narrow_grant  # decide/preflight.py: a Child's grant inside its parent's (docs/disclosure.md)
_.AsyncAudit  # ops/audit.py (docs/audit.md)
_.LedgerModel  # integrations/pydantic_ai.py (docs/integrations/pydantic-ai.md)
_.arecover  # ops/recovery.py (docs/operations.md)
_.apply_overrides  # policy/load.py: the fixed override keys (docs/policies.md)
_.default_policy  # policy/load.py: documented for hosts (docs/policies.md); admission reads the
#                   shared parse instead, to freeze it without a copy
_.forget_secret, _.is_registered  # redaction.py: the registry's other half (docs/adapters.md)
_.enable, _.disable  # telemetry.py: the process-wide switch (docs/telemetry.md)
_.KNOWN_POINTS, _.disarm  # faults.py: the points (docs/operations.md table) and their off switch

# -- the shipped test kit (ledger.testing), there for tests to use ----------------------------
_.reset_next_connections, _.requests, _.wait_for_requests  # FakeProvider (docs/adapters.md)
_.set_default, _.connections  # FakeProvider (docs/adapters.md)
_.restart, _.psql, _.create_database, _.drop_database, _.cleanup  # PgServer (reference.md)

# -- public operations no library code calls (documented in docs/reference.md) --------------
_.set_group_state  # Ledger.set_group_state: an operator's cooldown or outage notice
_.run_policy, _.frozen_run  # a host reads its Run's policy or frozen terms (copies; the
#                              turns and sessions read the caches)
