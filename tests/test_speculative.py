"""Speculative decoding in the engine loop, with prompt lookup and with a draft model: drafts
verified in the batched decode give the reply the model gives without them (greedy: the same
tokens; sampled: the same distribution, by a chi-square test over many samples), drafting turns
itself down where it does not pay, a draft model with another vocabulary is refused, and every
front end reports what it drafted."""

from __future__ import annotations

import collections
import json
import math
import random
import threading
from pathlib import Path

import pytest

from localrun import api
from localrun.backends.base import Session
from localrun.backends.drafting import TRIAL_NGRAM, DraftControl, DraftRecord, PromptLookup, lookup
from localrun.generation import Request
from localrun.settings import GenerationParams, LoadOptions
from tests.conftest import ASSETS, assets_or_skip, serve_command

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


def test_a_sequence_that_has_kept_no_draft_drafts_only_after_a_match_of_three_tokens() -> None:
    """Prose repeats pairs of tokens ("of the") far more often than what followed them: the first
    draft of a sequence needs a 3-gram match (as llama.cpp's n-gram drafter asks), later ones 2."""
    index = PromptLookup([5, 1, 2, 7, 8, 3, 4, 9])
    index.extend([0, 1, 2])  # "1 2" occurred before; "0 1 2" did not
    assert index.draft(3) == [7, 8, 3]
    assert index.draft(3, TRIAL_NGRAM) == []
    index.extend([7, 8, 3])  # "7 8 3" did: after it came "4 9"
    assert index.draft(3, TRIAL_NGRAM) == [4, 9, 0]


def test_draft_length_follows_acceptance_and_drafting_stops_when_it_does_not_pay() -> None:
    c = DraftControl(draft_max=6, draft_min=2, window=12)
    assert c.wanted(100) == 4 and c.wanted(3) == 3 and c.wanted(1) == 0  # starts at 4; within room; never under min
    c.record(4, 4)
    assert c.size == 6  # doubled, up to draft_max
    c.record(6, 1)
    assert c.size == 2  # what was accepted, and one more
    c.record(2, 2)
    assert c.size == 4 and not c.off  # 7 of the window's 12 kept: it pays
    c.record(4, 0)
    assert c.off and c.wanted(100) == 0  # none of 4 kept, under half of min_rate: it stops early
    assert (c.drafted, c.accepted) == (16, 7)
    late = DraftControl(draft_max=8, min_rate=0.5, window=16)
    for _ in range(4):
        late.record(4, 1)  # a quarter kept: over half of min_rate, so the whole window is waited for
    assert late.off and late.drafted == 16


