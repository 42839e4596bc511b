"""Checkpoint formats, output types and the safety of the output file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import LOGIT_TEXT, gguf_reader, llama_probe, make_checkpoint, reference_logits
from gguf import GGMLQuantizationType as Q

import convert
from convert.errors import ConvertError


def _strict_logits(gguf_path: Path, folder: Path, tok) -> None:  # noqa: ANN001
    ids = [tok.bos_token_id or 0] + tok.encode(LOGIT_TEXT, add_special_tokens=False)[:120]
    ref = reference_logits(folder, ids)
    got = llama_probe(gguf_path, logits=[ids])["logits0"]
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert float(np.abs(got - ref).max()) < 1e-3 * float(ref.max() - ref.min())


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") or p.suffix == ".gguf")


@pytest.fixture(scope="module")
def bf16_sharded(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    folder = tmp_path_factory.mktemp("bf16-sharded")
    model, tok = make_checkpoint(folder, "llama", dtype="bfloat16", shard_size="1MB")
    return folder, model, tok


def test_sharded_bf16_auto_keeps_bf16_losslessly(bf16_sharded, tmp_path: Path) -> None:  # noqa: ANN001
    folder, model, _ = bf16_sharded
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    res = convert.convert(folder, tmp_path / "m.gguf")  # auto
    assert res.plan.written_type == "bf16"
    r = gguf_reader(res.path)
    t = {x.name: x for x in r.tensors}
    assert t["blk.0.ffn_down.weight"].tensor_type == Q.BF16
    assert t["blk.0.attn_norm.weight"].tensor_type == Q.F32
    src = model.state_dict()["model.layers.0.mlp.down_proj.weight"].view(
        dtype=__import__("torch").int16
    )
    assert np.array_equal(
        np.asarray(t["blk.0.ffn_down.weight"].data).view(np.int16).reshape(-1),
        src.numpy().reshape(-1),
    )


def test_sharded_bf16_to_f32_logits(bf16_sharded, tmp_path: Path) -> None:  # noqa: ANN001
    folder, model, tok = bf16_sharded
    out = convert.convert(folder, tmp_path / "m.gguf", outtype="f32").path
    _strict_logits(out, folder, tok)


def test_pickled_bin_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "bin"
    model, tok = make_checkpoint(folder, "qwen2", dtype="float16", safe=False)
    assert list(folder.glob("pytorch_model*.bin")) and not list(folder.glob("*.safetensors"))
    out = convert.convert(folder, tmp_path / "m.gguf", outtype="f32").path
    _strict_logits(out, folder, tok)


class _Evil:
    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_never_run(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    import torch

    src, _, _ = checkpoints("llama")
    folder = tmp_path / "evil"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((src / name).read_bytes())
    marker = tmp_path / "pwned"
    evil = _Evil()
    evil.marker = marker
    torch.save(
        {"model.embed_tokens.weight": torch.zeros(2, 2), "x": evil}, folder / "pytorch_model.bin"
    )
    with pytest.raises(ConvertError, match="refusing to load") as e:
        convert.convert(folder, tmp_path / "m.gguf")
    assert "pytorch_model.bin" in str(e.value)
    assert not marker.exists()
    assert not (tmp_path / "m.gguf").exists()
    # The payload is live: an unrestricted unpickler runs it (which is what the refusal prevents).
    torch.load(folder / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_missing_shard_is_named(bf16_sharded, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, _ = bf16_sharded
    copy = tmp_path / "partial"
    copy.mkdir()
    files = sorted(folder.iterdir())
    shards = sorted(f for f in files if f.suffix == ".safetensors")
    for f in files:
        if f != shards[-1]:
            (copy / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ConvertError, match=shards[-1].name):
        convert.convert(copy, tmp_path / "m.gguf")


def test_unsupported_architecture_lists_supported(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    src, _, _ = checkpoints("llama")
    folder = tmp_path / "gpt"
    folder.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError) as e:
        convert.convert(folder, tmp_path / "m.gguf")
    msg = str(e.value)
    assert "GPTNeoXForCausalLM" in msg and "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg


def test_existing_output_needs_force(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, _ = checkpoints("llama")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(ConvertError, match="already exists"):
        convert.convert(folder, out, outtype="f16")
    assert out.read_bytes() == b"keep me"
    convert.convert(folder, out, outtype="f16", force=True)
    assert out.read_bytes()[:4] == b"GGUF"
    assert _leftovers(tmp_path) == ["m.gguf"]


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_failure_midway_leaves_no_file(exc: BaseException, checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, _ = checkpoints("llama")
    seen = []

    def progress(p: convert.Progress) -> None:
        seen.append(p)
        if p.index == 5:
            raise exc

    with pytest.raises(type(exc)):
        convert.convert(folder, tmp_path / "m.gguf", outtype="f16", progress=progress)
    assert len(seen) == 5
    assert _leftovers(tmp_path) == []


def test_not_enough_space_fails_before_writing(checkpoints, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    import shutil

    from convert import writer

    folder, _, _ = checkpoints("llama")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda p: usage._replace(free=1_000_000))
    with pytest.raises(ConvertError, match="not enough disk space"):
        convert.convert(folder, tmp_path / "m.gguf", outtype="f16")
    assert _leftovers(tmp_path) == []


def test_dry_run_plans_without_writing(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, _ = checkpoints("llama")
    res = convert.convert(folder, tmp_path / "m.gguf", outtype="q8_0", dry_run=True)
    assert _leftovers(tmp_path) == []
    text = res.plan.describe()
    assert "token_embd.weight" in text and "Q8_0" in text and "blk.1.attn_norm.weight" in text
    real = convert.convert(folder, tmp_path / "m.gguf", outtype="q8_0")
    size = real.path.stat().st_size
    assert res.plan.final_bytes <= size < res.plan.final_bytes + 2_000_000  # + metadata
    assert [t.name for t in res.plan.tensors] == [t.name for t in gguf_reader(real.path).tensors]


def test_progress_reports_every_tensor(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, _ = checkpoints("llama")
    events: list[convert.Progress] = []
    res = convert.convert(folder, tmp_path / "m.gguf", outtype="f16", progress=events.append)
    assert [e.index for e in events] == list(range(1, len(res.plan.tensors) + 1))
    assert events[-1].bytes_done == events[-1].total_bytes == res.plan.gguf_bytes
    assert all(a.bytes_done <= b.bytes_done for a, b in zip(events, events[1:], strict=False))
