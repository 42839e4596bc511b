"""Images in the chat: attached by /image PATH, by a pasted path or with the picker (Ctrl+F), shown
as chips, sent with the real tiny Qwen2-VL (and found in its cache on the next turn), kept through
save and restore; a bad path is an error notice, a text-only model's refusal is shown in place of
its reply and the chat goes on."""

from __future__ import annotations

import asyncio
import base64
import json
import sqlite3
import struct
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from textual import events

from localrun import api
from localrun.images import describe, pasted_image, unquoted
from tests.tui.helpers import wait_for
from tests.tui.test_flows import SIZE, ask, chat
from tests.vision_models import qwen2vl, test_image
from tui.attachments import Attachment
from tui.conversations import ConversationStore
from tui.screens.chat import ChatScreen
from tui.screens.image_picker import ImagePickerScreen
from tui.widgets.attachments import ImageChip, ImageChips, PendingImageChip
from tui.widgets.chat import ReplyError, UserMessage

VL = "vl:tiny"
PROMPT = "Describe this image."


def label(path: Path) -> str:
    return f"{path.name} · {describe(path.read_bytes())}"


def chips(screen: ChatScreen) -> list[str]:
    """The pending chips' text, as shown above the prompt."""
    return [str(c.render()) for c in screen.tray.query(PendingImageChip)]


async def command(pilot: Any, text: str) -> ChatScreen:
    """Submit text in the prompt that sends nothing (/image PATH, a path); returns once it is handled."""
    screen = chat(pilot.app)
    prompt = screen.query_one("#prompt")
    notices, items = len(pilot.app.notices), len(screen.tray.items)
    prompt.value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: len(screen.tray.items) != items or len(pilot.app.notices) > notices,
                   f"{text!r} to attach an image or say why not")
    return screen


async def open_chat(pilot: Any) -> ChatScreen:
    app = pilot.app
    await wait_for(pilot, lambda: "chat" in app.mode_screens and chat(app).conversation is not None,
                   "the chat with the model given on the command line")
    screen = chat(app)
    await wait_for(pilot, lambda: screen.query_one("#prompt").has_focus, "the prompt to take the keys")
    return screen


# -- without a model ----------------------------------------------------------------------------


