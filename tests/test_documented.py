"""Behaviours the README documents, each tried through the real command line as a user would."""

from __future__ import annotations

import csv
import json
from pathlib import Path

GREEDY = ["--temperature", "0", "--max-tokens", "6"]


def _json(res) -> dict:  # noqa: ANN001
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_raw_with_a_system_prompt_is_the_system_paragraph_then_the_prompt(cli) -> None:  # noqa: ANN001
    with_system = _json(cli("run", "smollm2:135m", "The capital of France is", "--raw", "--json",
                            "--system", "Answer in one word.", *GREEDY))
    by_hand = _json(cli("run", "smollm2:135m", "Answer in one word.\n\nThe capital of France is", "--raw", "--json",
                        *GREEDY))
    bare = _json(cli("run", "smollm2:135m", "The capital of France is", "--raw", "--json", *GREEDY))
    assert with_system["text"] == by_hand["text"]
    assert with_system["prompt_tokens"] == by_hand["prompt_tokens"] > bare["prompt_tokens"]


def test_engine_flags_reach_the_engine(cli) -> None:  # noqa: ANN001
    one = cli("run", "smollm2:135m", "Hi", "--raw", "--verbose", "--threads", "1", "--ctx", "512", *GREEDY)
    assert one.returncode == 0, one.stderr
    assert "1 threads, context 512" in one.stderr
    texts = set()
    for flags in (["--flash-attn", "on"], ["--flash-attn", "off"], ["--flash-attn", "auto"], ["--gpu-layers", "0"],
                  ["--gpu-layers", "99"]):
        res = _json(cli("run", "smollm2:135m", "The capital of France is", "--raw", "--json", *flags, *GREEDY))
        assert res["completion_tokens"] > 0
        texts.add(res["text"].strip().split()[0].strip(".,"))
    assert texts == {"Paris"}, texts  # the same answer whatever the attention kernel and offload
    bad = cli("run", "smollm2:135m", "Hi", "--gpu-layers", "some")
    assert bad.returncode == 2 and "--gpu-layers" in bad.stderr


def test_localrun_debug_shows_the_traceback_and_only_then(cli) -> None:  # noqa: ANN001
    plain = cli("run", "no-such-model:1b", "Hi")
    assert plain.returncode != 0 and "Traceback" not in plain.stderr
    assert plain.stderr.startswith("localrun: model 'no-such-model:1b' is not installed")
    debug = cli("run", "no-such-model:1b", "Hi", env={"LOCALRUN_DEBUG": "1"})
    assert debug.returncode == plain.returncode and "Traceback (most recent call last)" in debug.stderr
    assert "ModelNotFoundError" in debug.stderr


def test_batch_rows_keep_their_own_temperature_and_csv_is_chosen_by_flag(cli, tmp_path: Path) -> None:  # noqa: ANN001
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"id": "greedy", "prompt": "The capital of France is", "temperature": 0}) + "\n"
                    + json.dumps({"id": "hot", "prompt": "The capital of France is"}) + "\n")
    out = tmp_path / "out.txt"  # not .csv: --format decides
    done = cli("batch", "smollm2:135m", "-i", str(rows), "-o", str(out), "--raw", "--format", "csv",
               "--temperature", "1.8", "--seed", "3", "--max-tokens", "6")
    assert done.returncode == 0, done.stderr
    with open(out, newline="") as f:
        table = {r["id"]: r for r in csv.DictReader(f)}
    alone = _json(cli("run", "smollm2:135m", "The capital of France is", "--raw", "--json", *GREEDY))
    assert table["greedy"]["text"] == alone["text"]  # the row's temperature 0 beat --temperature 1.8
    assert set(table) == {"greedy", "hot"} and table["hot"]["finish_reason"] in ("stop", "length")