def test_sequences_after_drafts_that_did_not_pay_skip_the_trial_with_a_growing_backoff() -> None:
    """A draft model's trial costs its decodes: after sequences in a row turned drafting off, only
    every 2nd, 4th, 8th, 16th new one tries again; one whose drafting lasted a window resets that."""
    record = DraftRecord()

    def sequence(kept: int, drafted: int = 16) -> DraftControl:
        c = DraftControl(draft_max=8, min_rate=0.6, window=16)
        for i in range(drafted // 4):
            c.record(4, 4 if i < kept else 0)
        return c

    def starts(n: int) -> list[bool]:
        return [record.starts() for _ in range(n)]

    assert starts(3) == [True] * 3  # nothing measured: every sequence drafts
    failed = sequence(kept=0)
    assert failed.off
    record.finished(failed)
    assert starts(4) == [False, True, False, True]  # every 2nd
    record.finished(failed)
    assert starts(4) == [False, False, False, True]  # every 4th
    for _ in range(6):
        record.finished(failed)
    assert starts(16) == [False] * 15 + [True]  # at most every 16th
    record.finished(sequence(kept=1, drafted=4))  # too short to tell
    record.finished(DraftControl())  # never drafted
    record.finished(DraftControl(always=True, drafted=16, off=True))  # drafted whatever it cost
    assert starts(16) == [False] * 15 + [True]
    paid = sequence(kept=4)
    assert not paid.off and paid.drafted == 16
    record.finished(paid)
    assert starts(3) == [True] * 3


def test_a_steps_cost_per_position_is_remembered_when_recent_steps_are_all_one_size() -> None:
    """Drafted steps (several positions) are a few among many plain ones: once the plain ones fill
    the window, the slope measured from the drafted ones still prices a drafted token."""
    from localrun.backends.drafting import StepCost

    cost = StepCost()
    assert cost.fit() is None and cost.min_rate(1, 0.0, 0.3) == 0.3  # nothing measured: the default
    for positions in (1, 3, 1, 3, 1, 2):
        cost.record(positions, 0.010 + 0.005 * positions)  # a = 10 ms, b = 5 ms
    fitted = cost.fit()
    assert fitted is not None and fitted == pytest.approx((0.010, 0.005))
    for _ in range(300):  # the drafted steps' weight decays to nothing
        cost.record(1, 0.015)
    assert cost.fit() == pytest.approx((0.010, 0.005))
    assert cost.min_rate(1, 0.010, 0.6) == pytest.approx(1.0)  # a drafted token costs what a kept one saves
    never = StepCost()
    for _ in range(10):
        never.record(1, 0.015)
    assert never.fit() == pytest.approx((0.0135, 0.0015))  # never measured: a tenth of a step per position


def _reply(session: object, prompt: str, **params: object) -> tuple[str, object]:
    chunks = list(api.stream(session, api.build_messages(prompt), GenerationParams(**params)))  # type: ignore[arg-type]
    return "".join(c.text for c in chunks), chunks[-1]


@pytest.fixture(scope="module")
def session() -> object:
    """The starter with itself as its draft model: the only draft with its vocabulary here. A draft
    that costs what the model costs never pays, so drafting would turn itself down: the tests of
    verification ask for draft_always (the benchmark drafts with a smaller quantization instead)."""
    s = api.load(MODEL, LoadOptions(n_ctx=1024, n_parallel=8, draft=api.draft_file(MODEL)))
    yield s
    s.close()


def test_drafting_starts_only_where_kept_drafts_would_pay_well() -> None:
    """A step with d drafts, all kept, gives 1 + d tokens for 1 + min_rate x d steps' cost: drafts
    whose tokens cost nearly what they save (MLX on a CPU: about 0.9) are not made at all."""
    from localrun.backends.drafting import MIN_GAIN, worth_drafting

    assert worth_drafting(0.3, 8) and worth_drafting(0.6, 8) and not worth_drafting(0.9, 8)
    assert not worth_drafting(1.0, 8) and not worth_drafting(0.7, 1)  # one drafted token: at most 2 / 1.7 = 1.18x
    edge = (9 / MIN_GAIN - 1) / 8  # where 1 + 8 drafts gain exactly MIN_GAIN
    assert worth_drafting(edge - 1e-9, 8) and not worth_drafting(edge + 1e-9, 8)


@pytest.mark.parametrize("drafter", ["lookup", "model"])
def test_greedy_replies_are_the_same_with_and_without_drafts(session: object, drafter: str) -> None:
    for prompt in (REWRITE, PROSE):
        _reply(session, prompt, temperature=0, max_tokens=1)  # both sides then find the same cached prefix
        plain, plain_end = _reply(session, prompt, temperature=0, max_tokens=80)
        drafted, end = _reply(session, prompt, temperature=0, max_tokens=80, speculative=drafter, draft_always=True)
        assert drafted == plain
        assert end.completion_tokens == plain_end.completion_tokens  # type: ignore[attr-defined]
        if drafter == "model" or prompt == REWRITE:
            assert end.accepted_tokens > 0  # type: ignore[attr-defined]
    # the rewrite repeats its prompt: most drafted tokens are kept
    _, end = _reply(session, REWRITE, temperature=0, max_tokens=80, speculative="lookup")
    assert end.drafted_tokens >= 20 and end.accepted_tokens >= 0.6 * end.drafted_tokens  # type: ignore[attr-defined]
    _, plain_end = _reply(session, REWRITE, temperature=0, max_tokens=80)
    assert plain_end.drafted_tokens == 0  # type: ignore[attr-defined]


def _chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for a chi-square variable of df degrees of freedom (the regularized gamma series)."""
    a, y = df / 2, x / 2
    if y <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 1
    while term > 1e-15 * total and n < 10000:
        term *= y / (a + n)
        total += term
        n += 1
    return max(0.0, 1.0 - math.exp(-y + a * math.log(y) - math.lgamma(a)) * total)


def _homogeneity(a: list[str], b: list[str]) -> float:
    """The p-value of a chi-square test that two samples come from one distribution (outcomes whose
    expected count is under 5 are pooled)."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    cells: list[tuple[int, int]] = []
    rare = [0, 0]
    for k in set(ca) | set(cb):
        if (ca[k] + cb[k]) * min(len(a), len(b)) / (len(a) + len(b)) >= 5:
            cells.append((ca[k], cb[k]))
        else:
            rare = [rare[0] + ca[k], rare[1] + cb[k]]
    cells += [(rare[0], rare[1])] if sum(rare) else []
    x = 0.0
    for oa, ob in cells:
        ea, eb = (oa + ob) * len(a) / (len(a) + len(b)), (oa + ob) * len(b) / (len(a) + len(b))
        x += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return _chi2_sf(x, len(cells) - 1)


def test_the_chi_square_test_tells_distributions_apart() -> None:
    assert abs(_chi2_sf(11.07, 5) - 0.05) < 1e-3 and abs(_chi2_sf(3.841, 1) - 0.05) < 1e-3
    rng = random.Random(1)
    same = [rng.choice("aabbc") for _ in range(400)], [rng.choice("aabbc") for _ in range(400)]
    assert _homogeneity(*same) > 0.01
    assert _homogeneity([rng.choice("aabbc") for _ in range(400)], [rng.choice("aabbcc") for _ in range(400)]) < 0.01


STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside. One day, Lily saw "
         "a big red ball. Once upon a time, there was a little girl named Lily. She")


