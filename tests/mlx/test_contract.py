"""One contract, both engines: every test body runs on llama.cpp (GGUF) and on MLX (the same
weights as an MLX folder), through the worker sessions the CLI and TUI use. Expected text comes
from the PyTorch (transformers) reference, so both engines must agree with it and each other."""

from __future__ import annotations

from typing import Any

import pytest

from localrun.chat import PLAIN_STOPS, parse_messages, render_plain, render_template
from localrun.errors import ContextOverflowError
from localrun.generation import Request
from localrun.settings import GenerationParams

from ..test_llama_backend import cancel_late_tokens
from .conftest import ENGINES, N_CTX, TEMPLATE, Models, collect, torch_greedy

GREEDY = GenerationParams(temperature=0)


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def plain(sessions: Any, engine: str) -> Any:
    return sessions(engine, "plain")


@pytest.fixture
def chat(sessions: Any, engine: str) -> Any:
    return sessions(engine, "chat")


def _tokenizer(models: Models) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(models.plain.hf))


def reference(models: Models, prompt_ids: list[int], n: int, eos: int | None = None) -> str:
    """PyTorch greedy continuation of prompt_ids as text (decoded with the prompt, so spaces are kept)."""
    tok = _tokenizer(models)
    new = torch_greedy(models.plain.hf, prompt_ids, n, eos if eos is not None else models.plain.eos)
    full = tok.decode(prompt_ids + new, skip_special_tokens=True)
    head = tok.decode(prompt_ids, skip_special_tokens=True)
    assert full.startswith(head)
    return full[len(head):]


def raw_ids(models: Models, prompt: str) -> list[int]:
    return list(_tokenizer(models).encode(prompt))


@pytest.mark.parametrize("prompt", ["Once upon a time", "Lily and Tom went to the park", "The little dog"])
def test_greedy_equals_pytorch_reference(models: Models, plain: Any, prompt: str) -> None:
    ids = raw_ids(models, prompt)
    text, last, _ = collect(plain, Request.raw(prompt), GenerationParams(temperature=0, max_tokens=40))
    assert text == reference(models, ids, 40)
    assert last.prompt_tokens == len(ids) and last.completion_tokens == 40 and last.finish_reason == "length"


def test_streaming_yields_pieces_then_one_final_chunk(plain: Any) -> None:
    text, last, n_chunks = collect(plain, Request.raw("Once upon a time"), GenerationParams(temperature=0, max_tokens=30))
    assert n_chunks >= 10, "text must arrive as it is generated, not at the end"
    assert last.done and last.text == "" and last.completion_tokens == 30
    assert last.prompt_tokens == 5 and last.decode_ms > 0 and last.tokens_per_second > 0 and last.prompt_ms >= 0
    assert last.seed is not None


def test_stop_sequence_across_tokens(plain: Any) -> None:
    full, _, _ = collect(plain, Request.raw("Once upon a time"), GenerationParams(temperature=0, max_tokens=40))
    stop = "le gi"  # the end of " little" and the start of " girl": two tokens
    assert stop in full
    text, last, _ = collect(plain, Request.raw("Once upon a time"),
                            GenerationParams(temperature=0, max_tokens=40, stop=("zzz", stop)))
    assert text == full[: full.index(stop)] and last.finish_reason == "stop"
    assert last.completion_tokens < 40


def test_text_held_back_for_a_possible_stop_is_not_lost(plain: Any) -> None:
    full, _, _ = collect(plain, Request.raw("Once upon a time"), GenerationParams(temperature=0, max_tokens=40))
    # Every "girl" is held back until the next character rules out "girlx".
    text, last, _ = collect(plain, Request.raw("Once upon a time"),
                            GenerationParams(temperature=0, max_tokens=40, stop=("girlx", full[-3:] + "x")))
    assert text == full and last.finish_reason == "length"


def test_max_tokens(plain: Any) -> None:
    for n in (1, 7):
        _, last, _ = collect(plain, Request.raw("Once upon a time"), GenerationParams(temperature=0, max_tokens=n))
        assert last.completion_tokens == n and last.finish_reason == "length"


def test_seed_makes_sampling_reproducible(plain: Any) -> None:
    params = GenerationParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42, max_tokens=40)
    a, last_a, _ = collect(plain, Request.raw("Once upon a time"), params)
    b, _, _ = collect(plain, Request.raw("Once upon a time"), params)
    assert a == b and last_a.seed == 42
    others = {collect(plain, Request.raw("Once upon a time"), GenerationParams(**{**params.to_dict(), "seed": s}))[0]
              for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds should give different samples"
    # An unseeded reply reports the seed it drew, and that seed reproduces it.
    unseeded = GenerationParams(**{**params.to_dict(), "seed": None})
    c, last_c, _ = collect(plain, Request.raw("Once upon a time"), unseeded)
    assert last_c.seed is not None
    again = collect(plain, Request.raw("Once upon a time"), GenerationParams(**{**params.to_dict(), "seed": last_c.seed}))[0]
    assert again == c


@pytest.mark.parametrize("narrow", [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 0.01}])
def test_sampling_filters_that_leave_one_token_equal_greedy(models: Models, plain: Any, narrow: dict[str, Any]) -> None:
    params = GenerationParams(**{"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 7,
                                 "max_tokens": 30, **narrow})
    text, _, _ = collect(plain, Request.raw("Once upon a time"), params)
    assert text == reference(models, raw_ids(models, "Once upon a time"), 30)


