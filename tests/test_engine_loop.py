"""The engine loop on the real llama.cpp engine, driven step by step in this process: continuous
admission, chunked prompts between other sequences' tokens, one request cancelled among others,
prefix reuse across requests, the bounded queue. Steps are counted, never timed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from localrun import api
from localrun.backends.host_cache import common_prefix
from localrun.backends.llama_cpp import LlamaCppEngine
from localrun.backends.loop import EngineLoop
from localrun.errors import ContextOverflowError, LocalrunError, ServerBusyError
from localrun.generation import Chunk, Request, TokenLogprob
from localrun.settings import GenerationParams, LoadOptions

GREEDY = GenerationParams(temperature=0, max_tokens=24)


class Record:
    """A sink that keeps every event in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any, Any]] = []
        self.logprobs: dict[Any, list[TokenLogprob]] = {}  # with logprobs on: one per token delivered

    def text(self, rid: Any, text: str, logprobs: list[TokenLogprob], thinking: str = "") -> None:
        self.events.append(("text", rid, text))
        self.logprobs.setdefault(rid, []).extend(logprobs)

    def done(self, rid: Any, final: Chunk, text: str | None, logprobs: list[TokenLogprob] | None = None) -> None:
        self.events.append(("done", rid, final))

    def error(self, rid: Any, error: LocalrunError) -> None:
        self.events.append(("error", rid, error))

    def texts(self, rid: Any) -> str:
        return "".join(t for kind, r, t in self.events if kind == "text" and r == rid)

    def final(self, rid: Any) -> Chunk | None:
        return next((c for kind, r, c in self.events if kind == "done" and r == rid), None)


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaCppEngine]:
    e = LlamaCppEngine(api.get_model("smollm2:135m"), LoadOptions(n_ctx=1024, n_parallel=3, n_batch=16))
    yield e
    e.close()


def run_until(loop: EngineLoop, cond: Any, limit: int = 2000) -> int:
    """Step until cond() holds; returns the steps taken."""
    for n in range(limit):
        if cond():
            return n
        loop.step()
    raise AssertionError("the loop did not reach the state")


def alone(engine: LlamaCppEngine, request: Request, params: GenerationParams = GREEDY) -> str:
    rec = Record()
    loop = EngineLoop(engine, rec)
    loop.submit("x", request, params)
    run_until(loop, lambda: rec.final("x") is not None)
    return rec.texts("x")


def ask(text: str) -> Request:
    return api.build_messages(text, "You are a terse assistant.")


def test_requests_join_at_any_step_and_each_equals_its_solo_run(engine: LlamaCppEngine) -> None:
    prompts = ["Name a colour.", "What is two plus two?", "Say hello in French.", "Name a fruit."]
    solo = [alone(engine, ask(p)) for p in prompts]
    rec = Record()
    loop = EngineLoop(engine, rec)
    loop.submit(0, ask(prompts[0]), GREEDY)
    run_until(loop, lambda: rec.texts(0) != "")
    loop.submit(1, ask(prompts[1]), GREEDY)  # joins while 0 generates
    loop.step()
    loop.submit(2, ask(prompts[2]), GREEDY)
    loop.submit(3, ask(prompts[3]), GREEDY)  # three slots: this one waits in the queue
    assert loop.running() == 2 and len(loop.queue) == 2
    loop.step()
    assert loop.running() == 3 and len(loop.queue) == 1
    run_until(loop, lambda: not loop.busy)
    assert [rec.texts(i) for i in range(4)] == solo
    assert all(rec.final(i).finish_reason in ("stop", "length") for i in range(4))


