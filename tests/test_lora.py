"""LoRA adapters at run time: registered linked to their base, applied per request on one loaded
base model (llama.cpp), by name, with --lora, in batch and in the server, and the errors a user meets.

The converter's own agreement with PEFT (logits) is in tests/convert/test_convert_lora.py; here the
adapters are converted the way a user converts them, and runs are compared with each other: an
adapter must change the output, the same adapter must give the same output on every path, and
sequences with different adapters decoded side by side must each equal their solo run.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from localrun import api, settings
from localrun.generation import Chunk, Request
from localrun.settings import GenerationParams, LoadOptions

from .lora_models import make_adapter, make_base

PROMPT = "Once upon a time"
GREEDY = GenerationParams(temperature=0, max_tokens=12)


def _with_adapters(lora: list[str]) -> GenerationParams:
    """The greedy settings with these adapters, as llama.cpp runs them (per request)."""
    return settings.resolve({"temperature": 0, "max_tokens": 12}, api.resolve_target("base:f32", lora), "llama.cpp")


@dataclass(frozen=True)
class Files:
    base: Path
    a1: Path
    a2: Path
    other: Path  # an adapter trained for a different (wider) model


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    root = tmp_path_factory.mktemp("lora")
    base = make_base(root / "base")
    wide = root / "wide"
    make_base(wide, seed=3)
    cfg = json.loads((wide / "config.json").read_text())
    # the same architecture with another width: shapes that do not fit the base
    import transformers as tf

    wide_model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**{**cfg, "hidden_size": 96, "intermediate_size": 160}))
    wide_model.save_pretrained(wide)
    return Files(base, make_adapter(base, root / "a1", seed=1), make_adapter(base, root / "a2", seed=2),
                 make_adapter(wide, root / "other", seed=4))


@pytest.fixture
def registered(files: Files, tmp_path: Path) -> Files:
    """The base converted to F32 and both adapters converted, all registered in this test's store."""
    out = tmp_path / "out"
    out.mkdir()
    api.convert_model(files.base, out / "base-f32.gguf", outtype="f32", name="base:f32")
    for name, folder in (("a1:lora", files.a1), ("a2:lora", files.a2)):
        _, info = api.convert_adapter(folder, out / f"{name.split(':')[0]}.gguf", name=name)
        assert info is not None and info.base == "base:f32"
    return files


def _reply(session, lora: list[str]) -> str:  # noqa: ANN001
    return "".join(c.text for c in session.stream(Request.raw(PROMPT), _with_adapters(lora)))


SETS = {"none": [], "a1": ["a1:lora"], "a2": ["a2:lora"], "a1-half": ["a1:lora:0.5"], "both": ["a1:lora", "a2:lora"],
        "a1-zero": ["a1:lora:0"]}


def test_adapters_change_the_output_and_mixed_batches_equal_solo_runs(registered: Files) -> None:
    session = api.load("base:f32", LoadOptions(n_ctx=256, n_parallel=4))
    try:
        solo = {k: _reply(session, v) for k, v in SETS.items()}
        assert len({solo[k] for k in ("none", "a1", "a2", "a1-half", "both")}) == 5, solo
        assert solo["a1-zero"] == solo["none"]  # scale 0 is the base
        together: dict[str, str] = {}
        threads = [threading.Thread(target=lambda k=k, v=v: together.__setitem__(k, _reply(session, v)))
                   for k, v in SETS.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert together == solo
        # One base model and its engine process served all of them.
        assert session.alive
    finally:
        session.close()


def test_cli_runs_an_adapter_by_name_with_lora_and_as_base_plus_adapter(registered: Files, cli) -> None:  # noqa: ANN001
    greedy = ["--raw", "--temperature", "0", "-n", "12", "--ctx", "256"]
    by_name = cli("run", "a1:lora", PROMPT, *greedy)
    assert by_name.returncode == 0, by_name.stderr
    flag = cli("run", "base:f32", PROMPT, "--lora", "a1:lora", *greedy)
    plus = cli("run", "base:f32+a1:lora", PROMPT, *greedy)
    bare = cli("run", "base:f32", PROMPT, *greedy)
    assert flag.stdout == by_name.stdout == plus.stdout
    assert bare.stdout != by_name.stdout

    listed = {m["name"]: m for m in json.loads(cli("list", "--json").stdout)}
    assert listed["a1:lora"]["kind"] == "adapter" and listed["a1:lora"]["base"] == "base:f32"
    assert "kind" not in listed["base:f32"]
    shown = cli("show", "a1:lora").stdout
    assert "LoRA adapter" in shown and "base:f32" in shown and "rank" in shown
    assert "a1:lora, a2:lora" in cli("show", "base:f32").stdout
    assert "LoRA adapter of base:f32" in cli("list").stdout


def test_batch_applies_lora_to_every_row(registered: Files, cli, tmp_path: Path) -> None:  # noqa: ANN001
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": PROMPT}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    done = cli("batch", "base:f32", "-i", str(rows), "-o", str(out), "--raw", "--lora", "a1:lora",
               "--temperature", "0", "-n", "12")
    assert done.returncode == 0, done.stderr
    texts = {json.loads(line)["text"] for line in out.read_text().splitlines()}
    single = cli("run", "a1:lora", PROMPT, "--raw", "--temperature", "0", "-n", "12", "--ctx", "256").stdout
    assert texts == {single.rstrip("\n")}


