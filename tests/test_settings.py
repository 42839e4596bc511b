"""settings.py: every setting declared once, read the same way from every front, and decided by one resolver."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from localrun import settings
from localrun.adapters import Target
from localrun.cli import build_parser
from localrun.constraint import Constraint
from localrun.errors import UsageError
from localrun.presets import PARAMETERS, Preset
from localrun.settings import GenerationParams
from localrun.store import ModelInfo
from localrun.tools import ToolPlan

# The fields of the official clients' requests that their endpoint handles itself (not settings):
# what to answer (messages, prompt, tools), how (stream, n, echo), and its constraints.
OPENAI_ENDPOINT = {"messages", "model", "n", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
                   "parallel_tool_calls", "reasoning_effort", "stream_options", "prompt", "echo", "suffix", "best_of"}


def _openai_fields() -> set[str]:
    from openai.types import completion_create_params as text
    from openai.types.chat import completion_create_params as chat

    return set(chat.CompletionCreateParamsBase.__annotations__) | set(text.CompletionCreateParamsBase.__annotations__)


RESPONSES_ENDPOINT = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "reasoning",
                      "text", "metadata", "previous_response_id", "store", "include", "top_logprobs", "max_tool_calls"}


def _responses_fields() -> set[str]:
    from openai.types.responses import response_create_params

    return set(response_create_params.ResponseCreateParamsBase.__annotations__)


ANTHROPIC_ENDPOINT = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "stream"}


def _anthropic_fields() -> set[str]:
    from anthropic.types import message_create_params

    return set(message_create_params.MessageCreateParamsBase.__annotations__)


def _ollama_options() -> set[str]:
    import ollama._types

    return set(ollama._types.Options.model_fields)


@pytest.mark.parametrize(("front", "fields", "own"), [("openai", _openai_fields, OPENAI_ENDPOINT),
                                                       ("responses", _responses_fields, RESPONSES_ENDPOINT),
                                                       ("anthropic", _anthropic_fields, ANTHROPIC_ENDPOINT),
                                                       ("ollama", _ollama_options, set())])
def test_every_field_of_the_official_clients_is_applied_refused_or_declared_inert(front: str, fields: Any,
                                                                                  own: set[str]) -> None:
    """No field is silently dropped: each one the official client can send is a setting of the table,
    a field its endpoint handles, refused when set (settings.REFUSED), or one that changes no token
    (settings.IGNORED: bookkeeping, and Ollama's load options, which follow the server's)."""
    table = set(settings.named(front))
    refused, ignored = set(settings.REFUSED[front]), set(settings.IGNORED[front])
    unclassified = sorted(fields() - table - own - refused - ignored)
    assert not unclassified, f"fields of the {front} client that localrun neither applies nor refuses: {unclassified}"
    assert not (table & (refused | ignored)) and not (refused & ignored)


def test_the_cli_flags_and_the_modelfile_parameters_come_from_the_table() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("run", "batch", "tui", "serve"):
        flags = {o for a in sub.choices[command]._actions for o in a.option_strings}
        declared = {f for s in settings.GENERATION.values() for f in s.names.get("cli", ())}
        assert declared <= flags, (command, sorted(declared - flags))
    assert set(PARAMETERS) == set(settings.named("modelfile"))
    args = parser.parse_args(["run", "m", "--temperature", "0.3", "-n", "5", "--stop", "A", "--stop", "B",
                              "--logit-bias", "15=-100", "--logit-bias", "7+2.5", "--typical-p", "0.9",
                              "--draft", "lookup", "--draft-always"])
    assert settings.from_args(args) == {"temperature": 0.3, "typical_p": 0.9, "logit_bias": ((7, 2.5), (15, -100.0)),
                                        "max_tokens": 5, "stop": ("A", "B"), "speculative": "lookup",
                                        "draft_always": True}
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "m", "--top-p", "1.5"])  # a value the table refuses is refused by the flag


def test_each_front_reads_its_own_names_and_forms() -> None:
    # OpenAI: max_completion_tokens wins over max_tokens, a negative seed is random, a stop may be a string
    assert settings.read({"max_tokens": 5, "max_completion_tokens": 7, "seed": -1, "stop": "x",
                          "logit_bias": {"42": -100}}, "openai") == {"max_tokens": 7, "stop": ("x",),
                                                                      "logit_bias": ((42, -100.0),)}
    # Ollama: num_predict -1 and repeat_last_n -1 leave the defaults
    assert settings.read({"num_predict": -1, "repeat_last_n": -1, "typical_p": 0.5}, "ollama") == {"typical_p": 0.5}
    # a Modelfile: text, stops one per PARAMETER, a draft MODEL is the model drafter
    assert settings.modelfile_values({"temperature": 0.2, "stop": ["a", "b"], "draft": "tiny:draft",
                                      "num_predict": -1, "num_ctx": 2048}) == {
        "temperature": 0.2, "stop": ("a", "b"), "speculative": "model"}
    # GGUF metadata: the model's own sampling defaults, as llama.cpp reads them
    assert settings.gguf_values({"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
                                 "general.sampling.top_p": 7.0}) == {"temperature": 0.6, "top_k": 20}
    with pytest.raises(UsageError) as e:
        settings.read({"top_p": 1.5}, "openai")
    assert e.value.param == "top_p" and "invalid value for 'top_p': 1.5" in str(e.value)
    with pytest.raises(UsageError, match="invalid value for top_k: 2.5"):
        settings.read({"top_k": 2.5}, "batch")
    with pytest.raises(UsageError, match="unknown setting"):
        settings.read({"temprature": 1}, "batch")
    with pytest.raises(UsageError, match="'mirostat' is not supported"):
        settings.refuse("ollama", {"mirostat": 2})
    settings.refuse("ollama", {"mirostat": 0, "tfs_z": 1.0})  # their neutral values change nothing


def _model(metadata: dict[str, Any] | None = None) -> ModelInfo:
    return ModelInfo("m:1", "/m.gguf", "gguf", "path", 0, details={"metadata": metadata or {}})


def test_the_resolver_layers_request_over_preset_over_model_over_server() -> None:
    model = _model({"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": 0.8})
    preset = Preset(base="m:1", parameters={"top_k": 5, "num_predict": 9, "draft": "lookup"})
    target = Target(model, preset=preset, preset_name="p:latest")
    server = {"top_k": 1, "top_p": 0.5, "min_p": 0.2, "seed": 3}
    p = settings.resolve({"temperature": 0.1}, target, "llama.cpp", defaults=server)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.max_tokens) == (0.1, 5, 0.8, 0.2, 3, 9)
    assert p.speculative == "lookup"
    # a request turns drafting off ("off") or asks for the server's drafter ("on": else lookup)
    assert settings.resolve({"speculative": "off"}, target).speculative is None
    assert settings.resolve({"speculative": "on"}, model=model, defaults={"speculative": "model"}).speculative == "model"
    assert settings.resolve({"speculative": "on"}, model=model).speculative == "lookup"
    # a thought's budget turns drafts off, whichever layer asked for them
    assert settings.resolve({"think_budget": 4}, target).speculative is None
    assert settings.resolve().temperature == GenerationParams().temperature  # no layer: localrun's defaults


def test_the_resolver_applies_constraints_tools_and_adapters() -> None:
    schema = Constraint.schema({"type": "object"})
    assert settings.resolve({}, constraint=schema).grammar == schema.grammar
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plan = ToolPlan.make(None, tools, "required")
    assert plan is not None
    called = settings.resolve({}, tools=plan)
    assert called.grammar and called.special and called.grammar_trigger is None
    with pytest.raises(UsageError, match="cannot be combined with tools"):
        settings.resolve({}, constraint=schema, tools=plan)
    adapter = ModelInfo("a:lora", "/a.gguf", "gguf", "path", 0, kind="adapter")
    target = Target(_model(), ((adapter, 0.5),))
    assert settings.resolve({}, target, "llama.cpp").lora == (("/a.gguf", 0.5),)  # per request
    assert settings.resolve({}, target, "mlx").lora == ()  # applied when the model loads instead


def test_a_choice_of_n_differs_by_seed_only() -> None:
    p = settings.resolve({"seed": 2**32 - 1})
    assert [p.choice(i).seed for i in range(3)] == [2**32 - 1, 0, 1]
    assert settings.resolve().choice(3).seed is None
