"""Chat templates render like the reference Jinja output; hostile templates are refused."""

from __future__ import annotations

import pytest

from localrun.chat import Message, StopMatcher, parse_messages, render_plain, render_template
from localrun.errors import BadModelFileError, UsageError

from . import reliability
from .conftest import ASSETS, assets_or_skip

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour. 色は?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And another, with \"quotes\" and {braces}."},
]


TEMPLATES = ASSETS / "chat-templates"
# The real templates the shared assets hold (their README lists them): the cases are named here,
# not globbed, so a missing or empty folder fails these tests instead of leaving none to run.
TEMPLATE_NAMES = (
    "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "google-gemma-2-2b-it", "ibm-granite-granite-3.3-2B-Instruct", "meta-llama-Llama-3.1-8B-Instruct",
    "microsoft-Phi-3.5-mini-instruct", "mistralai-Mistral-Nemo-Instruct-2407",
)


def test_every_shared_template_is_a_case() -> None:
    folder = assets_or_skip(TEMPLATES)
    assert sorted(p.stem for p in folder.glob("*.jinja")) == sorted(TEMPLATE_NAMES)


def _reference(source: str, messages: list[dict[str, str]], **kw: object) -> str:
    """The transformers reference renderer (what Hugging Face's apply_chat_template uses)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=source, **kw)
    return rendered[0]


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_real_templates_render_like_reference(name: str) -> None:
    source = assets_or_skip(TEMPLATES / f"{name}.jinja").read_text()
    messages = CONVERSATION
    if "gemma" in name.lower() or "mistral" in name.lower():
        messages = CONVERSATION[1:]  # these templates reject or fold system turns differently
    kw = {"bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": True}
    ours = render_template(source, parse_messages(messages), **kw)  # type: ignore[arg-type]
    assert ours == _reference(source, messages, **kw)
    assert "Name a colour. 色は?" in ours


SSTI = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ self._TemplateReference__context.joiner.__init__.__globals__.os }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set x = messages[0].update({'content': 'pwned'}) %}{{ messages }}",
    "{{ lipsum.__globals__['os'].system('true') }}",
    "{{ namespace.__init__.__globals__ }}",
]


@pytest.mark.parametrize("payload", SSTI)
def test_template_injection_is_refused(payload: str) -> None:
    with pytest.raises(BadModelFileError) as e:
        render_template(payload, [Message("user", "hi")])
    assert "refused" in str(e.value) or "failed" in str(e.value)
    reliability.inputs("chat template")


def _mutable_reference(source: str, messages: list[dict[str, object]], **kw: object) -> str:
    """transformers' own rendering, in jinja2's mutable sandbox (its immutable one refuses these
    templates as localrun's did)."""
    from unittest import mock

    import jinja2.sandbox
    from transformers.utils import chat_template_utils as ctu

    ctu._compile_jinja_template.cache_clear()
    try:
        with mock.patch.object(ctu, "ImmutableSandboxedEnvironment", jinja2.sandbox.SandboxedEnvironment):
            return str(ctu.render_jinja_template(conversations=[messages], chat_template=source, **kw)[0][0])
    finally:
        ctu._compile_jinja_template.cache_clear()


@pytest.mark.parametrize("name", ["Kimi-K2-Thinking", "Kimi-K2-Instruct"])
def test_templates_that_queue_tool_call_ids_in_a_list_render(name: str) -> None:
    """Kimi K2's templates append each call's id to a list of their own and pop it for the tool's
    result: the sandbox lets a template change lists, on its own copy of the messages, so the
    conversation renders as transformers renders it in a mutable sandbox, and the caller's
    messages stay as they were."""
    from .test_reasoning import templates

    source = templates()[name]
    conversation: list[dict[str, object]] = [
        {"role": "user", "content": "Weather in Bern and the time?"},
        {"role": "assistant", "content": "", "reasoning_content": "Two calls.", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}},
            {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "12 C"},
        {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "noon"}]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("get_weather", "get_time")]
    messages = parse_messages(conversation)
    before = [m.to_dict("reasoning_content") for m in messages]
    ours = render_template(source, messages, history_field="reasoning_content", tools=tools)
    assert ours == _mutable_reference(source, before, add_generation_prompt=True, tools=tools)
    assert "## Return of functions.get_weather:0\n12 C" in ours and "## Return of functions.get_time:1\nnoon" in ours
    assert [m.to_dict("reasoning_content") for m in messages] == before
    # what a template appends to the messages it was given stays in its own copy
    appended = "{% set _ = messages.append({'role': 'user', 'content': 'more'}) %}{{ messages | length }}"
    assert render_template(appended, messages) == "5" and len(messages) == 4


