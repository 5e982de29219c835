"""Agent-framework integrations (pydantic-ai) over the fake provider."""
