"""Speculative decoding on MLX: the starter's trained weights as an MLX folder, with prompt lookup
and with its own 4-bit MLX quantization as the draft model. Drafts verified in the model's forward
pass give the reply the model gives without them (greedy: the same text, with and without a
repetition penalty; sampled: the same distribution, by a chi-square test), a sequence that stops
drafting goes on in mlx-lm's BatchGenerator with its cache and the same reply, draft models of
another format or vocabulary are refused, and the CLI reports what was drafted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.errors import UsageError
from localrun.generation import Request
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import Store

from ..test_speculative import REWRITE, _homogeneity
from .conftest import Models, collect, mlx_lm_convert


@pytest.fixture(scope="module")
def drafts(smol: dict[str, Path]) -> dict[str, Path]:
    """The starter as an MLX folder, and its 4-bit quantization (the draft model)."""
    return {"model": smol["mlx"], "draft": mlx_lm_convert(smol["hf"], smol["hf"].parent / "smol-q4", quantize=True, q_bits=4)}


def _load(path: Path, **options: Any) -> Any:
    return api.load(Store(path.parent / ".store").get(str(path)), LoadOptions(n_ctx=512, **options), engine="mlx")


@pytest.fixture(scope="module")
def session(drafts: dict[str, Path]) -> Iterator[Any]:
    s = _load(drafts["model"], n_parallel=8, draft=str(drafts["draft"]))
    yield s
    s.close()


def _reply(session: Any, prompt: str, **params: Any) -> tuple[str, Any]:
    text, last, _ = collect(session, api.build_messages(prompt), GenerationParams(**params))
    return text, last


def test_greedy_replies_are_the_same_with_and_without_drafts(session: Any) -> None:
    assert session.info()["draft_model"] == "smol-q4"
    # with a repetition penalty, each drafted position sees the drafts before it
    for drafter, extra in (("lookup", {}), ("model", {}), ("lookup", {"repeat_penalty": 1.3})):
        plain, plain_end = _reply(session, REWRITE, temperature=0, max_tokens=12, **extra)
        drafted, end = _reply(session, REWRITE, temperature=0, max_tokens=12, speculative=drafter,
                              draft_always=True, **extra)
        assert drafted == plain, (drafter, extra)
        assert end.completion_tokens == plain_end.completion_tokens
        assert 0 < end.accepted_tokens <= end.drafted_tokens, (drafter, extra)


def test_sampled_replies_follow_the_models_distribution(models: Models) -> None:
    """Drafts stand only while the model's own sample at each position equals them: 400 sampled
    replies (different seeds) with lookup drafts against 400 without find no difference (p > 0.001),
    where the same test tells temperature 1.0 from 0.4 apart (p < 1e-4). The model is stories260K
    on MLX, whose continuation of a repeated sentence keeps some drafts and rejects others."""
    request = Request(prompt="Once upon a time, there was a little girl named Lily. She liked to play. "
                             "Once upon a time, there was a little")
    s = _load(models.plain.mlx, n_parallel=8)
    try:
        def sample(seed0: int, temperature: float, speculative: str | None) -> tuple[list[str], int, int]:
            rows = [(i, request, GenerationParams(temperature=temperature, seed=seed0 + i, max_tokens=4,
                                                  speculative=speculative, draft_always=True)) for i in range(400)]
            out = [r for r in s.generate_many(rows) if hasattr(r, "text")]
            assert not [r.error for r in out if r.error]
            return [r.text for r in out], sum(r.drafted_tokens for r in out), sum(r.accepted_tokens for r in out)

        plain, _, _ = sample(0, 1.0, None)
        drafted, made, kept = sample(100_000, 1.0, "lookup")
        assert 200 < kept < made  # drafts were kept, and some rejected: the path under test
        assert _homogeneity(plain, drafted) > 1e-3
        colder, _, _ = sample(300_000, 0.4, None)
        assert _homogeneity(plain, colder) < 1e-4
    finally:
        s.close()


def test_a_sequence_that_stops_drafting_goes_on_in_the_batch(drafts: dict[str, Path]) -> None:
    """A fresh engine drafts until its drafts stop or it has measured that they do not pay (MLX on
    a CPU evaluates each position at nearly full cost, so they do not); the sequence then goes on
    in the generator with its cache, and the reply is the same. Two sequences at once never draft:
    each would need a forward pass of its own."""
    s = _load(drafts["model"], n_parallel=2)
    try:
        first, end = _reply(s, REWRITE, temperature=0, max_tokens=16, speculative="lookup")
        assert end.drafted_tokens > 0
        plain, _ = _reply(s, REWRITE, temperature=0, max_tokens=16)
        assert first == plain
        assert _reply(s, REWRITE, temperature=0, max_tokens=16, speculative="lookup")[0] == plain
        rows = [(i, api.build_messages(REWRITE), GenerationParams(temperature=0, max_tokens=8, speculative="lookup"))
                for i in range(2)]
        both = [r for r in s.generate_many(rows) if hasattr(r, "text")]
        assert [(r.text, r.drafted_tokens) for r in both] == [(plain[:len(both[0].text)], 0)] * 2 and both[0].text
    finally:
        s.close()


def test_draft_models_of_another_format_or_vocabulary_are_refused(drafts: dict[str, Path], models: Models) -> None:
    with pytest.raises(UsageError, match="'stories-mlx' cannot draft for this model: it adds a BOS token to a prompt and the target does not"):
        _load(drafts["model"], draft=str(models.plain.mlx))
    with pytest.raises(UsageError, match="'stories.gguf' is a GGUF file, and on MLX a draft model is an MLX folder"):
        _load(drafts["model"], draft=str(models.plain.gguf))
    s = _load(drafts["model"], draft=str(models.plain.gguf), draft_optional=True)  # as serve loads: drafts refused
    try:
        assert "is a GGUF file" in s.info()["draft_refused"]
        text, end = _reply(s, REWRITE, temperature=0, max_tokens=8, speculative="model")
        assert text and end.drafted_tokens == 0
    finally:
        s.close()


def test_run_on_mlx_reports_drafted_and_accepted_tokens(cli: Any, drafts: dict[str, Path]) -> None:
    out = cli("run", str(drafts["model"]), REWRITE, "--engine", "mlx", "--json", "--temperature", "0",
              "--max-tokens", "6", "--draft", str(drafts["draft"]), "--draft-always")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert 0 < record["accepted_tokens"] <= record["drafted_tokens"]
