"""A request's settings on the server, through the official clients: every sampling field is applied
(logit_bias on both APIs of text generation) or refused by name, and the server's own defaults and
the model's (its GGUF's general.sampling.*) sit under a request's."""

from __future__ import annotations

from pathlib import Path

import ollama
import openai
import pytest

from localrun import api
from localrun.settings import LoadOptions

from ..conftest import starter_or_fail
from ..ggufs import rewrite_gguf
from .conftest import MODEL, Served, serve

CHAT = [{"role": "user", "content": "Name a fruit."}]


def _token(text: str) -> int:
    """The starter's id of a token (its vocabulary, read through the engine's own tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(starter_or_fail().parent), gguf_file=starter_or_fail().name)
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return int(ids[0])


def test_logit_bias_is_applied_on_chat_and_text_completions(served: Served) -> None:
    """Before, logit_bias was accepted and dropped: a +100 bias left the greedy reply as it was."""
    client = served.openai()
    comma = _token(",")
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=6)
    forced = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=6,
                                            logit_bias={str(comma): 100})
    assert forced.choices[0].message.content == "," * 6 != plain.choices[0].message.content
    text = client.completions.create(model=MODEL, prompt="The sky is", temperature=0, max_tokens=4,
                                     logit_bias={str(comma): 100})
    assert text.choices[0].text == ",,,,"
    # a ban: the greedy reply's first token is never chosen
    first = plain.choices[0].message.content or ""
    head = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=1, logprobs=True)
    banned = head.choices[0].logprobs.content[0].token
    other = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=6,
                                           logit_bias={str(_token(banned)): -100})
    assert not (other.choices[0].message.content or "").startswith(banned) and first.startswith(banned)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, logit_bias={str(comma): 101})
    assert e.value.param == "logit_bias"
    with pytest.raises(openai.BadRequestError, match="beyond|vocabulary"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logit_bias={"99999999": 1})


def test_fields_localrun_does_not_implement_are_refused_by_name(served: Served) -> None:
    client = served.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, prediction={"type": "content", "content": "x"})
    assert e.value.param == "prediction" and "'prediction' is not supported" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT,
                                       functions=[{"name": "f", "parameters": {"type": "object"}}])
    assert e.value.param == "functions"
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, store=False, user="u",
                                        metadata={"k": "v"}, modalities=["text"])
    assert ok.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(ollama.ResponseError) as oe:
        served.ollama().chat(model=MODEL, messages=CHAT, options={"mirostat": 2})
    assert oe.value.status_code == 400 and "'mirostat' is not supported" in oe.value.error
    # mirostat off, and the load options that follow the server's own settings, change nothing
    reply = served.ollama().chat(model=MODEL, messages=CHAT, options={"mirostat": 0, "num_gpu": 1, "num_thread": 1,
                                                                      "temperature": 0, "num_predict": 2})
    assert reply.eval_count == 2


def test_typical_p_is_applied_on_the_ollama_api(served: Served) -> None:
    """typical_p was refused by name before; a typical_p near 0 keeps one token per step, so any seed
    gives the same reply, where plain sampling differs by seed."""
    client = served.ollama()

    def reply(seed: int, **options: float) -> str:
        return client.generate(model=MODEL, prompt="Write a word.", options={"temperature": 1.5, "top_k": 0,
                                                                             "top_p": 1.0, "min_p": 0.0, "seed": seed,
                                                                             "num_predict": 12, **options}).response

    assert len({reply(s, typical_p=1e-6) for s in (1, 2, 3)}) == 1
    assert len({reply(s) for s in (1, 2, 3)}) > 1


def test_server_defaults_sit_under_the_request_and_the_model_defaults_between(tmp_path: Path) -> None:
    """serve's generation flags are defaults: a request's own value wins over them, and a model's
    general.sampling.* (as llama.cpp's converter writes a model's generation_config) over the server's."""
    import gguf

    sampled = rewrite_gguf(starter_or_fail(), tmp_path / "sampled.gguf",
                           add={"general.sampling.temp": (0.0, gguf.GGUFValueType.FLOAT32)})
    api.add_model(str(sampled), "sampled:1")
    with serve(LoadOptions(n_ctx=512, n_parallel=1), max_loaded=2,
               settings={"max_tokens": 3, "temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0}) as s:
        client = s.openai()
        short = client.chat.completions.create(model=MODEL, messages=CHAT)
        assert short.usage.completion_tokens == 3  # the server's max_tokens
        longer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
        assert longer.usage.completion_tokens == 5  # the request's own
        # the starter samples at the server's temperature; "sampled:1" is greedy by its own metadata
        starter = {client.chat.completions.create(model=MODEL, messages=CHAT, seed=i).choices[0].message.content
                   for i in range(4)}
        greedy = {client.chat.completions.create(model="sampled:1", messages=CHAT, seed=i).choices[0].message.content
                  for i in range(4)}
        assert len(starter) > 1 and len(greedy) == 1
        shown = s.ollama().show("sampled:1").parameters or ""
        assert "temperature" in shown and " 0.0" in shown.split("temperature", 1)[1].splitlines()[0]