def test_pasted_paths_are_images_only_when_the_whole_text_is_one(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cat = test_image(tmp_path / "my cat.png")
    (tmp_path / "notes.txt").write_text("not an image")
    assert unquoted(f"'{cat}'") == unquoted(f'"{cat}"') == unquoted(str(cat).replace(" ", "\\ ")) == str(cat)
    assert unquoted(cat.as_uri()) == str(cat)
    for text in (str(cat), f"  '{cat}'\n", "'~/my cat.png'", "~/my\\ cat.png", cat.as_uri()):
        assert pasted_image(text) == cat.expanduser(), text
    for text in (f"{cat} please", f"look at {cat}", "my cat.png", str(tmp_path / "notes.txt"),
                 str(tmp_path / "gone.png"), f"{cat}\n{cat}", "/", "What is the opposite of hot?"):
        assert pasted_image(text) is None, text


def test_images_are_stored_with_their_message_exported_and_deleted(tmp_path: Path) -> None:
    cat = test_image(tmp_path / "cat.png")
    dog = test_image(tmp_path / "dog.png", seed=1)
    store = ConversationStore(tmp_path / "c.sqlite3")
    c = store.create("vl:tiny")
    images = (Attachment("cat.png", cat.read_bytes()), Attachment("dog.png", dog.read_bytes()))
    store.add_exchange(c.id, "", "Two pictures.", {"images_encoded": 2}, images=images)
    store.add_exchange(c.id, "And now?", "Still two.")
    cat.unlink()  # the history keeps the bytes, not the path
    again = ConversationStore(tmp_path / "c.sqlite3").get(c.id)
    assert again.title == "cat.png, dog.png"  # an image sent alone titles the chat by its name
    assert again.turns[0].images == images and again.turns[2].images == ()
    assert again.history()[0] == {"role": "user", "content": "", "images": [a.data for a in images]}
    assert "images" not in again.history()[2]
    assert again.turns[0].images[0].label == f"cat.png · {describe(images[0].data)}"
    exported = store.export_json(c.id)["messages"][0]
    assert [base64.b64decode(b) for b in exported["images"]] == [a.data for a in images]
    assert exported["image_names"] == ["cat.png", "dog.png"]
    assert f"*[image {images[1].label}]*" in store.export_markdown(c.id)
    json.dumps(store.export_json(c.id))  # serialisable as the export writes it
    store.delete(c.id)
    with closing(sqlite3.connect(store.path)) as db:
        assert db.execute("SELECT COUNT(*) FROM attachments").fetchone()[0] == 0


# -- the real vision model --------------------------------------------------------------------


@pytest.mark.slow
def test_attach_send_the_next_turn_hits_the_cache_and_restore_sends_it_again(make_app: Any, tmp_path: Path) -> None:
    asyncio.run(_test_attach_send_restore(make_app, tmp_path))


async def _test_attach_send_restore(make_app: Any, tmp_path: Path) -> None:
    vm = qwen2vl()
    api.add_model(str(vm.gguf), name=VL, mmproj=str(vm.mmproj))
    cat = test_image(tmp_path / "pics" / "cat.png")
    params = {"temperature": 0, "seed": 1, "max_tokens": 8}
    app = make_app(settings=params, model=VL)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot)
        # /image PATH shows a chip; a click takes it off
        await command(pilot, f"/image {cat}")
        assert chips(screen) == [f"{label(cat)}  ×"] and screen.query_one("#prompt").value == ""
        await pilot.click(PendingImageChip)
        await wait_for(pilot, lambda: not screen.tray.items, "the chip to go")
        assert not screen.tray.display
        # a path pasted the way terminals paste a dropped file attaches it; Backspace takes it off
        prompt = screen.query_one("#prompt")
        prompt.post_message(events.Paste(f"'{cat}'"))
        await wait_for(pilot, lambda: len(screen.tray.items) == 1, "the pasted path to attach")
        assert prompt.value == "" and chips(screen) == [f"{label(cat)}  ×"]
        await pilot.press("backspace")
        await wait_for(pilot, lambda: not screen.tray.items, "Backspace to take the image off")
        # a typed path alone, sent with Enter, attaches too
        await command(pilot, f"  {cat}  ")
        assert chips(screen) == [f"{label(cat)}  ×"]

        await ask(pilot, PROMPT, typed=False)
        assert not screen.tray.items and not screen.tray.display
        assert screen.conversation is not None
        cid = screen.conversation.id
        first = app.conversations.get(cid)
        assert first.turns[0].images == (Attachment("cat.png", cat.read_bytes()),)
        assert first.turns[1].stats["images_encoded"] == 1 and first.turns[1].content
        shown = screen.query_one("#messages").children
        assert isinstance(shown[0], ImageChips) and isinstance(shown[1], UserMessage)
        assert [str(c.render()) for c in shown[0].query(ImageChip)] == [label(cat)]
        assert shown[1].text == PROMPT

        # the history sends the image again; the engine finds it in its cache
        await ask(pilot, "And the colours?", typed=False)
        second = app.conversations.get(cid).turns[3]
        assert second.stats["images_encoded"] == 0, second.stats
        assert second.stats["prompt_tokens"] > first.turns[1].stats["prompt_tokens"]

    cat.unlink()  # the conversation keeps the image, not its path
    app2 = make_app(settings=params)
    async with app2.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app2.screen, ChatScreen), "the chat screen")
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: type(app2.screen).__name__ == "ConversationsScreen", "the conversation list")
        await pilot.press("enter")
        screen = chat(app2)
        await wait_for(pilot, lambda: screen.conversation is not None, "the conversation to open")
        assert screen.conversation is not None and screen.conversation.id == cid
        assert [str(c.render()) for c in screen.query(ImageChip)] == [first.turns[0].images[0].label]
        assert [w.text for w in screen.query(UserMessage)] == [PROMPT, "And the colours?"]
        # a new engine has not seen the image: the restored conversation sends it, and it is encoded
        await ask(pilot, "Once more?", typed=False)
        third = app2.conversations.get(cid).turns[5]
        assert third.role == "assistant" and third.stats["images_encoded"] == 1, third.stats


# -- a text-only model ------------------------------------------------------------------------


@pytest.mark.slow
def test_bad_paths_are_notices_the_picker_attaches_and_a_text_model_refuses(make_app: Any, starter: Path,
                                                                           tmp_path: Path) -> None:
    asyncio.run(_test_refusal(make_app, tmp_path))