def test_sampled_replies_follow_the_models_distribution(stories: Path) -> None:
    """Drafts are kept only while the model's own sample at each position equals them, so sampled
    replies with drafts come from the model's distribution. 1000 replies (different seeds) of each
    drafter against 1000 without drafts: a chi-square test finds no difference (p > 0.001), while it
    tells temperature 1.0 from 0.6 apart (p < 1e-4): the test can see a shift that size. The model
    is the 260K-parameter Llama drafting for itself: the mechanism is the same for any model, and a
    tiny one samples 4000 replies in seconds."""
    s = api.load(str(stories), LoadOptions(n_ctx=1024, n_parallel=8, draft=str(stories)))
    request = Request.raw(STORY)

    def sample(seed0: int, temperature: float, speculative: str | None) -> tuple[list[str], int]:
        rows = [(i, request, GenerationParams(temperature=temperature, seed=seed0 + i, max_tokens=4,
                                              speculative=speculative, draft_always=True)) for i in range(1000)]
        out = [r for r in s.generate_many(rows) if hasattr(r, "text")]
        assert len(out) == 1000 and not [r.error for r in out if r.error]
        return [r.text for r in out], sum(r.accepted_tokens for r in out)

    try:
        plain, _ = sample(0, 1.0, None)
        for i, drafter in enumerate(("lookup", "model")):
            drafted, kept = sample(100_000 * (i + 1), 1.0, drafter)
            assert kept > 750, drafter  # drafts were kept: this is the path under test
            assert _homogeneity(plain, drafted) > 1e-3, drafter
        colder, _ = sample(300_000, 0.6, None)
        assert _homogeneity(plain, colder) < 1e-4
        # The mutant that keeps every draft (no check against the model's own sample) replies with
        # the lookup's proposal each time: the test must tell it apart
        mutant = [_lookup_reply(s, stories, request, 4)] * 1000
        assert _homogeneity(plain, mutant) < 1e-4, mutant[0]
    finally:
        s.close()


def _lookup_reply(session: Session, model: Path, request: Request, n: int) -> str:
    """The reply of an engine that accepted every draft: the prompt lookup's first n tokens."""
    from llama_cpp import Llama

    draft = PromptLookup(session.tokenize(request)).draft(n)
    assert len(draft) == n  # the story repeats: the lookup proposes a whole reply
    return Llama(str(model), vocab_only=True, verbose=False).detokenize(draft).decode("utf-8", "replace")


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
    assert bad.returncode != 0 and "draft model: model 'nonsense' is not installed" in bad.stderr
    with_model = cli("run", MODEL, PROSE, "--json", "--temperature", "0", "--max-tokens", "40",  # type: ignore[operator]
                     "--draft", MODEL, "--draft-always")
    assert with_model.returncode == 0, with_model.stderr
    record = json.loads(with_model.stdout)
    assert 0 < record["accepted_tokens"] <= record["drafted_tokens"]


def test_a_draft_model_with_another_vocabulary_is_refused(cli: object, stories: Path) -> None:
    """llama.cpp's rule: the same tokenizer type, BOS/EOS and token texts (SentencePiece 512 tokens
    against byte-level BPE 49152 here), refused at load with what differs and what to do."""
    out = cli("run", MODEL, "hi", "--draft", str(stories))  # type: ignore[operator]
    assert out.returncode == 2 and out.stdout == ""
    assert "draft model 'stories260K.gguf' cannot draft for this model: its tokenizer is of another type" in out.stderr
    assert "--draft lookup" in out.stderr


