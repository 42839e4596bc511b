"""Speculative decoding with prompt lookup, in the engine loop: drafts verified in the batched
decode give the reply the model gives without them (greedy and sampled, one stream and several),
drafting turns itself down where it does not pay, and every front end reports what it drafted."""

from __future__ import annotations

import json
import random
import threading

import pytest

from localrun import api
from localrun.backends.drafting import DraftControl, PromptLookup, lookup
from localrun.generation import GenerationParams, LoadOptions

MODEL = "smollm2:135m"
PASSAGE = ("The lighthouse keeper climbed the stairs at dusk, lit the lamp, and wrote the weather in "
           "his log: wind from the west, a grey sea, two ships passing north before the rain.")
REWRITE = f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"
PROSE = "Write a short poem about a cat who learns to fly."


def test_the_index_drafts_what_a_search_of_the_history_finds() -> None:
    rng = random.Random(7)
    for _ in range(300):
        history = [rng.randrange(5) for _ in range(rng.randrange(1, 90))]
        cut = rng.randrange(len(history) + 1)
        index = PromptLookup(history[:cut])
        index.extend(history[cut:])
        for n in (1, 3, 8):
            assert index.draft(n) == lookup(history, n)
    assert lookup([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # what followed the n-gram's earlier occurrence
    assert lookup([1, 2, 3, 4], 3) == []


def test_draft_length_follows_acceptance_and_drafting_stops_when_it_does_not_pay() -> None:
    c = DraftControl(draft_max=6, draft_min=2, window=12)
    assert c.wanted(100) == 6 and c.wanted(3) == 3 and c.wanted(1) == 0  # never more than room, nor under min
    c.record(6, 6)
    assert c.size == 6
    c.record(6, 1)
    assert c.size == 2  # what was accepted, and one more
    c.record(2, 2)
    assert c.size == 3
    for _ in range(4):
        c.record(3, 0)
    assert c.off and c.wanted(100) == 0  # 2 kept of the 14 drafted in its last window: it stops
    assert (c.drafted, c.accepted) == (26, 9)


def _reply(session: object, prompt: str, **params: object) -> tuple[str, object]:
    chunks = list(api.stream(session, api.build_messages(prompt), GenerationParams(**params)))  # type: ignore[arg-type]
    return "".join(c.text for c in chunks), chunks[-1]


@pytest.fixture(scope="module")
def session() -> object:
    s = api.load(MODEL, LoadOptions(n_ctx=1024, n_parallel=4))
    yield s
    s.close()


def test_greedy_replies_are_the_same_with_and_without_drafts(session: object) -> None:
    for prompt in (REWRITE, PROSE):
        _reply(session, prompt, temperature=0, max_tokens=1)  # both sides then find the same cached prefix
        plain, plain_end = _reply(session, prompt, temperature=0, max_tokens=80)
        drafted, end = _reply(session, prompt, temperature=0, max_tokens=80, speculative="lookup")
        assert drafted == plain
        assert end.completion_tokens == plain_end.completion_tokens  # type: ignore[attr-defined]
    # the rewrite repeats its prompt: most drafted tokens are kept
    _, end = _reply(session, REWRITE, temperature=0, max_tokens=80, speculative="lookup")
    assert end.drafted_tokens >= 20 and end.accepted_tokens >= 0.6 * end.drafted_tokens  # type: ignore[attr-defined]
    _, plain_end = _reply(session, REWRITE, temperature=0, max_tokens=80)
    assert plain_end.drafted_tokens == 0  # type: ignore[attr-defined]


def test_sampled_replies_follow_the_models_distribution(session: object) -> None:
    """A draft is one token, so sampling each position as without drafts and keeping a draft while
    the sample equals it draws from the model's own distribution: with the same seed, the same reply
    (the same random draws on the same logits, up to the rounding of batched kernels)."""
    kept = 0
    _reply(session, REWRITE, temperature=0, max_tokens=1)  # both sides then find the same cached prefix
    for seed in range(8):
        params = {"temperature": 0.9, "seed": seed, "max_tokens": 40}
        plain, _ = _reply(session, REWRITE, **params)
        drafted, end = _reply(session, REWRITE, **params, speculative="lookup")
        assert drafted == plain, seed
        kept += end.accepted_tokens  # type: ignore[attr-defined]
    assert kept > 0


def test_parallel_streams_draft_in_one_batch(session: object) -> None:
    """Four streams draft in the same batched steps; each keeps its own KV cache straight (a
    rejected draft of one sequence cut from another's cache would garble its copy). Their text is
    not compared with solo runs: llama.cpp's kernels round differently for different batch sizes,
    which flips near-ties with or without drafts."""
    passages = [PASSAGE, PASSAGE.replace("lighthouse keeper", "baker"), PASSAGE.replace("dusk", "dawn"),
                PASSAGE.replace("west", "east")]
    got: list[tuple[str, object] | None] = [None] * len(passages)

    def run(i: int) -> None:
        got[i] = _reply(session, f"Repeat the following text exactly, word for word:\n\n{passages[i]}",
                        temperature=0, max_tokens=48, speculative="lookup")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(passages))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for passage, result in zip(passages, got, strict=True):
        assert result is not None
        text, end = result
        assert text.startswith(passage.split(",")[0]), text
        assert end.accepted_tokens >= 10  # type: ignore[attr-defined]


def test_run_reports_drafted_and_accepted_tokens(cli: object, starter: object) -> None:
    out = cli("run", MODEL, REWRITE, "--json", "--temperature", "0", "--max-tokens", "40",  # type: ignore[operator]
              "--draft", "lookup", "--draft-max", "6")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert record["drafted_tokens"] > 0 and 0 < record["accepted_tokens"] <= record["drafted_tokens"]
    bad = cli("run", MODEL, "hi", "--draft", "nonsense")  # type: ignore[operator]
    assert bad.returncode != 0 and "--draft" in bad.stderr


def test_batch_rows_and_both_apis_report_drafts(cli: object, tmp_path: object, starter: object) -> None:
    from pathlib import Path

    from tests.server.conftest import serve

    rows = Path(str(tmp_path)) / "in.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": REWRITE}) + "\n" for i in range(2)))
    out = Path(str(tmp_path)) / "out.jsonl"
    done = cli("batch", MODEL, "-i", str(rows), "-o", str(out), "--temperature", "0",  # type: ignore[operator]
               "--max-tokens", "30", "--draft", "lookup")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["drafted_tokens"] > 0 and r["accepted_tokens"] > 0 for r in records)

    with serve(LoadOptions(n_ctx=512, n_parallel=2), draft="lookup") as s:
        # serve --draft: every request drafts unless it says otherwise
        reply = s.openai().chat.completions.create(model=MODEL, temperature=0, max_tokens=30,
                                                   messages=[{"role": "user", "content": REWRITE}])
        details = reply.usage.completion_tokens_details
        assert details is not None and details.accepted_prediction_tokens > 0
        off = s.openai().chat.completions.create(model=MODEL, temperature=0, max_tokens=30, extra_body={"speculative": False},
                                                 messages=[{"role": "user", "content": REWRITE}])
        assert off.usage.completion_tokens_details is None
        assert off.choices[0].message.content == reply.choices[0].message.content
        chat = s.http().post("/api/chat", json={"model": MODEL, "stream": False, "messages": [
            {"role": "user", "content": REWRITE}], "options": {"temperature": 0, "num_predict": 30}}).json()
        assert chat["accepted_tokens"] > 0 and chat["drafted_tokens"] >= chat["accepted_tokens"]


def test_the_tui_status_line_shows_the_last_replys_drafts() -> None:
    from tui.widgets.chat import StatusBar

    bar = StatusBar()
    bar.model, bar.state, bar.tokens_per_second, bar.drafts = MODEL, "ready", 120.0, (40, 31)
    assert bar.text() == f"{MODEL} │ ready │ 120.0 tok/s │ drafts 31/40 kept │ ctx 0"