def test_a_long_prompt_is_chunked_between_the_tokens_of_running_sequences(engine: LlamaCppEngine) -> None:
    rec = Record()
    loop = EngineLoop(engine, rec)
    loop.submit("short", ask("Count from one to fifty."), GenerationParams(temperature=0, max_tokens=200))
    run_until(loop, lambda: rec.texts("short") != "")
    long_prompt = ask(" ".join(f"word{i}" for i in range(150)) + " Summarise.")
    n_long = len(engine.prompt_tokens(long_prompt, []))
    assert n_long > 8 * 16
    before = sum(1 for k, r, _ in rec.events if k == "text" and r == "short")
    loop.submit("long", long_prompt, GenerationParams(temperature=0, max_tokens=4))
    run_until(loop, lambda: rec.texts("long") != "" or rec.final("long") is not None)
    during = sum(1 for k, r, _ in rec.events if k == "text" and r == "short") - before
    # n_batch is 16: the short sequence's token takes one place per step, the prompt the other 15.
    assert during >= n_long // 15 - 1
    run_until(loop, lambda: not loop.busy)


def test_cancelling_one_request_leaves_the_others_untouched(engine: LlamaCppEngine) -> None:
    solo = alone(engine, ask("Tell me about the sea."), GenerationParams(temperature=0, max_tokens=40))
    rec = Record()
    loop = EngineLoop(engine, rec)
    loop.submit("keep", ask("Tell me about the sea."), GenerationParams(temperature=0, max_tokens=40))
    loop.submit("drop", ask("Tell me about the mountains."), GenerationParams(temperature=0, max_tokens=40, logprobs=0))
    run_until(loop, lambda: len(rec.logprobs.get("drop", [])) >= 5)
    delivered = len(rec.logprobs["drop"])
    loop.cancel("drop")
    final = rec.final("drop")
    # Cancelled between steps: not one token more than the sink had.
    assert final is not None and final.finish_reason == "cancelled" and final.completion_tokens == delivered
    assert loop.running() == 1  # the cancelled sequence's slot is free at once
    run_until(loop, lambda: not loop.busy)
    assert rec.texts("keep") == solo


def test_the_next_turn_reuses_the_cached_prefix(engine: LlamaCppEngine) -> None:
    rec = Record()
    loop = EngineLoop(engine, rec)
    first = api.build_messages("What is the capital of France?", "You are a terse assistant.")
    loop.submit(1, first, GREEDY)
    run_until(loop, lambda: not loop.busy)
    n_first = rec.final(1).prompt_tokens
    reply = rec.texts(1)
    second = api.build_messages("And of Italy?", "You are a terse assistant.",
                                [{"role": "user", "content": "What is the capital of France?"},
                                 {"role": "assistant", "content": reply}])
    loop.submit(2, second, GREEDY)
    run_until(loop, lambda: not loop.busy)
    assert rec.final(2).cached_tokens >= n_first - 1
    assert rec.texts(2) == alone(engine, second)  # reuse changes nothing in the answer


def test_a_new_conversation_does_not_evict_another_that_shares_only_its_start(engine: LlamaCppEngine) -> None:
    """Conversations A and B share the system prompt and the template's header only. B goes to a
    free slot of its own (the shared start copied), so A's next turn still finds its whole cache."""
    rec = Record()
    loop = EngineLoop(engine, rec)
    a1 = ask("What is the capital of France?")
    loop.submit("a1", a1, GREEDY)
    run_until(loop, lambda: not loop.busy)
    held = rec.final("a1").prompt_tokens
    loop.submit("b1", ask("Name a large animal that lives in the sea."), GREEDY)
    run_until(loop, lambda: not loop.busy)
    assert rec.final("b1").cached_tokens > 0  # the shared start was not evaluated again
    a2 = api.build_messages("And of Italy?", "You are a terse assistant.",
                            [{"role": "user", "content": "What is the capital of France?"},
                             {"role": "assistant", "content": rec.texts("a1")}])
    loop.submit("a2", a2, GREEDY)
    run_until(loop, lambda: not loop.busy)
    assert rec.final("a2").cached_tokens >= held - 1


LONG_SYSTEM = " ".join(f"Rule {i}: answer in one short sentence about topic number {i}." for i in range(40))


def _turn(question: str, history: list[dict[str, str]], system: str = LONG_SYSTEM) -> Request:
    return api.build_messages(question, system, history)


def _doc(topic: str) -> str:
    return f"Here are my notes on {topic}. " + " ".join(f"Note {i}: {topic} fact {i} matters." for i in range(15))