def test_vocabularies_compare_as_llama_cpp_compares_them() -> None:
    from localrun.backends.llama_draft import vocab_mismatch

    words = [f"t{i}".encode() for i in range(300)]
    base = {"type": 2, "add_bos": False, "bos": 1, "add_eos": False, "eos": 2, "n": 300, "text": words}
    assert vocab_mismatch(base, dict(base)) is None
    assert vocab_mismatch(base, {**base, "bos": 7}) is None  # a BOS that is never added does not matter
    assert vocab_mismatch({**base, "add_bos": True}, {**base, "add_bos": True, "bos": 7}) == "its BOS token is 7 and the target's 1"
    assert vocab_mismatch(base, {**base, "add_bos": True}) == "it adds a BOS token to a prompt and the target does not"
    assert vocab_mismatch(base, {**base, "text": [b"x", *words[1:]]}) is None  # the first 5 are not compared
    assert "token 5 differs" in (vocab_mismatch(base, {**base, "text": [*words[:5], b"x", *words[6:]]}) or "")
    longer = {**base, "n": 428, "text": words + [b"extra"] * 128}
    assert vocab_mismatch(base, longer) is None  # up to 128 tokens more
    assert "429 tokens" in (vocab_mismatch(base, {**longer, "n": 429, "text": [*longer["text"], b"y"]}) or "")


def test_a_preset_names_its_draft_model(cli: object, tmp_path: Path, starter: object) -> None:
    (tmp_path / "Modelfile").write_text(f"FROM {MODEL}\nPARAMETER draft {MODEL}\nPARAMETER draft_max 4\nPARAMETER draft_always true\n")
    made = cli("create", "drafty", "-f", str(tmp_path / "Modelfile"))  # type: ignore[operator]
    assert made.returncode == 0, made.stderr
    out = cli("run", "drafty", PROSE, "--json", "--temperature", "0", "--max-tokens", "30")  # type: ignore[operator]
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["accepted_tokens"] > 0
    shown = cli("show", "drafty", "--modelfile")  # type: ignore[operator]
    assert f"PARAMETER draft {MODEL}" in shown.stdout
    (tmp_path / "Ghost").write_text(f"FROM {MODEL}\nPARAMETER draft nothing-here:1b\n")
    ghost = cli("create", "ghost", "-f", str(tmp_path / "Ghost"))  # type: ignore[operator]
    assert ghost.returncode != 0 and "draft model: model 'nothing-here:1b' is not installed" in ghost.stderr


def test_serve_drafts_with_a_model_for_the_models_that_share_its_vocabulary(cli: object, stories: Path,
                                                                             starter: object) -> None:
    """`localrun serve --draft MODEL` as a user starts it, asked through the official clients: the
    starter's replies are drafted; a model with another vocabulary is served without drafts."""
    import httpx
    import ollama
    import openai

    assert cli("add", str(stories), "--name", "stories:260k").returncode == 0  # type: ignore[operator]
    with serve_command("--ctx", "512", "--parallel", "2", "--draft", MODEL, "--draft-always") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=30,
                                               messages=[{"role": "user", "content": PROSE}])
        details = reply.usage.completion_tokens_details
        assert details is not None and details.accepted_prediction_tokens > 0
        chat = ollama.Client(host=url, timeout=300).chat(model=MODEL, messages=[{"role": "user", "content": PROSE}],
                                                         options={"temperature": 0, "num_predict": 30})
        assert chat.message.content == reply.choices[0].message.content
        with httpx.Client(base_url=url, timeout=300) as http:
            raw = http.post("/api/generate", json={"model": MODEL, "prompt": PROSE, "stream": False,
                                                   "options": {"temperature": 0, "num_predict": 30}}).json()
            assert raw["accepted_tokens"] > 0
            other = http.post("/api/generate", json={"model": "stories:260k", "prompt": "Once upon a time", "raw": True,
                                                     "stream": False, "options": {"num_predict": 8}})
            assert other.status_code == 200 and other.json()["response"]
            assert "drafted_tokens" not in other.json()


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

    with serve(LoadOptions(n_ctx=512, n_parallel=2), settings={"speculative": "lookup"}) as s:
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

    with serve(LoadOptions(n_ctx=512, n_parallel=2)) as s:
        # no serve --draft: a request drafts when it asks, by name or with true (then lookup)
        asks = {}
        for asked in ("lookup", True, None):
            extra = {} if asked is None else {"speculative": asked}
            asks[asked] = s.openai().chat.completions.create(
                model=MODEL, temperature=0, max_tokens=30, extra_body=extra, messages=[{"role": "user", "content": REWRITE}])
        for asked in ("lookup", True):
            details = asks[asked].usage.completion_tokens_details
            assert details is not None and details.accepted_prediction_tokens > 0, asked
            assert asks[asked].choices[0].message.content == asks[None].choices[0].message.content
        assert asks[None].usage.completion_tokens_details is None
        generate = s.http().post("/api/generate", json={"model": MODEL, "prompt": REWRITE, "stream": False,
                                                        "speculative": "lookup",
                                                        "options": {"temperature": 0, "num_predict": 30}}).json()
        assert generate["accepted_tokens"] > 0


