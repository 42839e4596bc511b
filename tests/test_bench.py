"""`localrun bench`: llama-bench's tests on the real starter model, through the real CLI."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import statistics
import sys
from pathlib import Path

import pytest

from localrun.cli.bench import int_list
from localrun.workbench.bench import BenchSpec, _GlibcRand, run_bench


def test_json_has_every_setting_samples_mean_and_stddev_two_rows_per_thread_count(cli, starter: Path) -> None:
    r = cli("bench", str(starter), "-p", "16", "-n", "4", "-r", "2", "-t", "1,2", "--json")
    assert r.returncode == 0, r.stderr
    records = json.loads(r.stdout)  # stdout is the JSON and nothing else
    assert [(x["test"], x["n_threads"]) for x in records] == [("pp16", 1), ("tg4", 1), ("pp16", 2), ("tg4", 2)]
    for x in records:
        n = x["n_prompt"] + x["n_gen"]
        assert len(x["samples_ns"]) == len(x["samples_ts"]) == 2
        assert x["samples_ts"] == pytest.approx([1e9 * n / ns for ns in x["samples_ns"]])
        assert x["avg_ts"] == pytest.approx(statistics.fmean(x["samples_ts"]))
        assert x["stddev_ts"] == pytest.approx(statistics.stdev(x["samples_ts"]))
        assert x["avg_ts"] > 0
        assert (x["n_batch"], x["n_ubatch"], x["type_k"], x["type_v"], x["flash_attn"]) == (2048, 512, "f16", "f16", -1)
        assert x["model_filename"] == str(starter)
        assert x["model_size"] > 0 and x["model_n_params"] > 100_000_000
        assert x["backends"]
    assert "bench 1/4 (pp16" in r.stderr and "bench 4/4 (tg4" in r.stderr  # progress goes to stderr


def test_table_reports_both_phases_and_csv_has_a_header(cli, starter: Path) -> None:
    r = cli("bench", str(starter), "-p", "16", "-n", "4", "-r", "1", "-fa", "off")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["model", "size", "params", "backend", "threads", "fa", "test", "t/s"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[6] for row in rows] == ["pp16", "tg4"]
    assert all(row[5] == "0" and " ± " in row[7] and row[1].endswith("MiB") for row in rows)

    c = cli("bench", str(starter), "-p", "8", "-n", "0", "-r", "1", "--csv")
    assert c.returncode == 0, c.stderr
    header, *body = c.stdout.splitlines()
    fields = header.split(",")
    assert {"model", "test", "n_threads", "avg_ts", "stddev_ts", "avg_ns"} <= set(fields)
    assert len(body) == 1 and body[0].split(",")[fields.index("test")] == "pp8"


@pytest.mark.parametrize(("args", "code", "words"), [
    (["no-such-model"], 1, "no-such-model"),
    (["{starter}", "-t", "0"], 2, "-t"),
    (["{starter}", "-fa", "maybe"], 2, "on, off or auto"),
    (["{starter}", "-ctk", "q9_9"], 2, "-ctk"),
    (["{starter}", "-p", "0", "-n", "0"], 2, "nothing to measure"),
    (["{starter}", "-lm", "mmap", "-mmp", "1"], 2, "cannot be combined"),
])
def test_bad_model_or_flag_is_one_line_on_stderr(cli, starter: Path, args: list[str], code: int, words: str) -> None:
    r = cli("bench", *[a.format(starter=starter) for a in args])
    assert r.returncode == code
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and words in r.stderr


def test_a_model_llama_cpp_cannot_load_is_an_error_from_the_child(cli, tmp_path: Path) -> None:
    import gguf
    import numpy as np

    alien = tmp_path / "alien.gguf"  # well-formed, but of an architecture llama.cpp does not know
    w = gguf.GGUFWriter(str(alien), "nosucharch")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c", "d"])
    w.add_token_merges(["a b"])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = cli("bench", str(alien), "-p", "8", "-n", "0", "-r", "1")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "cannot load model" in r.stderr and "alien" in r.stderr


def test_cases_follow_llama_benchs_order() -> None:
    spec = BenchSpec(models=("a.gguf", "b.gguf"), n_prompt=(8,), n_gen=(4,), n_threads=(1, 2), flash_attn=(0, 1))
    order = [(Path(c.model_path).stem, c.flash_attn, c.n_threads, c.test) for c in spec.cases()]
    assert order[:5] == [("a", 0, 1, "pp8"), ("a", 0, 1, "tg4"), ("a", 0, 2, "pp8"), ("a", 0, 2, "tg4"), ("a", 1, 1, "pp8")]
    assert len(order) == 16 and order[8][0] == "b"


def test_number_lists_take_llama_benchs_ranges() -> None:
    parse = int_list(0)
    assert parse("1,2") == [1, 2]
    assert parse("1-4") == [1, 2, 3, 4]
    assert parse("0-64+32") == [0, 32, 64]
    assert parse("1-8*2") == [1, 2, 4, 8]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reference is glibc's rand()")
def test_random_tokens_are_glibcs_unseeded_rand_like_llama_bench() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.srand(1)
    ours = _GlibcRand()
    assert [ours() for _ in range(5000)] == [libc.rand() for _ in range(5000)]


def test_in_process_api_returns_records(starter: Path) -> None:
    records = run_bench(BenchSpec(models=(str(starter),), names=("starter",), n_prompt=(8,), n_gen=(2,),
                                  n_threads=(1,), repetitions=1, warmup=False))
    assert [(r.case.model, r.test, len(r.samples_ns)) for r in records] == [("starter", "pp8", 1), ("starter", "tg2", 1)]
    assert all(r.avg_ts > 0 and r.stddev_ts == 0 for r in records)


def test_run_all_runs_every_benchmark() -> None:
    """`make bench` (benchmarks/run_all.py) runs every benchmark script of the folder: those listed,
    and the workbench's parts through bench_workbench.py; the README quotes their figures."""
    import ast

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    tree = ast.parse((folder / "run_all.py").read_text())
    listed = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "BENCHES" for t in n.targets))
    through_workbench = {p.name for p in folder.glob("workbench_*.py")}
    helpers = {"run_all.py", "llama_tools.py"}
    scripts = {p.name for p in folder.glob("*.py")}
    assert scripts - helpers - through_workbench == set(listed)
    assert "bench_workbench.py" in listed and all((folder / name).exists() for name in listed)
