"""Models chosen by memory: an agent's two tiers (Claude Code's haiku and sonnet names, aliased
to two installed models) stay loaded side by side while the memory holds both; when it holds one,
the idle one is unloaded; when the one that would have to go is in use, the other's request waits
for it instead of failing. The memory the pool sees is set for the last two cases (as a machine
with less of it would report), from the pool's own estimate of each model (fit.model_memory)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from localrun import api, pool, system
from localrun.settings import LoadOptions
from tests.thinking_models import TEMPLATE

from .conftest import MODEL, Served, serve

SMALL = "qwen3:tiny"
OPTIONS = LoadOptions(n_ctx=1024, n_parallel=1)
TIERS = (("claude-haiku-*", SMALL), ("claude-*", MODEL))
ASK = [{"role": "user", "content": "Say hi."}]


@pytest.fixture
def tiers(thinker: Callable[..., Path]) -> Iterator[Served]:
    api.add_model(thinker(TEMPLATE), SMALL)
    with serve(OPTIONS, aliases=TIERS, max_loaded=0) as s:  # --max-loaded auto
        yield s


def ask(s: Served, model: str) -> Any:
    c = anthropic.Anthropic(base_url=s.url, api_key="local", max_retries=0, timeout=300)
    return c.messages.create(model=model, max_tokens=3, messages=ASK, extra_body={"temperature": 0})


def loaded(s: Served) -> set[str]:
    return {m["name"] for m in s.http().get("/api/ps").json()["models"]}


def memory(name: str) -> tuple[int, int]:
    """What the pool reckons the model takes when loaded, and its weights (mapped from the file)."""
    info = api.get_model(name)
    return pool._memory(info, OPTIONS.n_ctx, OPTIONS), info.size


def test_both_tiers_stay_loaded_while_memory_holds_them(tiers: Served) -> None:
    assert ask(tiers, "claude-haiku-4-5-20251001").model == SMALL
    assert ask(tiers, "claude-sonnet-4-5").model == MODEL
    assert loaded(tiers) == {SMALL, MODEL}
    assert ask(tiers, "claude-haiku-4-5").model == SMALL and loaded(tiers) == {SMALL, MODEL}


def short_of_both(monkeypatch: pytest.MonkeyPatch, first: str, then: str) -> None:
    """Memory that holds either model, but not the second beside the first."""
    a, b = memory(first), memory(then)
    available = b[0] + a[1] - 1  # the first one's weights count as available page cache
    assert a[0] <= available
    total = system.ram_bytes()[0]
    monkeypatch.setattr(system, "ram_bytes", lambda: (total, available))


def test_the_idle_tier_is_unloaded_when_memory_holds_one(tiers: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    short_of_both(monkeypatch, MODEL, SMALL)
    assert ask(tiers, "claude-sonnet-4-5").model == MODEL and loaded(tiers) == {MODEL}
    assert ask(tiers, "claude-haiku-4-5").model == SMALL and loaded(tiers) == {SMALL}


def test_a_tier_waits_for_the_other_in_use_and_never_fails(tiers: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    short_of_both(monkeypatch, MODEL, SMALL)
    got: list[Any] = []
    with tiers.pool.use(MODEL):  # the main tier is busy (a turn of the agent)
        worker = threading.Thread(target=lambda: got.append(ask(tiers, "claude-haiku-4-5")))
        worker.start()
        deadline = time.monotonic() + 120
        while tiers.pool.waiting == 0 and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tiers.pool.waiting == 1 and not got  # waiting for room, not refused
        assert loaded(tiers) == {MODEL}
    worker.join(300)
    assert got and got[0].model == SMALL and got[0].stop_reason in ("end_turn", "max_tokens")
    assert loaded(tiers) == {SMALL}