def test_repeat_penalty_matches_reference(models: Models, plain: Any) -> None:
    """llama.cpp's penalty: logit / p (or * p if negative) for the last repeat_last_n generated
    tokens; the prompt's are not penalized (with this prompt that changes the text)."""
    import torch

    from .conftest import _torch_model

    prompt = "Lily and Tom went to the park"
    ids = raw_ids(models, prompt)
    model = _torch_model(str(models.plain.hf))
    seq = list(ids)
    with torch.no_grad():
        for _ in range(40):
            logits = model(torch.tensor([seq])).logits[0, -1]
            recent = sorted(set(seq[len(ids):][-64:]))
            if recent:
                picked = logits[recent]
                logits[recent] = torch.where(picked < 0, picked * 1.5, picked / 1.5)
            seq.append(int(logits.argmax()))
    tok = _tokenizer(models)
    expected = tok.decode(seq, skip_special_tokens=True)[len(tok.decode(ids, skip_special_tokens=True)):]
    plain_text, _, _ = collect(plain, Request.raw(prompt), GenerationParams(temperature=0, max_tokens=40))
    text, _, _ = collect(plain, Request.raw(prompt),
                         GenerationParams(temperature=0, max_tokens=40, repeat_penalty=1.5, repeat_last_n=64))
    assert text == expected and text != plain_text


def _torch_steps(models: Models, prompt: str, n: int, pick: Any) -> str:
    """The PyTorch reference's continuation where `pick(logits)` chooses each next token."""
    import torch

    from .conftest import _torch_model

    ids = raw_ids(models, prompt)
    model = _torch_model(str(models.plain.hf))
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(pick(model(torch.tensor([seq])).logits[0, -1].double())))
    tok = _tokenizer(models)
    return tok.decode(seq, skip_special_tokens=True)[len(tok.decode(ids, skip_special_tokens=True)):]


def test_logit_bias_matches_reference(models: Models, plain: Any) -> None:
    """A bias is added to its token's logit before sampling (llama.cpp's logit-bias sampler, and
    OpenAI's logit_bias): the greedy path is the argmax of the biased logits, on both engines; -100
    bans a token, +100 makes it the only choice."""
    import torch

    prompt = "Once upon a time"
    unbiased, _, _ = collect(plain, Request.raw(prompt), GenerationParams(temperature=0, max_tokens=20))
    tok = _tokenizer(models)
    first = tok.encode(prompt + unbiased, add_special_tokens=False)[len(tok.encode(prompt, add_special_tokens=False))]
    the = tok.convert_tokens_to_ids("▁the")
    bias = ((first, -100.0), (the, 3.0))

    def biased(logits: Any) -> int:
        logits = logits.clone()
        for t, b in bias:
            logits[t] += b
        return int(torch.argmax(logits))

    text, _, _ = collect(plain, Request.raw(prompt), GenerationParams(temperature=0, max_tokens=20, logit_bias=bias))
    assert text == _torch_steps(models, prompt, 20, biased) and text != unbiased
    forced, _, _ = collect(plain, Request.raw(prompt),
                           GenerationParams(temperature=0.8, seed=5, max_tokens=4, logit_bias=((the, 100.0),)))
    assert forced == " the" * 4


def test_typical_sampling_keeps_the_most_typical_tokens(models: Models, plain: Any) -> None:
    """Locally typical sampling (typical_p) keeps the tokens whose surprise is nearest the entropy;
    with p near 0 only the most typical one is left, so any seed gives the reference's path of
    most typical tokens on both engines (and not the greedy one)."""
    import torch

    def most_typical(logits: Any) -> int:
        lp = torch.log_softmax(logits, -1)
        entropy = -(lp.exp() * lp).sum()
        return int(torch.argmin((-lp - entropy).abs()))

    prompt = "Once upon a time"
    expected = _torch_steps(models, prompt, 12, most_typical)
    for seed in (1, 2):
        text, _, _ = collect(plain, Request.raw(prompt), GenerationParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                                                          typical_p=1e-6, seed=seed, max_tokens=12))
        assert text == expected, seed
    assert expected != reference(models, raw_ids(models, prompt), 12)


def test_cancel_between_tokens_then_next_request_is_clean(models: Models, plain: Any) -> None:
    # No max_tokens: without the cancel the reply would run to the end of the context.
    last, late = cancel_late_tokens(plain, Request.raw("Once upon a time"), GREEDY, after=3)
    assert last.finish_reason == "cancelled"
    assert last.completion_tokens >= 3 and late <= 1  # the engine reads requests between tokens
    text, _, _ = collect(plain, Request.raw("Once upon a time"), GenerationParams(temperature=0, max_tokens=20))
    assert text == reference(models, raw_ids(models, "Once upon a time"), 20)


