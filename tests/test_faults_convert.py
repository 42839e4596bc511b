"""SIGKILL during `convert` and `quantize`: nothing partial is registered or listed, and the next
run finds the dead run's temporary file and removes it.

The checkpoint is a wide random Llama (F32, ~300 MB) so that the output takes long enough to be
written for the test to see its temporary file on disk and kill the process then.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import disks, reliability
from tests.conftest import assets_or_skip

ASSETS = Path(__file__).resolve().parent.parent.parent / "shared" / "assets"
POLL_S = 0.005
POLL_ATTEMPTS = 24_000  # two minutes at most, on a loaded machine


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face Llama folder: random F32 weights (safetensors), the real Llama 2 tokenizer."""
    from safetensors.numpy import save_file

    tokenizer = assets_or_skip(ASSETS / "tokenizers" / "llama2-spm" / "tokenizer.model")
    folder = tmp_path_factory.mktemp("wide-llama")
    vocab, hidden, ffn, layers, heads = 32000, 768, 2048, 4, 12
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.model").write_bytes(tokenizer.read_bytes())
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(shape[-1] ** -0.5)

    tensors = {
        "model.embed_tokens.weight": w(vocab, hidden),
        "lm_head.weight": w(vocab, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{p}self_attn.{name}.weight"] = w(hidden, hidden)
        tensors[f"{p}mlp.gate_proj.weight"] = w(ffn, hidden)
        tensors[f"{p}mlp.up_proj.weight"] = w(ffn, hidden)
        tensors[f"{p}mlp.down_proj.weight"] = w(hidden, ffn)
        tensors[f"{p}input_layernorm.weight"] = np.ones(hidden, np.float32)
        tensors[f"{p}post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _start(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "localrun", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(os.environ),
    )


def _wait_for_temp(proc: subprocess.Popen[bytes], out: Path) -> Path:
    """Poll the output folder until the run's temporary file of out exists (the state to kill in)."""
    name = f".{out.name}.{proc.pid}.partial"
    for _ in range(POLL_ATTEMPTS):
        if (out.parent / name).exists():
            return out.parent / name
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            pytest.fail(
                f"the run ended (rc {proc.returncode}) before its temporary file was seen: {err[-2000:]}"
            )
        time.sleep(POLL_S)
    proc.kill()
    pytest.fail(f"no temporary file {name} after {POLL_ATTEMPTS} polls")


def _held_open(path: Path) -> bool:
    """Whether any process has path open (Linux /proc): a worker that outlived its parent would."""
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if os.readlink(fd) == str(path):
                    return True
        except OSError:  # a process that ended or that we may not inspect
            continue
    return False


def _kill_while_writing(out: Path, *args: str) -> Path:
    proc = _start(*args)
    try:
        temp = _wait_for_temp(proc, out)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stderr:
            proc.stderr.close()
    return temp


def _assert_nothing_registered(cli, out: Path) -> None:
    r = cli("list", "--json")
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    assert not [m for m in listed if Path(m["path"]).parent == out.parent or "partial" in m["path"]]
    assert not out.exists()


def _assert_rerun_cleans_up(cli, out: Path, temp: Path, *args: str) -> None:
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert not temp.exists()
    assert "removed 1 temporary file" in r.stderr and temp.name not in os.listdir(out.parent)
    assert [p for p in os.listdir(out.parent) if p.startswith(".")] == []
    assert Path(r.stdout.strip()) == out and out.is_file()
    listed = json.loads(cli("list", "--json").stdout)
    assert [m["path"] for m in listed if Path(m["path"]) == out] == [str(out)]


def test_sigkill_during_convert_registers_nothing_and_the_next_run_removes_its_temp(
    cli, wide_llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "wide-F16.gguf"
    args = ("convert", str(wide_llama), "-o", str(out), "--outtype", "f16", "--name", "wide:f16")
    temp = _kill_while_writing(out, *args)
    assert temp.exists()  # SIGKILL runs no cleanup: this is what the next run must find
    _assert_nothing_registered(cli, out)
    _assert_rerun_cleans_up(cli, out, temp, *args)
    reliability.fault("SIGKILL", "convert")


def test_sigkill_during_quantize_registers_nothing_and_the_next_run_removes_its_temp(
    cli, wide_llama: Path, tmp_path: Path
) -> None:
    import convert

    f16 = convert.convert(str(wide_llama), str(tmp_path / "wide-F16.gguf"), outtype="f16").path
    out = tmp_path / "wide-Q8_0.gguf"
    args = ("quantize", str(f16), "q8_0", "-o", str(out), "--name", "wide:q8_0")
    temp = _kill_while_writing(out, *args)
    # The llama.cpp worker dies with its parent instead of writing on.
    for _ in range(POLL_ATTEMPTS):
        if not _held_open(temp):
            break
        time.sleep(POLL_S)
    else:
        pytest.fail(f"{temp} is still open after its quantize was killed")
    left = temp.stat().st_size
    _assert_nothing_registered(cli, out)
    _assert_rerun_cleans_up(cli, out, temp, *args)
    assert left < out.stat().st_size  # an orphaned worker would have finished writing it
    reliability.fault("SIGKILL", "quantize")


def test_a_live_runs_temp_file_is_left_alone(tmp_path: Path) -> None:
    """Only a dead writer's files go: this process's own and a running one's stay."""
    from convert.writer import remove_stale_temps, temp_path

    out = tmp_path / "m.gguf"
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        files = {
            "mine": temp_path(out),
            "live": out.with_name(f".{out.name}.{sleeper.pid}.partial"),
            "dead": out.with_name(f".{out.name}.{dead.stdout.strip()}.partial"),
            "dead-f16": out.with_name(f".{out.name}.{dead.stdout.strip()}.F16"),
            "other output": out.with_name(f".other.gguf.{dead.stdout.strip()}.partial"),
        }
        for p in files.values():
            p.write_bytes(b"x" * 1000)
        assert remove_stale_temps(out) == 2000
        assert {k for k, p in files.items() if p.exists()} == {"mine", "live", "other output"}
    finally:
        assert sleeper.stdin is not None
        sleeper.stdin.close()
        sleeper.wait(timeout=30)


def test_sigkill_during_a_ladder_rung_registers_nothing_and_the_next_run_removes_its_temp(
    cli, wide_llama: Path, tmp_path: Path
) -> None:
    import convert

    f16 = convert.convert(str(wide_llama), str(tmp_path / "wide-F16.gguf"), outtype="f16").path
    text = tmp_path / "eval.txt"
    text.write_text((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
    ladder = tmp_path / "ladder"
    args = ("quantize", str(f16), "--ladder", "q8_0", "-o", str(ladder), "--text", str(text), "--imatrix",
            "none", "--name", "wide", "--ctx", "64", "--chunks", "2", "--bench", "8,2,1", "--threads", "2")
    ladder.mkdir()
    rung = ladder / "wide-Q8_0.gguf"
    temp = _kill_while_writing(rung, *args)
    for _ in range(POLL_ATTEMPTS):  # the quantize worker dies with the ladder
        if not _held_open(temp):
            break
        time.sleep(POLL_S)
    else:
        pytest.fail(f"{temp} is still open after its ladder was killed")
    assert temp.exists() and not rung.exists()
    state = ladder / "ladder.json"
    assert not state.exists() or json.loads(state.read_text())["rungs"] == []
    listed = json.loads(cli("list", "--json").stdout)
    assert not [m for m in listed if m["name"] == "wide:q8_0" or "partial" in m["path"]]

    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert "removed 1 temporary file" in r.stderr and not temp.exists()
    assert [p for p in os.listdir(ladder) if p.startswith(".")] == []
    [built] = json.loads(state.read_text())["rungs"]
    assert built["type"] == "q8_0" and Path(built["path"]) == rung and rung.stat().st_size == built["size"]
    listed = json.loads(cli("list", "--json").stdout)
    assert [m["path"] for m in listed if m["name"] == "wide:q8_0"] == [str(rung)]
    reliability.fault("SIGKILL", "a ladder rung")


def test_full_disk_during_convert_is_one_clear_error_and_registers_nothing(
    cli, wide_llama: Path, tmp_path: Path
) -> None:
    from localrun import api

    planned = api.convert_checkpoint(wide_llama, tmp_path / "plan.gguf", outtype="q8_0", dry_run=True).plan
    # Room for the output and the converter's own margin (16 MiB), so its check before the work
    # passes; the disk is then filled while the file is being written.
    size_mib = planned.gguf_bytes // 2**20 + 16 + 24
    with disks.small_disk(tmp_path / "out-disk", f"{size_mib}m") as disk:
        out = disk / "wide-Q8_0.gguf"
        args = ("convert", str(wide_llama), "-o", str(out), "--outtype", "q8_0", "--name", "wide:q8_0")
        before = cli("list", "--json").stdout
        proc = _start(*args)
        try:
            temp = _wait_for_temp(proc, out)
            proc.send_signal(signal.SIGSTOP)  # held while another program takes the rest of the disk
            written = temp.stat().st_size
            assert written < planned.gguf_bytes, "the conversion ended before the disk could be filled"
            filler = disks.fill(disk)
        finally:
            proc.send_signal(signal.SIGCONT)
        _, err_b = proc.communicate(timeout=300)
        err = err_b.decode()
        assert proc.returncode == 1, err
        assert "Traceback" not in err
        errors = [line for line in err.splitlines() if line.startswith("localrun: ")]
        assert len(errors) == 1, err
        assert f"cannot write the converted model to '{out}': the disk at {disk} is full" in errors[0]
        assert "nothing was registered" in errors[0] and "free some space" in err
        assert not temp.exists() and not out.exists() and os.listdir(disk) == ["filler"]
        assert cli("list", "--json").stdout == before

        filler.unlink()
        r = cli(*args)
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()) == out and out.stat().st_size > planned.gguf_bytes
        assert [m["path"] for m in json.loads(cli("list", "--json").stdout) if m["name"] == "wide:q8_0"] == [
            str(out)
        ]
    reliability.fault("full disk", "convert")
