"""Behaviours the README documents, each tried through the real command line as a user would."""

from __future__ import annotations

import csv
import json
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

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


@dataclass(frozen=True)
class LoadReport:
    """What llama.cpp itself reported about a load: its log, and the context's threads by its getters."""

    log: list[str]
    threads: tuple[int, int]  # llama_n_threads, llama_n_threads_batch

    def setting(self, key: str) -> set[str]:
        """The values of a context parameter in llama.cpp's "llama_context: key = value" lines."""
        found = (re.match(rf"llama_context: {key}\s+= (\S+)", line) for line in self.log)
        return {m.group(1) for m in found if m}

    def layer_devices(self) -> list[str]:
        """The device llama.cpp assigned each layer to ("load_tensors: layer 3 assigned to device CPU")."""
        found = (re.match(r"load_tensors: layer\s+\d+ assigned to device (\S+?),", line) for line in self.log)
        return [m.group(1) for m in found if m]

    def flash_attention_in_graph(self) -> bool:
        """Whether the graph llama.cpp reserved computes attention with its flash-attention kernel."""
        return any("(FLASH_ATTN_EXT)" in line for line in self.log)


def _load_report(monkeypatch: pytest.MonkeyPatch, *flags: str) -> LoadReport:
    """Load the starter with the LoadOptions the CLI makes of these flags and keep llama.cpp's whole log."""
    from localrun import api
    from localrun.backends import llama_loader
    from localrun.backends.llama_cpp import LlamaCppBackend
    from localrun.cli import build_parser
    from localrun.cli.options import load_options_from_args

    options = load_options_from_args(build_parser().parse_args(["run", "smollm2:135m", "Hi", *flags]))
    monkeypatch.setattr(llama_loader.LOG, "tail", deque())  # every line of this load, not the last 40
    engine = LlamaCppBackend().load(api.get_model("smollm2:135m"), options)
    try:
        ll = llama_loader.library()
        return LoadReport(list(llama_loader.LOG.tail), (ll.llama_n_threads(engine.ctx), ll.llama_n_threads_batch(engine.ctx)))
    finally:
        engine.close()


def test_engine_flags_reach_the_engine(cli, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
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

    # What llama.cpp itself reports of each load: threads by its getters, the context and the
    # attention setting from its context report, the graph's attention kernel, each layer's device.
    # Each load sets every flag to another value than the other loads do.
    from localrun.backends.llama_loader import supports_gpu

    layers = 31  # the starter's 30 blocks and its output layer
    one = _load_report(monkeypatch, "--threads", "1", "--ctx", "512", "--flash-attn", "on", "--gpu-layers", "0")
    assert one.threads == (1, 1) and one.setting("n_ctx_seq") == {"512"}, (one.threads, one.setting("n_ctx_seq"))
    assert one.setting("flash_attn") == {"enabled"} and one.flash_attention_in_graph()
    assert one.layer_devices() == ["CPU"] * layers, one.layer_devices()
    two = _load_report(monkeypatch, "--threads", "2", "--ctx", "256", "--flash-attn", "off", "--gpu-layers", "99")
    assert two.threads == (2, 2) and two.setting("n_ctx_seq") == {"256"}, (two.threads, two.setting("n_ctx_seq"))
    assert two.setting("flash_attn") == {"disabled"} and not two.flash_attention_in_graph()
    devices = two.layer_devices()
    assert len(devices) == layers and ("CPU" not in devices if supports_gpu() else set(devices) == {"CPU"}), devices
    assert _load_report(monkeypatch, "--flash-attn", "auto").setting("flash_attn") == {"auto"}


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
