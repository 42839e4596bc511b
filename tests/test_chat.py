"""Chat templates render like the reference Jinja output; hostile templates are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from localrun.chat import Message, StopMatcher, parse_messages, render_plain, render_template
from localrun.errors import BadModelFileError, UsageError

from .conftest import ASSETS, assets_or_skip

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour. 色は?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And another, with \"quotes\" and {braces}."},
]


def _templates() -> list[Path]:
    folder = assets_or_skip(ASSETS / "chat-templates")
    return sorted(folder.glob("*.jinja"))


def _reference(source: str, messages: list[dict[str, str]], **kw: object) -> str:
    """The transformers reference renderer (what Hugging Face's apply_chat_template uses)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=source, **kw)
    return rendered[0]


@pytest.mark.parametrize("path", _templates(), ids=lambda p: p.stem)
def test_real_templates_render_like_reference(path: Path) -> None:
    source = path.read_text()
    messages = CONVERSATION
    if "gemma" in path.stem.lower() or "mistral" in path.stem.lower():
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
    "{% set x = messages.append({'role': 'user', 'content': 'pwned'}) %}{{ messages }}",
    "{{ lipsum.__globals__['os'].system('true') }}",
    "{{ namespace.__init__.__globals__ }}",
]


@pytest.mark.parametrize("payload", SSTI)
def test_template_injection_is_refused(payload: str) -> None:
    with pytest.raises(BadModelFileError) as e:
        render_template(payload, [Message("user", "hi")])
    assert "refused" in str(e.value) or "failed" in str(e.value)


def test_template_raise_exception_is_an_error() -> None:
    with pytest.raises(BadModelFileError, match="only user turns"):
        render_template("{{ raise_exception('only user turns') }}", [Message("user", "x")])


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