def test_server_switches_adapters_per_request_on_one_loaded_base(registered: Files) -> None:
    from .server.conftest import serve

    session = api.load("base:f32", LoadOptions(n_ctx=256, n_parallel=1))
    try:
        expected = {k: _reply(session, SETS[k]) for k in ("none", "a1", "a2", "both")}
    finally:
        session.close()
    with serve(LoadOptions(n_ctx=256, n_parallel=2)) as s:
        client = s.openai()

        def openai_text(lora: list[dict[str, object]] | None) -> str:
            r = client.completions.create(model="base:f32", prompt=PROMPT, max_tokens=12, temperature=0,
                                          extra_body={"lora": lora} if lora is not None else None)
            return str(r.choices[0].text)

        ollama = s.ollama()

        def ollama_text(model: str) -> str:
            return str(ollama.generate(model=model, prompt=PROMPT, raw=True,
                                       options={"temperature": 0, "num_predict": 12}).response)

        assert openai_text(None) == expected["none"]
        pid = s.pool.loaded()[0].pid
        assert openai_text([{"name": "a1:lora"}]) == expected["a1"]
        assert ollama_text("base:f32+a2:lora") == expected["a2"]
        assert ollama_text("a1:lora") == expected["a1"]  # an adapter's own name runs it on its base
        assert openai_text([{"name": "a1:lora"}, {"name": "a2:lora", "scale": 1.0}]) == expected["both"]
        assert openai_text([]) == expected["none"]
        loaded = s.pool.loaded()
        assert [m.name for m in loaded] == ["base:f32"] and loaded[0].pid == pid  # never reloaded

        bad = s.http().post("/v1/completions", json={"model": "base:f32", "prompt": PROMPT, "lora": [{"name": "base:f32"}]})
        assert bad.status_code == 400 and "not a LoRA adapter" in bad.text
        missing = s.http().post("/api/generate", json={"model": "base:f32+nope:lora", "prompt": PROMPT, "stream": False})
        assert missing.status_code == 404 and "nope:lora" in missing.text


def test_serve_lora_applies_to_requests_for_its_base(registered: Files) -> None:
    from .server.conftest import serve

    session = api.load("base:f32", LoadOptions(n_ctx=256))
    try:
        expected = {k: _reply(session, SETS[k]) for k in ("none", "a1")}
    finally:
        session.close()
    with serve(LoadOptions(n_ctx=256), lora=(("a1:lora", 1.0),)) as s:
        client = s.openai()
        r = client.completions.create(model="base:f32", prompt=PROMPT, max_tokens=12, temperature=0)
        assert r.choices[0].text == expected["a1"]
        r = client.completions.create(model="base:f32", prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"lora": []})
        assert r.choices[0].text == expected["none"]


def test_errors_name_the_problem_and_the_fix(registered: Files, cli, tmp_path: Path) -> None:  # noqa: ANN001
    not_adapter = cli("run", "base:f32", PROMPT, "--lora", "smollm2:135m", "--raw", "-n", "2")
    assert not_adapter.returncode != 0 and "is a model, not a LoRA adapter" in not_adapter.stderr
    assert "Traceback" not in not_adapter.stderr

    wrong_base = cli("run", "smollm2:135m", PROMPT, "--lora", "a1:lora", "--raw", "-n", "2")
    assert wrong_base.returncode != 0 and "cannot apply the LoRA adapter" in wrong_base.stderr, wrong_base.stderr

    peft = cli("run", "base:f32", PROMPT, "--lora", str(registered.a1), "--raw", "-n", "2")
    assert peft.returncode != 0 and f"localrun convert {registered.a1}" in peft.stderr

    shapes = cli("convert", str(registered.other), "--base", "base:f32", "-o", str(tmp_path / "other.gguf"))
    assert shapes.returncode != 0 and "Traceback" not in shapes.stderr, shapes.stderr
    assert not (tmp_path / "other.gguf").exists() and not list(tmp_path.glob(".other.gguf*"))

    orphan = tmp_path / "orphan.gguf"
    converted = cli("convert", str(registered.a1), "--base", str(registered.base), "-o", str(orphan),
                    "--name", "orphan:lora", "--no-register")
    assert converted.returncode == 0, converted.stderr
    api.add_model(orphan, name="orphan:lora")
    no_base = cli("run", "orphan:lora", PROMPT, "--raw", "-n", "2")
    assert no_base.returncode != 0 and "has no base model in the store" in no_base.stderr
    assert "localrun run BASE --lora orphan:lora" in no_base.stderr

    moved = tmp_path / "moved-adapter"
    moved.mkdir()
    for f in registered.a1.iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "someone/not-downloaded"
    (moved / "adapter_config.json").write_text(json.dumps(config))
    missing = cli("convert", str(moved))
    assert missing.returncode != 0 and "'someone/not-downloaded' is not here" in missing.stderr
    assert "--base" in missing.stderr and not list(moved.glob("*.gguf"))

    tui_without_model = cli("tui", "--lora", "a1:lora")
    assert tui_without_model.returncode != 0 and "--lora needs a MODEL" in tui_without_model.stderr


