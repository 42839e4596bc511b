"""Reasoning formats on llama.cpp's real chat templates: detection, switches rendered through
localrun's own template sandbox, llama.cpp's own parser cases, and streaming cut anywhere."""

from __future__ import annotations

import json
import tarfile
from functools import lru_cache
from itertools import combinations, pairwise
from pathlib import Path

import pytest

from localrun import reasoning
from localrun.chat import Message, render_template, thinking_inputs
from localrun.reasoning import Split, detect
from localrun.reasoning.base import FORMATS, ReasoningFormat
from tests.convert.convert_helpers import (
    LLAMA_CPP_PYTHON,
    converter_cache,
    llama_cpp_converter_dir,
    need_asset,
)
from tests.reasoning_cases import ANSWER, CASES, OWN_CASES, THOUGHT, Case
from tests.test_families import defined_in

# Every real template of llama.cpp's collection that thinks, with its format; the others cannot.
THINKING = {
    "Apertus-8B-Instruct": "apertus", "Apriel-1.6-15b-Thinker-fixed": "apriel", "unsloth-Apriel-1.5": "apriel",
    "google-gemma-4-31B-it": "gemma4", "google-gemma-4-31B-it-interleaved": "gemma4", "Kimi-K3": "kimi-k3",
    "MiniMax-M3": "minimax-m3", "muse-glimmer": "glimmer", "tencent-Hy3": "hy3",
    "upstage-Solar-Open-100B": "solar-open",
    "Bielik-11B-v3.0-Instruct": "think", "ByteDance-Seed-OSS": "seed", "Cohere2MoE": "command-r",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": "command-r", "GLM-4.6": "think",
    "GLM-4.7-Flash": "think", "HuggingFaceTB-SmolLM3-3B": "think", "Kimi-K2-Thinking": "think",
    "LFM2.5-8B-A1B": "think", "MiniMax-M2": "think", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "think",
    "NVIDIA-Nemotron-Nano-v2": "think", "Qwen-QwQ-32B": "think", "Qwen-Qwen3-0.6B": "think",
    "Qwen3.5-4B": "think", "Reka-Edge": "think", "Spark2.5": "think", "StepFun3.5-Flash": "think",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "think", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "think",
    "deepseek-ai-DeepSeek-V3.1": "think", "deepseek-ai-DeepSeek-V3.2": "think",
    "deepseek-ai-DeepSeek-V4-Flash-0731": "think", "deepseek-ai-DeepSeek-V4": "think",
    "ibm-granite-granite-3.3-2B-Instruct": "granite", "inclusionai-ling-3.0-flash": "think",
    "llama-cpp-deepseek-r1": "think", "llama-cpp-rwkv-world": "think",
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral", "openai-gpt-oss-120b": "harmony",
    "openbmb-MiniCPM5-1B": "think", "poolside-Laguna-S-2.1": "think", "poolside-Laguna-XS-2.1": "think",
    "poolside-Laguna-XS.2": "think",
}
USER = [Message("system", "You are terse."), Message("user", "Hi")]