def _conversation(cache_ram: int) -> tuple[Record, EngineLoop, dict[str, int]]:
    """One slot: conversation A, then B (another prompt, which takes the slot), then A's next turn;
    then a branch of A (its first question asked again with other notes), then A's third turn.
    Returns the sink, the loop and each request's cached tokens."""
    engine = LlamaCppEngine(api.get_model("smollm2:135m"), LoadOptions(n_ctx=2048, n_parallel=1))
    try:
        rec = Record()
        loop = EngineLoop(engine, rec, cache_ram=cache_ram)
        loop.min_save = 64

        def run(rid: str, request: Request) -> None:
            loop.submit(rid, request, GREEDY)
            run_until(loop, lambda: not loop.busy)

        run("a1", _turn(_doc("France"), []))
        run("b1", _turn("Name a large animal.", [], "You are a zoologist. " * 80))
        history = [{"role": "user", "content": _doc("France")}, {"role": "assistant", "content": rec.texts("a1")}]
        run("a2", _turn(_doc("Italy"), history))
        run("branch", _turn(_doc("Spain"), []))  # A's first turn asked otherwise
        history += [{"role": "user", "content": _doc("Italy")}, {"role": "assistant", "content": rec.texts("a2")}]
        run("a3", _turn(_doc("Germany"), history))
        cached = {rid: rec.final(rid).cached_tokens for rid in ("a1", "b1", "a2", "branch", "a3")}
        return rec, loop, cached
    finally:
        engine.close()


def test_an_evicted_conversation_and_a_branch_come_back_from_host_memory() -> None:
    """With one slot, B takes A's KV cache and a branch of A cuts it back; A's prefix, kept in
    host memory, is restored for its next turns, which then evaluate only their new tokens and
    answer exactly as without the host cache (where they evaluate again all but what B or the
    branch left in the slot)."""
    rec, loop, cached = _conversation(cache_ram=256)
    bare_rec, bare, bare_cached = _conversation(cache_ram=0)
    a1, a2 = rec.final("a1"), rec.final("a2")
    # B shares only the template's first tokens with A, the branch A's system prompt
    assert bare_cached["a2"] < 10 and bare_cached["a3"] <= bare_cached["branch"] + 8
    # with host memory, A's earlier turns and replies come back (all but the last reply token, never evaluated)
    assert cached["a2"] >= a1.prompt_tokens + a1.completion_tokens - 2
    assert cached["a3"] >= a2.prompt_tokens + a2.completion_tokens - 2
    assert loop.host.restored == 2 and loop.host.saved >= 2 and bare.host.saved == 0
    assert loop.prompt_tokens <= bare.prompt_tokens - a1.prompt_tokens
    for rid in ("a1", "b1", "a2", "branch", "a3"):
        assert rec.texts(rid) == bare_rec.texts(rid)  # restored caches change nothing in the answers


def test_a_request_arriving_during_a_shared_prompt_copies_it_instead_of_evaluating_it(engine: LlamaCppEngine) -> None:
    """Sub-agents sent at once: B arrives while A's prompt, which starts as B's does, is being
    evaluated (in chunks of 16 tokens here). B waits for it and copies the shared part, so the
    shared system prompt is evaluated once (beside each other, each evaluates it)."""
    a, b = _turn("Find the callers of parse_record.", []), _turn("List the tests of parser.py.", [])
    rec = Record()
    loop = EngineLoop(engine, rec, cache_ram=0)
    loop.min_save = 64
    loop.submit("a", a, GREEDY)
    loop.step()
    assert loop.running() == 1 and not loop.slots[next(s for s, j in enumerate(loop.slots) if j)].sampled
    loop.submit("b", b, GREEDY)
    run_until(loop, lambda: not loop.busy)
    fa, fb = rec.final("a"), rec.final("b")
    shared = common_prefix(engine.prompt_tokens(a, []), engine.prompt_tokens(b, []), 1 << 20)
    assert shared > 300 and fb.cached_tokens >= shared - 1
    assert loop.prompt_tokens <= fa.prompt_tokens + fb.prompt_tokens - shared + 1
    assert fa.finish_reason in ("stop", "length") and fb.finish_reason in ("stop", "length") and rec.texts("b")