def test_an_adapter_converted_before_its_base_links_to_it_once_the_base_is_converted(files: Files, cli,  # noqa: ANN001
                                                                                      tmp_path: Path) -> None:
    first = cli("convert", str(files.a1), "-o", str(tmp_path / "a1.gguf"))
    assert first.returncode == 0 and f"convert it with 'localrun convert {files.base}'" in first.stderr
    early = cli("run", "a1:lora", PROMPT, "--raw", "-n", "2")
    assert early.returncode != 0 and f"localrun convert {files.base}" in early.stderr
    assert cli("convert", str(files.base), "--outtype", "f32", "-o", str(tmp_path / "b-f32.gguf")).returncode == 0
    assert "LoRA adapter of b:f32" in cli("list").stdout
    assert cli("run", "a1:lora", PROMPT, "--raw", "-n", "2", "--ctx", "256").returncode == 0


def test_the_loop_runs_one_adapter_set_per_step_and_never_reuses_another_sets_cache(registered: Files) -> None:
    from localrun.backends.llama_cpp import LlamaCppEngine
    from localrun.backends.loop import EngineLoop

    from .test_engine_loop import Record

    engine = LlamaCppEngine(api.get_model("base:f32"), LoadOptions(n_ctx=256, n_parallel=3))
    try:
        sink = Record()
        loop = EngineLoop(engine, sink)
        a1 = _with_adapters(["a1:lora"])
        order = [("x", a1), ("y", GREEDY), ("z", a1), ("w", GREEDY)]
        for rid, params in order:
            loop.submit(rid, Request.raw(PROMPT + " " + rid), params)
        groups = []
        while loop.busy:
            running = {j.rid: j.lora for j in loop.slots if j is not None}
            loop.step()
            if running:
                assert len(set(running.values())) == 1, running  # one adapter set per decode
                groups.append(tuple(sorted(running)))
        assert all(sink.final(rid) is not None for rid, _ in order)
        # x and z (a1) ran together first, then y and w, although y arrived before z
        assert groups[0] == ("x", "z") and groups[-1] == ("w", "y")

        # A cached prompt is reused only with the adapters that made its KV cache.
        other = "The quick brown fox jumps over the lazy dog"

        def run(rid: str, params: GenerationParams) -> Chunk:
            loop.submit(rid, Request.raw(other), params)
            while loop.busy:
                loop.step()
            final = sink.final(rid)
            assert final is not None
            return final

        first, bare, again = run("p-a1", a1), run("p-none", GREEDY), run("p-a1-again", a1)
        assert bare.cached_tokens <= 1 < again.cached_tokens  # at most the BOS token is shared
        assert sink.texts("p-a1-again") == sink.texts("p-a1") != sink.texts("p-none")
        assert first.cached_tokens <= 1
    finally:
        engine.close()


def test_tui_chats_with_base_plus_adapter_from_the_command_line(registered: Files) -> None:
    import asyncio

    from localrun.cli import build_parser
    from localrun.cli.tui import app_from_args
    from tests.tui.helpers import wait_for
    from tests.tui.test_flows import ask
    from tui.widgets.chat import AssistantMessage

    session = api.load("base:f32", LoadOptions(n_ctx=256))
    try:
        def reply(lora: list[str]) -> str:
            params = _with_adapters(lora)
            return "".join(c.text for c in session.stream(api.build_messages(PROMPT), params))

        with_adapter, bare = reply(["a1:lora"]), reply([])
    finally:
        session.close()
    assert with_adapter.strip() != bare.strip()
    app = app_from_args(build_parser().parse_args(["tui", "base:f32", "--lora", "a1:lora", "--temperature", "0",
                                                   "--max-tokens", "12", "--ctx", "256"]))

    async def run() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: "chat" in app.mode_screens and app.mode_screens["chat"].conversation,
                           "the chat opened from the command line")
            screen = app.mode_screens["chat"]
            assert screen.conversation.model == "base:f32+a1:lora"
            await ask(pilot, PROMPT)
            stored = app.conversations.get(screen.conversation.id)
            assert stored.turns[-1].content.strip() == with_adapter.strip()
            assert screen.query(AssistantMessage).last().source.strip() == with_adapter.strip()
            assert [m.name for m in app.models.loaded()] == ["base:f32"]

    try:
        asyncio.run(run())
    finally:
        app.models.close()