@lru_cache(maxsize=1)
def templates() -> dict[str, str]:
    """llama.cpp's real chat templates, read from the llama-cpp-python sdist (fetched once)."""
    cache = converter_cache()
    llama_cpp_converter_dir(cache)  # downloads the sdist when the cache lacks it
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/models/templates/"
    out = {}
    with tarfile.open(cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
        for m in tar:
            if m.name.startswith(prefix) and m.name.endswith(".jinja"):
                f = tar.extractfile(m)
                assert f is not None
                out[m.name[len(prefix):-len(".jinja")]] = f.read().decode()
    return out


def fmt_of(name: str) -> ReasoningFormat:
    fmt = detect(templates()[name])
    assert fmt is not None, name
    return fmt


def prompt(name: str, think: bool | str | None, messages: list[Message] = USER) -> str:
    """The generation prompt a template renders with the format's switch for think, applied as
    the engines apply it (chat.thinking_inputs)."""
    sw = fmt_of(name).switch(think)
    messages, variables = thinking_inputs(messages, sw.variables, sw.system_flag, {})
    return render_template(templates()[name], messages, bos_token="<s>", eos_token="</s>", **variables)


def streamed(fmt: ReasoningFormat, pieces: list[str], start_inside: bool) -> Split:
    s = fmt.splitter(start_inside)
    out = Split()
    for p in pieces:
        out += s.feed(p)
        for marker in (*fmt.opening, fmt.closing):
            assert marker not in out.thinking and marker not in out.answer
    return out + s.flush()


# -- detection -----------------------------------------------------------------------------------

def test_every_real_template_is_detected_as_it_thinks() -> None:
    assert len(templates()) >= 70
    found = {name: f.name for name, t in templates().items() if (f := detect(t))}
    assert found == THINKING
    assert not reasoning.can_think(templates()["meta-llama-Llama-3.1-8B-Instruct"])
    assert not reasoning.can_think(None)


def test_the_vocabulary_decides_a_template_that_only_strips_thoughts() -> None:
    # LFM2.5-Instruct names only </think> (to drop thoughts from history): it thinks only when
    # its vocabulary has <think> as one token, as the real Qwen3 tokenizer does
    config = json.loads(need_asset("tokenizers", "qwen3", "tokenizer.json").read_text())
    added = {t["content"] for t in config["added_tokens"]}
    assert "<think>" in added
    template = templates()["LFM2.5-Instruct"]
    assert detect(template) is None
    fmt = detect(template, added.__contains__)
    assert fmt is not None and fmt.name == "think"


def test_every_format_module_registers_its_format() -> None:
    defined = defined_in(reasoning, ReasoningFormat)
    assert sorted(c.__name__ for c in defined) == sorted(c.__name__ for c in FORMATS.all())
    assert {c.name for c in FORMATS.all()} == set(THINKING.values())


# -- switches, rendered ----------------------------------------------------------------------------

def test_qwen3_off_renders_an_empty_thought_and_on_leaves_it_to_the_model() -> None:
    fmt = fmt_of("Qwen-Qwen3-0.6B")
    assert fmt.can_switch_off and dict(fmt.switch(False).variables) == {"enable_thinking": False}
    on, off = prompt("Qwen-Qwen3-0.6B", True), prompt("Qwen-Qwen3-0.6B", False)
    assert on.endswith("<|im_start|>assistant\n") and not fmt.starts_inside(on)
    assert off == on + "<think>\n\n</think>\n\n" and not fmt.starts_inside(off)
    assert fmt.history_field == "reasoning_content"


@pytest.mark.parametrize("name", ["Qwen-QwQ-32B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
                                  "Qwen3.5-4B", "deepseek-ai-DeepSeek-V3.1"])
def test_templates_that_open_the_thought_in_the_prompt(name: str) -> None:
    fmt = fmt_of(name)
    on = prompt(name, True)
    assert on.rstrip().endswith("<think>") and fmt.starts_inside(on)
    if fmt.can_switch_off:
        off = prompt(name, False)
        assert off != on and not fmt.starts_inside(off)


def test_smollm3_reads_the_switch_from_its_variable_and_its_system_flag() -> None:
    fmt = fmt_of("HuggingFaceTB-SmolLM3-3B")
    assert fmt.switch(False).system_flag == "/no_think" and fmt.switch(True).system_flag == "/think"
    on, off = prompt("HuggingFaceTB-SmolLM3-3B", True), prompt("HuggingFaceTB-SmolLM3-3B", False)
    assert "Reasoning Mode: /think" in on and "Reasoning Mode: /no_think" in off
    assert off.endswith("<think>\n\n</think>\n") and not on.rstrip().endswith("</think>")


def test_gpt_oss_takes_an_effort_and_cannot_be_switched_off() -> None:
    fmt = fmt_of("openai-gpt-oss-120b")
    assert not fmt.can_switch_off and fmt.history_field == "thinking"
    assert "Reasoning: medium" in prompt("openai-gpt-oss-120b", None)
    for effort in ("low", "high"):
        assert f"Reasoning: {effort}" in prompt("openai-gpt-oss-120b", effort)
    assert prompt("openai-gpt-oss-120b", False) == prompt("openai-gpt-oss-120b", None)


def test_granite_and_seed_switches_change_the_prompt() -> None:
    granite, user = "ibm-granite-granite-3.3-2B-Instruct", [Message("user", "Hi")]
    assert "<think></think>" in prompt(granite, True, user) and "<think></think>" not in prompt(granite, False, user)
    seed = "ByteDance-Seed-OSS"
    assert fmt_of(seed).can_switch_off
    assert prompt(seed, False).endswith("</seed:think>") and not prompt(seed, None).endswith("</seed:think>")
    assert not fmt_of("mistralai-Ministral-3-14B-Reasoning-2512").can_switch_off


def test_gemma4_on_asks_for_a_thought_and_off_renders_an_empty_one() -> None:
    for name in ("google-gemma-4-31B-it", "google-gemma-4-31B-it-interleaved"):
        fmt = fmt_of(name)
        assert fmt.can_switch_off and fmt.history_field == "reasoning_content"
        on, off = prompt(name, True), prompt(name, False)
        assert "<|think|>" in on and on.endswith("<|turn>model\n") and not fmt.starts_inside(on)
        assert "<|think|>" not in off and off.endswith("<|turn>model\n<|channel>thought\n<channel|>")
        assert prompt(name, None) == off  # the template's default is off


def test_kimi_k3_opens_the_thought_unless_thinking_is_off() -> None:
    fmt = fmt_of("Kimi-K3")
    assert fmt.can_switch_off and dict(fmt.switch(False).variables) == {"thinking": False}
    on, off = prompt("Kimi-K3", True), prompt("Kimi-K3", False)
    assert on.endswith("<|open|>think<|sep|>") and fmt.starts_inside(on) and fmt.starts_inside(prompt("Kimi-K3", None))
    assert off.endswith("<|open|>response<|sep|>") and not fmt.starts_inside(off)
    assert "`thinking_effort=low`" in prompt("Kimi-K3", "low") and "`thinking_effort=max`" in on
    assert "`thinking_effort=max`" in prompt("Kimi-K3", "medium")  # the template rejects medium


def test_minimax_m3_modes() -> None:
    fmt = fmt_of("MiniMax-M3")
    on, off, adaptive = prompt("MiniMax-M3", True), prompt("MiniMax-M3", False), prompt("MiniMax-M3", None)
    assert on.endswith("<mm:think>") and fmt.starts_inside(on) and "thinking mode: enabled" in on
    assert off.endswith("</mm:think>") and not fmt.starts_inside(off) and "thinking mode: disabled" in off
    assert adaptive.endswith("]~b]ai\n") and not fmt.starts_inside(adaptive) and "thinking mode: adaptive" in adaptive


def test_hy3_and_solar_open_switch_by_reasoning_effort() -> None:
    hy3 = fmt_of("tencent-Hy3")
    assert prompt("tencent-Hy3", None).endswith("<think:opensource></think:opensource>")  # default no_think
    assert prompt("tencent-Hy3", False).endswith("<think:opensource></think:opensource>")
    for think, effort in ((True, "high"), ("low", "low"), ("medium", "high"), ("high", "high")):
        on = prompt("tencent-Hy3", think)
        assert on.endswith("<think:opensource>") and hy3.starts_inside(on) and f"reasoning_effort:{effort}" in on
    solar = fmt_of("upstage-Solar-Open-100B")
    assert solar.can_switch_off and solar.history_field == "reasoning"
    empty = "<|begin|>assistant<|think|><|end|><|begin|>assistant"
    assert prompt("upstage-Solar-Open-100B", False).endswith(empty)
    assert prompt("upstage-Solar-Open-100B", "low").endswith(empty)  # low thinks not at all, as written
    for think in (None, True, "medium", "high"):
        assert not prompt("upstage-Solar-Open-100B", think).endswith(empty)


def test_apertus_apriel_and_glimmer_switches() -> None:
    apertus = fmt_of("Apertus-8B-Instruct")
    assert apertus.can_switch_off and apertus.history_field is None
    assert "Deliberation: enabled" in prompt("Apertus-8B-Instruct", True)
    assert "Deliberation: disabled" in prompt("Apertus-8B-Instruct", False)
    for name, inside in (("Apriel-1.6-15b-Thinker-fixed", True), ("unsloth-Apriel-1.5", False)):
        fmt = fmt_of(name)
        assert not fmt.can_switch_off and fmt.starts_inside(prompt(name, True)) is inside
        assert prompt(name, False) == prompt(name, True)
    glimmer = fmt_of("muse-glimmer")
    assert not glimmer.can_switch_off and glimmer.history_field == "reasoning_content"
    assert "Reasoning strength: high." in prompt("muse-glimmer", None)
    assert "Reasoning strength: low." in prompt("muse-glimmer", "low")
    assert prompt("muse-glimmer", False) == prompt("muse-glimmer", None)


CALL = {"id": "c1", "type": "function", "function": {"name": "special_function", "arguments": {"arg1": 1}}}


@pytest.mark.parametrize(("name", "shown"), [
    ("google-gemma-4-31B-it", "<|channel>thought\nCALL-THOUGHT\n<channel|>"),
    ("google-gemma-4-31B-it-interleaved", "<|channel>thought\nCALL-THOUGHT<channel|>"),
    ("Kimi-K3", "<|open|>think<|sep|>CALL-THOUGHT<|close|>think<|sep|>"),
    ("MiniMax-M3", "<mm:think>CALL-THOUGHT</mm:think>"),
    ("tencent-Hy3", "<think:opensource>CALL-THOUGHT</think:opensource>"),
    ("upstage-Solar-Open-100B", "<|begin|>assistant<|think|>CALL-THOUGHT<|end|>"),
    ("muse-glimmer", "<|start|>assistant to=self<|message|>CALL-THOUGHT<|eom|>"),
])
def test_a_thought_before_a_call_reaches_the_template_under_its_history_field(name: str, shown: str) -> None:
    fmt = fmt_of(name)
    calling = [Message("user", "Call it"), Message("assistant", "", (CALL,), thinking="CALL-THOUGHT"),
               Message("tool", "ok", tool_call_id="c1", name="special_function")]
    tools = [{"type": "function", "function": {"name": "special_function", "description": "A tool",
                                               "parameters": {"type": "object", "properties": {"arg1": {"type": "integer"}}}}}]
    rendered = render_template(templates()[name], calling, history_field=fmt.history_field, tools=tools)
    assert shown in rendered
    assert shown not in render_template(templates()[name], calling, history_field=None, tools=tools)


# -- llama.cpp's own parser cases --------------------------------------------------------------------

def case_id(case: Case) -> str:
    return f"{case.template}:{case.line or 'own'}"


def split_of(case: Case) -> Split:
    fmt = fmt_of(case.template)
    inside = fmt.starts_inside(prompt(case.template, True if case.think is None else case.think))
    return fmt.split(case.raw, inside)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_llama_cpp_parser_cases_agree(case: Case) -> None:
    got = split_of(case)
    assert (got.thinking, got.answer, got.calls) == (case.thinking, case.answer, case.calls)


@pytest.mark.parametrize("case", OWN_CASES, ids=[case_id(c) for c in OWN_CASES])
def test_formats_without_llama_cpp_cases_split_at_their_templates_markers(case: Case) -> None:
    got = split_of(case)
    assert (got.thinking, got.answer, got.calls) == (case.thinking, case.answer, case.calls)


@pytest.mark.parametrize("case", CASES + OWN_CASES, ids=[case_id(c) for c in CASES + OWN_CASES])
def test_any_cut_of_the_stream_gives_the_whole_split(case: Case) -> None:
    fmt = fmt_of(case.template)
    inside = fmt.starts_inside(prompt(case.template, True if case.think is None else case.think))
    whole = fmt.split(case.raw, inside)
    raw = case.raw
    assert streamed(fmt, list(raw), inside) == whole  # one character a feed
    cuts = range(1, len(raw))
    for k in (1, 2):
        for at in combinations(cuts, k):
            bounds = (0, *at, len(raw))
            assert streamed(fmt, [raw[a:b] for a, b in pairwise(bounds)], inside) == whole, at


# -- streaming states, cut thoughts, budgets ---------------------------------------------------------

def test_a_split_marker_never_leaks_and_states_follow_the_stream() -> None:
    fmt = fmt_of("Qwen-Qwen3-0.6B")
    s = fmt.splitter(start_inside=False)
    assert s.feed("<th") == Split() and not s.opened
    assert s.feed("ink>\nI'm") == Split(thinking="I'm") and s.in_thought and s.opened
    assert s.feed("\nthinking\n</th") == Split(thinking="\nthinking") and s.in_thought
    assert s.feed("ink>") == Split() and s.closed and not s.in_thought
    assert s.feed("\n\nHello") == Split(answer="Hello")
    assert s.flush() == Split()


@pytest.mark.parametrize("name", sorted(set(THINKING) - {"LFM2.5-8B-A1B"}))
def test_a_cut_thought_flushes_as_thinking_and_the_budget_closing_ends_it(name: str) -> None:
    fmt = fmt_of(name)
    s = fmt.splitter(start_inside=True)
    assert s.in_thought
    part = s.feed("Step one, then step")
    assert s.in_thought and not s.closed
    assert part + s.flush() == Split(thinking="Step one, then step")  # cut by max_tokens
    s = fmt.splitter(start_inside=True)
    got = s.feed("Step one") + s.feed(fmt.closing_text) + s.feed(ANSWER)
    assert s.closed and not s.in_thought
    assert got + s.flush() == Split(thinking="Step one", answer=ANSWER)


def test_text_before_a_thought_is_all_answer_as_in_llama_cpp() -> None:
    fmt = fmt_of("Qwen-Qwen3-0.6B")
    raw = f"Sure. <think>{THOUGHT}</think>{ANSWER}"
    assert fmt.split(raw) == Split(answer=raw)
    assert fmt.split(f"  \n<think>{THOUGHT}</think>\n{ANSWER}") == Split(THOUGHT, ANSWER)


def test_minimax_m3_in_adaptive_mode_may_answer_after_a_bare_closing_marker() -> None:
    # llama.cpp's MiniMax-M3 cases set enable_thinking, which the template does not read: their
    # prompt is the adaptive one, which opens no thought
    fmt = fmt_of("MiniMax-M3")
    assert not fmt.starts_inside(prompt("MiniMax-M3", None))
    for raw, want in ((f"</mm:think>{ANSWER}", Split(answer=ANSWER)), (f"<mm:think>{THOUGHT}</mm:think>{ANSWER}",
                      Split(THOUGHT, ANSWER)), (ANSWER, Split(answer=ANSWER))):
        for at in range(1, len(raw)):
            assert streamed(fmt, [raw[:at], raw[at:]], False) == want, at
        s = fmt.splitter()
        s.feed(raw)
        assert s.closed is raw.startswith("<")


def test_a_raw_glimmer_reply_is_split_only_where_it_opens_a_thought() -> None:
    fmt = fmt_of("muse-glimmer")
    thought = f" to=self<|message|>{THOUGHT}<|eom|><|start|>assistant to=user<|message|>{ANSWER}<|eot|>"
    plain = f" to=user<|message|>{ANSWER}<|eot|>"
    for raw, want in ((thought, Split(THOUGHT, ANSWER)), (plain, Split(answer=plain))):
        s = fmt.raw_splitter()
        got = Split()
        for ch in raw:
            got += s.feed(ch)
        assert got + s.flush() == want


def test_harmony_tool_calls_go_whole_to_calls_after_the_thought() -> None:
    fmt = fmt_of("openai-gpt-oss-120b")
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    raw = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant{call}"
    s = fmt.splitter()
    got = Split()
    for ch in raw:
        got += s.feed(ch)
    got += s.flush()
    assert got == Split(thinking=THOUGHT, calls=call)
    assert s.closed and not s.in_thought


@lru_cache(maxsize=1)
def qwen3_guidance(path: str) -> object:
    """llguidance's tokenizer of the real Qwen3 vocabulary (built once: about 0.7 s)."""
    import llguidance

    return llguidance.LLTokenizer(Path(path).read_text())


# One template per format, for what every format must agree on.
ONE_PER_FORMAT = sorted({fmt: name for name, fmt in sorted(THINKING.items(), reverse=True)}.items())


@pytest.mark.parametrize(("fmt_name", "name"), ONE_PER_FORMAT, ids=[f for f, _ in ONE_PER_FORMAT])
def test_a_grammar_after_the_thought_takes_what_the_splitter_reads(fmt_name: str, name: str) -> None:
    """For every format, the grammar the engine puts around a schema (a thought, what follows its
    closing marker, the answer's head) accepts the reply a thinking budget makes (opening, thought,
    the format's closing text, answer) and a reply with no thought; the splitter reads the first
    into that thought and that answer. A format whose markers the grammar spelled otherwise than
    the splitter reads them would refuse its own model's replies, or let markup into the answer."""
    import llguidance

    from localrun.constraint import Constraint
    from localrun.tools.lark import after_thought, resolve_specials

    from .conftest import ASSETS

    fmt = fmt_of(name)
    assert fmt.name == fmt_name and fmt.opening and fmt.closing
    tok = qwen3_guidance(str(ASSETS / "tokenizers" / "qwen3" / "tokenizer.json"))

    def special_id(text: str) -> int | None:
        ids = tok.tokenize_str(text)
        return ids[0] if len(ids) == 1 and tok.is_special_token(ids[0]) else None

    lark = after_thought(Constraint.schema({"type": "object"}).grammar, fmt.opening[0], fmt.closing, False,
                         fmt.answer_head, fmt.closing_gap)

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(tok, resolve_specials(lark, special_id), log_level=0)
        ids = tok.tokenize_str(text)
        return m.validate_tokens(ids) == len(ids) and bool(m.consume_tokens(ids)) and m.is_accepting()

    budgeted = fmt.opening[0] + "Step one, step two" + fmt.closing_text + '{"a": 1}'
    assert accepts(budgeted) and accepts('{"a": 1}')
    got = fmt.split(budgeted)
    assert (got.thinking, got.answer) == ("Step one, step two", '{"a": 1}')
    # an answer under its head with no thought before it (harmony's final channel, Granite's <response>)
    headed = fmt.answer_head + '{"a": 1}'
    assert accepts(headed) and fmt.split(headed) == Split(answer='{"a": 1}')
