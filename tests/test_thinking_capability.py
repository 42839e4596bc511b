"""The `thinking` capability says what the engines do: a model whose chat template names only part
of its reasoning format (LFM2.5-Instruct writes only `</think>`) thinks when its vocabulary has
`<think>` as one token, and /api/show, `run --think` and Ollama's think then agree with the
engine that loads it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from localrun import api
from localrun.backends.llama_cpp import LlamaCppEngine
from localrun.settings import LoadOptions
from tests.test_reasoning import templates


@pytest.fixture(scope="module")
def partial(tmp_path_factory: pytest.TempPathFactory, thinker: Callable[..., Path]) -> Path:
    template = tmp_path_factory.mktemp("partial") / "LFM2.5-Instruct.jinja"
    template.write_text(templates()["LFM2.5-Instruct"])
    return thinker(template)


def test_a_format_completed_by_the_vocabulary_is_a_capability_as_the_engine_finds_it(partial: Path) -> None:
    model = api.add_model(partial, "lfm:tiny")
    assert "thinking" in api.capabilities(model)
    engine = LlamaCppEngine(model, LoadOptions(n_ctx=256, n_parallel=1))
    try:
        assert engine.reasoning is not None
        assert engine.reasoning.name == api.reasoning_format(model).name  # type: ignore[union-attr]
    finally:
        engine.close()
    starter = api.get_model("smollm2:135m")
    assert "thinking" not in api.capabilities(starter) and api.reasoning_format(starter) is None
