"""Integrations with agent frameworks, each behind its own optional extra.

- :mod:`ledger.integrations.pydantic_ai`: ``LedgerModel``, a pydantic-ai ``Model`` backed by a
  ledger Run (``pip install 'failover-ledger[pydantic-ai]'``).
- :mod:`ledger.integrations.langchain`: ``LedgerMiddleware`` for LangChain v1's
  ``create_agent`` and ``LedgerChatModel`` for LangGraph nodes
  (``pip install 'failover-ledger[langchain]'``).
- :mod:`ledger.integrations.openai_agents`: ``LedgerModelProvider`` for the OpenAI Agents SDK's
  runner (``pip install 'failover-ledger[openai-agents]'``).
"""