async def _test_refusal(make_app: Any, tmp_path: Path) -> None:
    pics = tmp_path / "pics"
    cat = test_image(pics / "cat.png")
    (pics / "notes.txt").write_text("not listed")
    fake = tmp_path / "fake.png"
    fake.write_text("not an image")
    app = make_app(settings={"temperature": 0, "seed": 1, "max_tokens": 8}, model="smollm2:135m")
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_chat(pilot)
        missing = tmp_path / "gone.png"
        await command(pilot, f"/image {missing}")
        assert app.notices[-1] == ("error", f"image '{missing}': no such file; give the path of an image file")
        assert screen.query_one("#prompt").value == f"/image {missing}"  # kept, to fix
        await command(pilot, f"/image '{fake}'")
        assert app.notices[-1][0] == "error" and "is not an image localrun can read" in app.notices[-1][1]
        assert not screen.tray.items

        # Ctrl+F: the picker opens in the given folder and lists folders and images only
        screen.picker_folder = pics
        await pilot.press("ctrl+f")
        await wait_for(pilot, lambda: isinstance(app.screen, ImagePickerScreen), "the image picker")
        tree = app.screen.query_one("#picker-tree")
        await wait_for(pilot, lambda: len(tree.root.children) == 1, "the folder's images")
        assert [str(n.label) for n in tree.root.children] == ["cat.png"]
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.screen is screen and len(screen.tray.items) == 1, "the picked image")
        assert chips(screen) == [f"{label(cat)}  ×"] and screen.picker_folder == pics

        await ask(pilot, PROMPT, typed=False)
        assert screen.conversation is not None
        assert app.conversations.get(screen.conversation.id).turns == ()
        error = screen.query_one(ReplyError)
        assert error.error.startswith("'smollm2:135m' does not support images")
        shown = screen.query_one("#messages").children
        assert [type(w) for w in shown] == [ImageChips, UserMessage, ReplyError]
        assert shown[1].has_class("-refused")
        assert screen.query_one("#prompt").value == PROMPT  # back, to send without the image
        assert not screen.tray.items and screen.status.state == "ready"

        # the chat goes on
        screen.query_one("#prompt").value = ""
        await ask(pilot, "What is the opposite of hot?", typed=False)
        turns = app.conversations.get(screen.conversation.id).turns
        assert [t.role for t in turns] == ["user", "assistant"] and turns[1].content
        assert turns[0].images == () and "images_encoded" not in turns[1].stats


# -- the picture -------------------------------------------------------------------------------


def png_header(width: int, height: int, size: int) -> bytes:
    """A PNG's signature and IHDR, padded to size: what a chip reads (the picture needs no pixels,
    and no encoder's version changes its size)."""
    head = b"\x89PNG\r\n\x1a\n" + struct.pack(">I4sII", 13, b"IHDR", width, height)
    return head + bytes(size - len(head))


def test_chat_with_images_snapshot(snap_compare: Any, make_app: Any, tmp_path: Path) -> None:
    """A sent image's chip above its message, and one waiting above the prompt."""
    dog = tmp_path / "dog.png"
    dog.write_bytes(png_header(640, 480, 48_213))

    async def before(pilot: Any) -> None:
        store = pilot.app.conversations
        conv = store.create("vl:tiny")
        store.add_exchange(conv.id, "What is in this picture?", "A *cat*.", {"images_encoded": 1},
                           images=(Attachment("cat.png", png_header(112, 84, 3_100)),))
        await pilot.press("f4")
        screen = chat(pilot.app)
        await screen.open_conversation(conv.id)
        await screen.attach(dog)
        await wait_for(pilot, lambda: len(screen.query(PendingImageChip)) == 1, "the pending chip")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=before)


# -- what the engine warns of ------------------------------------------------------------------


def test_the_engines_warning_about_a_model_is_shown_once(make_app: Any, tmp_path: Path) -> None:
    asyncio.run(_test_warning_once(make_app, tmp_path))


async def _test_warning_once(make_app: Any, tmp_path: Path) -> None:
    """A vision model whose projector file is gone runs as text: the chat says so when it loads,
    once, not with every reply."""
    vm = qwen2vl()
    projector = tmp_path / "mmproj-gone.gguf"
    projector.write_bytes(vm.mmproj.read_bytes())
    api.add_model(str(vm.gguf), name="vl:gone", mmproj=str(projector))
    projector.unlink()
    app = make_app(settings={"temperature": 0, "seed": 1, "max_tokens": 4}, model="vl:gone")
    async with app.run_test(size=SIZE) as pilot:
        await open_chat(pilot)
        await ask(pilot, "Hello", typed=False)
        await ask(pilot, "Hello again", typed=False)
    warning = f"vl:gone: its vision projector '{projector.resolve()}' is missing: it reads no images"
    assert [n for n in app.notices if n[0] == "warning"] == [("warning", warning)]