def test_full_queue_and_overlong_prompt_are_errors_of_their_request(engine: LlamaCppEngine) -> None:
    rec = Record()
    loop = EngineLoop(engine, rec, max_queue=1)
    loop.submit("long", Request.raw("word " * 2000), GREEDY)
    assert isinstance(rec.events[-1][2], ContextOverflowError) and not loop.busy
    for i in range(4):  # three for the free slots, one to wait
        loop.submit(i, ask(f"Question {i}?"), GREEDY)
    loop.submit(4, ask("One more?"), GREEDY)
    errors = [(r, e) for k, r, e in rec.events if k == "error" and r != "long"]
    assert [r for r, _ in errors] == [4] and isinstance(errors[0][1], ServerBusyError)
    loop.step()
    assert loop.running() == 3 and len(loop.queue) == 1
    run_until(loop, lambda: not loop.busy)
    assert all(rec.final(i) is not None for i in (0, 1, 2, 3))


def test_threads_share_one_session_as_parallel_sequences() -> None:
    """Through the worker: concurrent streams from threads equal the same requests one by one."""
    session = api.load("smollm2:135m", LoadOptions(n_ctx=512, n_parallel=4))
    prompts = [f"Write one sentence about the number {i}." for i in range(6)]
    try:
        one_by_one = ["".join(c.text for c in session.stream(ask(p), GREEDY)) for p in prompts]
        got: dict[int, str] = {}

        def go(i: int) -> None:
            got[i] = "".join(c.text for c in session.stream(ask(prompts[i]), GREEDY))

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        session.close()
    assert [got[i] for i in range(len(prompts))] == one_by_one


def test_a_reply_that_breaks_its_constraint_is_an_error_never_a_finished_reply(
        engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar engine that disagrees with the model (here: its mask is not applied, so the model
    takes tokens the grammar refuses) ends the request with an error; the same request with the
    mask applied finishes with a valid reply."""
    from localrun.backends.grammar import GrammarState
    from localrun.constraint import Constraint

    grammar = Constraint.choice(["yes", "no"]).grammar
    params = GenerationParams(temperature=0, max_tokens=24, grammar=grammar)
    ok = Record()
    loop = EngineLoop(engine, ok)
    loop.submit("ok", ask("Write a poem about the sea."), params)
    run_until(loop, lambda: not loop.busy)
    final = ok.final("ok")
    assert final is not None and final.finish_reason == "stop" and ok.texts("ok") in ("yes", "no")

    monkeypatch.setattr(GrammarState, "mask_logits", lambda self, logits: None)
    rec = Record()
    loop = EngineLoop(engine, rec)
    loop.submit("broken", ask("Write a poem about the sea."), params)
    run_until(loop, lambda: not loop.busy)
    assert rec.final("broken") is None
    errors = [e for kind, r, e in rec.events if kind == "error" and r == "broken"]
    assert len(errors) == 1 and "broke its output constraint" in str(errors[0])
    assert all(engine.seqs[s] is None for s in range(engine.n_slots))


def test_a_reply_not_streamed_comes_whole_with_each_tokens_logprob() -> None:
    """Through the worker: a request started with stream=False is delivered as one text chunk and
    the final one, with the streamed reply's text and the logprob of every token."""
    session = api.load("smollm2:135m", LoadOptions(n_ctx=512, n_parallel=2))
    params = GenerationParams(temperature=0, max_tokens=24, logprobs=2)
    try:
        streamed = list(session.stream(ask("Name three rivers."), params))
        whole: list[Chunk] = []
        ticket = session.start(ask("Name three rivers."), params, whole.append, stream=False)
        assert ticket.wait(120)
    finally:
        session.close()
    assert ticket.error is None
    assert len(whole) == 2 and not whole[0].done and whole[1].done
    assert whole[0].text == "".join(c.text for c in streamed if not c.done)
    assert [lp.to_list() for lp in whole[0].logprobs] == [lp.to_list() for c in streamed for lp in c.logprobs]
    assert len(whole[0].logprobs) == whole[1].completion_tokens == streamed[-1].completion_tokens