def test_template_raise_exception_is_an_error() -> None:
    with pytest.raises(BadModelFileError, match="only user turns"):
        render_template("{{ raise_exception('only user turns') }}", [Message("user", "x")])
    reliability.inputs("chat template")


def test_plain_fallback() -> None:
    text = render_plain([Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello"),
                         Message("user", "Bye")])
    assert text == "Be brief.\nUser: Hi\nAssistant: Hello\nUser: Bye\nAssistant:"


def test_bad_messages() -> None:
    with pytest.raises(UsageError, match="role"):
        parse_messages([{"role": "wizard", "content": "x"}])
    with pytest.raises(UsageError, match="content"):
        parse_messages([{"role": "user"}])
    with pytest.raises(UsageError):
        parse_messages([])


def test_stop_matcher_holds_back_partial_matches() -> None:
    m = StopMatcher(["</end>", "STOP"])
    emitted = []
    for piece in ["Hello <", "/en", "d wor", "ld ST", "OP never"]:
        out, hit = m.feed(piece)
        emitted.append(out)
        if hit:
            break
    assert "".join(emitted) == "Hello </end wor" + "ld "
    assert hit


def test_stop_matcher_flushes_unmatched_tail() -> None:
    m = StopMatcher(["\nUser:"])
    out1, hit1 = m.feed("Answer\nUs")
    assert (out1, hit1) == ("Answer", False)
    assert m.flush() == "\nUs"


RUNAWAY = [
    # (template, what the error says)
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran for more than"),
    ("{% set x = 'ab' * 40000 %}{% for c in x %}{% for d in x %}{% endfor %}{% endfor %}", "ran for more than"),
    ("{{ 'a' * 1000000000 }}", "builds a value of 1000000000 items"),
    ("{{ [0] * 100000000 }}", "builds a value of 100000000 items"),
    ("{{ 7 ** 100000000 }}", "computes 7 ** 100000000"),
    ("{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "MB of memory"),
    ("{% for i in range(100000) %}{% for j in range(100) %}0123456789{% endfor %}{% endfor %}", "output passed"),
]


@pytest.mark.parametrize(("source", "reason"), RUNAWAY)
def test_runaway_templates_are_stopped_by_limits(source: str, reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import localrun.chat as chat

    # The time limit is the behaviour of the endless loops: keep those short. The other cases must
    # meet their own limit first however slow a loaded machine is: the time limit stays out of the way.
    monkeypatch.setattr(chat, "TEMPLATE_SECONDS", 0.5 if reason == "ran for more than" else 120.0)
    with pytest.raises(BadModelFileError) as e:
        render_template(source, parse_messages(CONVERSATION))
    assert "the model's chat template was stopped" in e.value.message and reason in e.value.message
    assert "--raw" in (e.value.hint or "")
    # the next render works: no limit or trace is left behind
    assert render_template("{{ messages[0]['content'] }}", parse_messages(CONVERSATION)) == CONVERSATION[0]["content"]
    reliability.inputs("chat template")


def test_a_long_conversation_is_not_a_runaway_template() -> None:
    long = "word " * 2_000_000  # 10 MB: above the minimum output limit, within 8x the messages
    out = render_template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
                          parse_messages([{"role": "user", "content": long}]))
    assert out == f"user: {long}\n"


def test_a_template_is_compiled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling a real thinking template takes about 20 ms here: a template is compiled on its
    first render and reused after (every request renders one)."""
    from jinja2 import Environment

    source = assets_or_skip(TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text() + "{# compiled-once probe #}"
    compiled = 0
    original = Environment.from_string

    def counting(self: Environment, *args: object, **kw: object) -> object:
        nonlocal compiled
        compiled += 1
        return original(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Environment, "from_string", counting)
    for _ in range(3):
        render_template(source, [Message("user", "hi")])
    assert compiled == 1
