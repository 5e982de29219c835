"""LiteLLM Router as a reference for ``bench turn``'s throughput target.

The issue's target: c=16 concurrent healthy turns on one process at least twice LiteLLM
Router's calls per second, measured in the same run. LiteLLM writes nothing durable; the
ledger commits twice per call and reads once. Here ``Router.acompletion`` sends the bench's
own question to the same fake endpoint and model (an OpenAI-compatible deployment, no
retries), as ``c`` tasks on an event loop of its own thread, exactly as the ledger's async
rows are driven; calls per second and this process's CPU per call are reported.

Optional: measured when ``litellm`` is importable (``pip install litellm``, not a dependency
of the project); otherwise the report says it was not. LiteLLM fetches its model price map
from the internet when imported unless told to use its bundled copy; the benchmarks talk to
loopback only, so the bundled copy is forced before the import.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.common import BenchError, cpu_now


@dataclass(frozen=True)
class LiteLLMResult:
    """LiteLLM Router's throughput at one concurrency, on the bench's fake endpoint."""

    version: str
    concurrency: int
    calls: int
    calls_per_s: float
    cpu_ms: float  # this process's CPU per call


def _import() -> Any | None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import litellm
    except ImportError:
        return None
    litellm.telemetry = False
    litellm.suppress_debug_info = True
    return litellm


def available() -> bool:
    """Whether LiteLLM can be measured here."""
    return _import() is not None


def measure(endpoint: str, model: str, question: str, *, concurrency: int, calls: int,
            warmup: int, loop: asyncio.AbstractEventLoop) -> LiteLLMResult | None:
    """``calls`` healthy ``Router.acompletion`` calls on ``concurrency`` tasks (``None``:
    LiteLLM is not installed)."""
    litellm = _import()
    if litellm is None:
        return None
    from importlib.metadata import version

    router = litellm.Router(
        model_list=[{"model_name": "bench", "litellm_params": {
            "model": f"openai/{model}", "api_base": endpoint, "api_key": "unused"}}],
        num_retries=0, timeout=30.0)
    messages = [{"role": "user", "content": question}]

    async def one() -> None:
        resp = await router.acompletion(model="bench", messages=messages, max_tokens=256)
        if not resp.choices or not resp.choices[0].message.content:
            raise BenchError("LiteLLM's reference call returned no text")

    async def block(per_worker: int) -> tuple[float, float]:
        async def worker() -> None:
            for _ in range(per_worker):
                await one()

        c0, t0 = cpu_now(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, cpu_now() - c0

    def run(per_worker: int) -> tuple[float, float]:
        got: tuple[float, float] = asyncio.run_coroutine_threadsafe(
            block(per_worker), loop).result()
        return got

    run(warmup)
    per_worker = max(1, math.ceil(calls / concurrency))
    wall, cpu = run(per_worker)
    n = per_worker * concurrency
    return LiteLLMResult(version=version("litellm"), concurrency=concurrency, calls=n,
                         calls_per_s=round(n / wall, 1), cpu_ms=round(cpu * 1000 / n, 3))


__all__ = ["LiteLLMResult", "available", "measure"]
