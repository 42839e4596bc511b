"""A tiny random Qwen3 that can think: the real Qwen3 tokenizer and chat template, random weights,
converted to GGUF with localrun's converter.

Shared by the thinking tests of the engine loop, the CLI and the server (the session's `thinker`
fixture converts each template's model once). The weights are random, so what the model says is
driven by each test (a grammar at the engine level, or a prompt that opens the thought). The
checks below run the same on every engine, through the shared engine loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from localrun.generation import Chunk, Request
from localrun.settings import GenerationParams
from tests.conftest import ASSETS, assets_or_skip

if TYPE_CHECKING:
    from localrun.backends.loop import InProcess

TOKENIZER = ASSETS / "tokenizers" / "qwen3"
TEMPLATE = ASSETS / "chat-templates" / "Qwen-Qwen3-0.6B.jinja"
# DeepSeek-R1's distills open <think> in the prompt: a random model's reply is all thought until </think>.
R1_TEMPLATE = ASSETS / "chat-templates" / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"


# gpt-oss's harmony markup: special tokens of its vocabulary, added to the Qwen3 one for its template
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


def make_thinker(folder: Path, seed: int = 0, template: Path = TEMPLATE, special_tokens: tuple[str, ...] = ()) -> Path:
    """A 2-layer Qwen3 (hidden 64) with the Qwen3 tokenizer and a thinking template (Qwen3's by
    default), as an F32 GGUF; returns its path. The Hugging Face checkpoint is kept beside it, at
    the path without the suffix. special_tokens are added to the vocabulary as special tokens
    (the template's markup where the real model has it as such, as gpt-oss does)."""
    import torch
    import transformers as tf

    from localrun import api

    name = f"tiny-{template.stem}" + ("-special" if special_tokens else "")
    ckpt = folder / name
    tok = tf.AutoTokenizer.from_pretrained(str(assets_or_skip(TOKENIZER)))
    tok.chat_template = assets_or_skip(template).read_text()
    if special_tokens:
        tok.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    config = tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=len(tok), max_position_embeddings=2048,
                            rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    model.eval()
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    out = folder / f"{name}.gguf"
    api.convert_checkpoint(ckpt, out, outtype="f32")
    return out


# -- the same checks on every engine, through the engine loop -----------------------------------------

# The thought and the answer, held to a grammar from the first token (thinking off renders an
# already closed thought into the prompt, so the loop leaves the grammar as it is).
DRIVE = 'start: <<special:<think>>> /[a-z ]{0,%d}/ <<special:</think>>> /\\n{0,2}/ "Answer."'
SAMPLED = {"temperature": 1.0, "seed": 3}


def ask(think: bool | str | None = None) -> Request:
    return Request.chat([{"role": "user", "content": "Why is the sky blue?"}], think=think)


def run(ip: InProcess, request: Request, **params: object) -> tuple[list[Chunk], str, str]:
    """The reply's chunks, its thought and its answer (greedy unless params say otherwise)."""
    chunks = list(ip.stream(request, GenerationParams(**{"temperature": 0.0, **params})))  # type: ignore[arg-type]
    return chunks, "".join(c.thinking for c in chunks), "".join(c.text for c in chunks)


def prompt(ip: InProcess, request: Request) -> str:
    """The prompt the engine renders and tokenizes for a request, as text."""
    detok = ip.engine.detokenizer(True)
    return "".join(detok.feed(t) for t in ip.tokenize(request)) + detok.flush()


def check_the_switch_reaches_the_template(qwen3: InProcess) -> None:
    assert prompt(qwen3, ask(False)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt(qwen3, ask(True)).endswith("<|im_start|>assistant\n")
    # A client's chat_template_kwargs win over the request's switch.
    kw = Request.chat([{"role": "user", "content": "hi"}], think=True, template_kwargs={"enable_thinking": False})
    assert prompt(qwen3, kw).endswith("<think>\n\n</think>\n\n")


def check_thought_and_answer_stream_apart(qwen3: InProcess) -> None:
    chunks, thinking, answer = run(qwen3, ask(False), grammar=DRIVE % 40, max_tokens=80)
    final = chunks[-1]
    assert final.finish_reason == "stop"
    assert answer == "Answer."
    assert thinking and set(thinking) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert 0 < final.thinking_tokens <= final.completion_tokens
    # Every thought chunk comes before the first answer chunk; no piece of a marker is in either.
    first_answer = next(i for i, c in enumerate(chunks) if c.text)
    assert not any(c.thinking for c in chunks[first_answer:])
    for c in chunks:
        assert "<" not in c.text + c.thinking and ">" not in c.text + c.thinking


def check_a_cut_thought(qwen3: InProcess) -> None:
    chunks, thinking, answer = run(qwen3, ask(False), grammar=DRIVE.replace("{0,%d}", "{30,40}"), max_tokens=6)
    assert chunks[-1].finish_reason == "length"
    assert thinking and answer == ""
    assert chunks[-1].thinking_tokens == 5  # the opening marker, then five tokens inside


def check_the_budget(qwen3: InProcess, budget: int) -> None:
    chunks, thinking, answer = run(qwen3, ask(False), grammar=DRIVE % 200, max_tokens=120, think_budget=budget)
    final = chunks[-1]
    assert final.finish_reason == "stop" and answer == "Answer."
    assert final.thinking_tokens == budget
    assert len(qwen3.engine.text_tokens(thinking)) <= budget
    # Without the budget the same reply thinks longer.
    free = run(qwen3, ask(False), grammar=DRIVE % 200, max_tokens=120)[0][-1]
    assert free.thinking_tokens > budget


def check_a_prompt_that_opens_the_thought(r1: InProcess, budget: int) -> None:
    # DeepSeek-R1's template ends the prompt with "<think>\n": the random model's reply is thought
    # until the budget inserts </think>, then answer (sampled: greedy, it repeats whitespace).
    assert prompt(r1, ask()).endswith("<think>\n")
    chunks, thinking, answer = run(r1, ask(), max_tokens=40, think_budget=budget, **SAMPLED)
    final = chunks[-1]
    assert thinking and final.thinking_tokens == budget
    assert answer and "</think>" not in answer
    cut, thinking, answer = run(r1, ask(), max_tokens=8, **SAMPLED)
    assert cut[-1].finish_reason == "length" and thinking and answer == "" and cut[-1].thinking_tokens == 8