def test_the_tui_status_line_shows_the_last_replys_drafts() -> None:
    from tui.widgets.chat import StatusBar

    bar = StatusBar()
    bar.model, bar.state, bar.tokens_per_second, bar.drafts = MODEL, "ready", 120.0, (40, 31)
    assert bar.text() == f"{MODEL} │ ready │ 120.0 tok/s │ drafts 31/40 kept │ ctx 0"


def test_a_draft_that_costs_what_the_model_costs_turns_itself_down(session: object) -> None:
    """The starter drafting for itself costs about a step per drafted token, so it pays only if
    nearly every drafted token is kept: sampled prose keeps too few, and by default its reply stops
    drafting within one window of 16 drafted tokens (or never starts, once the costs are measured)."""
    params = {"temperature": 1.0, "seed": 3, "max_tokens": 80, "speculative": "model"}
    _, forced = _reply(session, PROSE, **params, draft_always=True)
    assert forced.drafted_tokens > 40 and forced.accepted_tokens < forced.drafted_tokens  # type: ignore[attr-defined]
    _, end = _reply(session, PROSE, **params)
    assert end.drafted_tokens <= 16 < forced.drafted_tokens  # type: ignore[attr-defined]


def _tiny_mamba(folder: Path) -> Path:
    """A random two-layer Mamba (a recurrent state, no KV cache) with Qwen3's tokenizer, converted by
    llama.cpp's own convert_hf_to_gguf.py."""
    import torch
    import transformers as tf

    from tests.convert.convert_helpers import (
        convert_reference,
        converter_cache,
        llama_cpp_converter_dir,
    )

    tok = tf.AutoTokenizer.from_pretrained(str(assets_or_skip(ASSETS / "tokenizers" / "qwen3")))
    config = tf.MambaConfig(vocab_size=(len(tok) + 7) // 8 * 8, hidden_size=64, state_size=8, num_hidden_layers=2,
                            expand=2, conv_kernel=4, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    tf.MambaForCausalLM(config).save_pretrained(folder / "hf")
    tok.save_pretrained(folder / "hf")
    return convert_reference(llama_cpp_converter_dir(converter_cache()), folder / "hf", folder / "mamba-tiny-f32.gguf",
                             "f32")


def test_a_model_whose_state_cannot_be_cut_decodes_without_drafts_and_says_so(cli: object, tmp_path: Path) -> None:
    """A rejected draft is cut from the KV cache; a recurrent state cannot be cut, so drafting on a
    Mamba model is off with a note, and the reply is the one without drafts. (Drafting there made
    llama_decode fail as soon as a draft was rejected.)"""
    model = str(_tiny_mamba(tmp_path))
    # the prompt's "two two two" is followed by "three": the reply's own "two two two" drafts it, rejected
    prompt = "two two two three four five. two two two three four five. Repeat: one two"
    common = ("run", model, prompt, "--raw", "--json", "--temperature", "0", "--max-tokens", "40")
    plain = cli(*common)  # type: ignore[operator]
    drafted = cli(*common, "--draft", "lookup", "--draft-always")  # type: ignore[operator]
    assert plain.returncode == 0 and drafted.returncode == 0, plain.stderr + drafted.stderr
    assert "speculative decoding is off for this model: its recurrent state cannot be cut" in drafted.stderr
    assert "speculative" not in plain.stderr
    record = json.loads(drafted.stdout)
    assert record["text"] == json.loads(plain.stdout)["text"]
    assert record.get("drafted_tokens", 0) == 0
