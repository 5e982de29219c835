"""The pydantic-ai integration's documented example runs as written (extracted from the
Markdown and run in a fresh folder against the shipped fake provider)."""

from __future__ import annotations

from pathlib import Path

from tests.docs.test_quickstart import REPO, _first_python_block, _run


def test_the_pydantic_ai_example_runs_as_written(tmp_path: Path) -> None:
    code = _first_python_block(REPO / "docs" / "integrations" / "pydantic-ai.md",
                               after="## A complete example")
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    # Request 1 failed over (two Attempts), request 2 stayed on the route the Run used.
    assert out[1:3] == ["  [model-b-fake-001 via backup, 2 attempt(s), 11+7 tokens]",
                        "  [model-b-fake-001 via backup, 1 attempt(s), 11+7 tokens]"]
    assert [ln.strip() for ln in out if ln.startswith("  ") and ":" in ln
            and "[" not in ln] == ["primary: failed", "backup: succeeded",
                                   "backup: succeeded", "backup: succeeded"]
    assert out[-1].startswith("spent ")


def _tagged(out: list[str]) -> list[str]:
    return [ln for ln in out if ln.startswith("  [") and "attempt(s)" in ln]


def test_the_langchain_example_runs_as_written(tmp_path: Path) -> None:
    code = _first_python_block(REPO / "docs" / "integrations" / "langchain.md",
                               after="## A complete example")
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    # Model call 1 failed over (two Attempts, to another protocol); call 2 stayed there.
    assert _tagged(out) == ["  [claude-x-fake-001 via backup, 2 attempt(s), 11+7 tokens]",
                            "  [claude-x-fake-001 via backup, 1 attempt(s), 11+7 tokens]"]
    assert [ln.strip() for ln in out if ln.endswith(("failed", "succeeded"))] == [
        "primary: failed", "backup: succeeded", "backup: succeeded", "backup: succeeded"]
    assert out[-1].startswith("spent ")


def test_the_openai_agents_example_runs_as_written(tmp_path: Path) -> None:
    code = _first_python_block(REPO / "docs" / "integrations" / "openai-agents.md",
                               after="## A complete example")
    assert "set_tracing_disabled(True)" in code  # nothing may reach api.openai.com
    done = _run(code, tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "researcher: Hello from the fake provider, streaming in pieces."
    assert _tagged(out) == ["  [gemini-x-fake-001 via backup, 2 attempt(s), 11+7 tokens]"] + \
        ["  [gemini-x-fake-001 via backup, 1 attempt(s), 11+7 tokens]"] * 2
    assert any(ln.startswith("  [served by attempt att-") for ln in out)
    assert [ln.strip() for ln in out if ln.endswith(("failed", "succeeded"))] == [
        "primary: failed"] + ["backup: succeeded"] * 4
    assert out[-1].startswith("spent ")