def test_shared_prompt_prefixes_give_fresh_results(models: Models, plain: Any) -> None:
    """The engines reuse the KV cache of a shared prefix; the text must be as if computed afresh."""
    prompts = ["Once upon a time", "Once upon a time there was a big dog", "Once upon a", "Once upon a time"]
    for prompt in prompts:
        text, _, _ = collect(plain, Request.raw(prompt), GenerationParams(temperature=0, max_tokens=15))
        assert text == reference(models, raw_ids(models, prompt), 15), prompt


def test_chat_template_and_stop_at_end_of_sequence(models: Models, chat: Any) -> None:
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell me about Lily"}]
    tok = _tokenizer(models)
    rendered = render_template(TEMPLATE, parse_messages(messages), bos_token=tok.bos_token, eos_token=".")
    assert rendered.startswith("system: Be kind.\nuser:") and rendered.endswith("assistant:")
    ids = list(tok.encode(rendered))  # with the BOS
    assert ids.count(tok.bos_token_id) == 1
    text, last, _ = collect(chat, Request.chat(messages), GenerationParams(temperature=0, max_tokens=60))
    assert last.prompt_tokens == len(ids)
    assert last.finish_reason == "stop" and 0 < last.completion_tokens < 60  # "." is the end of sequence
    assert text == reference(models, ids, 60, eos=models.chat.eos) and "." not in text


def test_model_without_template_uses_plain_turns(models: Models, plain: Any) -> None:
    messages = parse_messages([{"role": "user", "content": "Tell me a story."}])
    ids = raw_ids(models, render_plain(messages))
    text, last, _ = collect(plain, Request.chat(messages), GenerationParams(temperature=0, max_tokens=50))
    expected = reference(models, ids, 50)
    cut = min((expected.index(s) for s in PLAIN_STOPS if s in expected), default=None)
    assert last.prompt_tokens == len(ids)
    if cut is None:
        assert text == expected and last.finish_reason == "length"
    else:
        assert text == expected[:cut] and last.finish_reason == "stop"


def test_context_overflow_and_full_context(plain: Any) -> None:
    with pytest.raises(ContextOverflowError, match=f"context holds {N_CTX}"):
        collect(plain, Request.raw("Once upon a time " * 300), GREEDY)
    prompt = "Once upon a time " * 240  # about 960 tokens of the 1024
    _, last, _ = collect(plain, Request.raw(prompt), GREEDY)
    assert last.finish_reason == "length" and last.prompt_tokens + last.completion_tokens == N_CTX


STORY_SCHEMA = {
    "type": "object",
    "properties": {"who": {"enum": ["Lily", "Tom", "Sue"]}, "age": {"type": "integer", "minimum": 1, "maximum": 9},
                   "said": {"type": "string", "pattern": "^[a-z ]{1,12}$"}},
    "required": ["who", "age", "said"],
}


@pytest.mark.parametrize("kind", ["schema", "grammar", "choice"])
def test_constraints_hold_under_sampling(plain: Any, kind: str) -> None:
    """The grammar masks tokens on both engines: sampled output always matches it."""
    import json
    import re

    import jsonschema

    from localrun.constraint import Constraint

    c = {"schema": Constraint.schema(STORY_SCHEMA), "grammar": Constraint.gbnf('root ::= "Once " [a-z]+ ( " " [a-z]+ ){2,4} "."'),
         "choice": Constraint.choice(["Lily ran.", "Tom sat.", "the dog"])}[kind]
    for seed in range(4):
        text, last, _ = collect(plain, Request.raw("Once upon a time"),
                                GenerationParams(temperature=1.0, top_k=0, top_p=1, min_p=0, seed=seed, max_tokens=80,
                                                 grammar=c.grammar))
        assert last.finish_reason == "stop", (kind, text)
        if kind == "schema":
            jsonschema.validate(json.loads(text), STORY_SCHEMA)
        elif kind == "grammar":
            assert re.fullmatch(r"Once [a-z]+( [a-z]+){2,4}\.", text), text
        else:
            assert text in ("Lily ran.", "Tom sat.", "the dog")


def test_constrained_greedy_agrees_across_engines(sessions: Any) -> None:
    """Same weights, same grammar: the constrained argmax is the same token path on both engines."""
    from localrun.constraint import Constraint

    c = Constraint.schema(STORY_SCHEMA)
    params = GenerationParams(temperature=0, max_tokens=60, grammar=c.grammar)
    texts = {e: collect(sessions(e, "plain"), Request.raw("Lily and Tom went to the park"), params)[0] for e in ENGINES}
    assert len(set(texts.values())) == 1, texts


def test_lazy_grammar_applies_from_its_trigger(plain: Any) -> None:
    """A lazy grammar (tool calls under "auto") leaves the text free until its trigger, then holds."""
    import re

    lark = 'start: "Lily" " is " /[0-9]{2}/ "."\n'
    text, last, _ = collect(plain, Request.raw("Once upon a time"),
                            GenerationParams(temperature=0, max_tokens=80, grammar=lark, grammar_trigger="Lily"))
    assert last.finish_reason == "stop", text
    assert re.fullmatch(r"(?s)(?:(?!Lily).)+Lily is [0-9]{2}\.", text), text
