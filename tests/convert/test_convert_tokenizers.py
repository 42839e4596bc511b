"""llama.cpp tokenizes converted files exactly as the Hugging Face tokenizer does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from convert_helpers import ASSETS, MIXED_TEXT, llama_probe, need_asset

import convert
from convert.errors import ConvertError
from convert.pretokenizers import GPT2, LLAMA3, QWEN2, derive_pre


def vocab_inputs(name: str) -> tuple[list[str], list[str]]:
    """Inputs of ggml-vocab-NAME.gguf.inp and the expected ids of its .out (one line each)."""
    inp = need_asset("vocab", f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    out = need_asset("vocab", f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8")
    texts = inp.split("\n__ggml_vocab_test__\n")
    expected = out.split("\n")[: len(texts)]
    return texts, expected


def all_inputs() -> list[str]:
    texts = [MIXED_TEXT]
    for path in sorted((ASSETS / "vocab").glob("*.inp")):
        texts += path.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    return list(dict.fromkeys(texts))


def _parity(gguf: Path, tok, texts: list[str]) -> list[str]:  # noqa: ANN001
    got = llama_probe(gguf, tokenize=texts)
    bad = []
    for i, text in enumerate(texts):
        want = tok.encode(text, add_special_tokens=False)
        if list(got[f"tok{i}"]) != want:
            bad.append(repr(text[:40]))
    return bad


def _spm_folder(src: Path, dst: Path) -> Path:
    """The same checkpoint with only the SentencePiece tokenizer.model (no tokenizer.json)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "tokenizer.json":
            shutil.copy(f, dst / f.name)
    shutil.copy(need_asset("tokenizers", "llama2-spm", "tokenizer.model"), dst / "tokenizer.model")
    return dst


@pytest.mark.parametrize("variant", ["tokenizer.json", "tokenizer.model"])
def test_llama2_spm_parity(variant: str, checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, tok = checkpoints("llama")
    if variant == "tokenizer.model":
        folder = _spm_folder(folder, tmp_path / "spm")
    out = convert.convert(folder, tmp_path / "m.gguf", outtype="f16").path
    texts = all_inputs()
    assert _parity(out, tok, texts) == []
    # The llama.cpp reference vectors of the same vocabulary agree too.
    inputs, expected = vocab_inputs("llama-spm")
    got = llama_probe(out, tokenize=inputs)
    assert [" ".join(str(t) for t in got[f"tok{i}"]) for i in range(len(inputs))] == [
        e.strip() for e in expected
    ]


def test_qwen3_bpe_parity(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, tok = checkpoints("qwen3")
    out = convert.convert(folder, tmp_path / "m.gguf", outtype="f16").path
    assert _parity(out, tok, all_inputs()) == []


def test_qwen3_metadata(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    from gguf import GGUFReader

    folder, _, tok = checkpoints("qwen3")
    out = convert.convert(folder, tmp_path / "m.gguf", outtype="f16").path
    r = GGUFReader(out)

    def val(key: str):  # noqa: ANN202
        return r.fields[key].contents()

    assert val("tokenizer.ggml.model") == "gpt2"
    assert val("tokenizer.ggml.pre") == "qwen2"
    assert val("tokenizer.ggml.eos_token_id") == tok.eos_token_id
    assert val("tokenizer.ggml.eot_token_id") == tok.convert_tokens_to_ids("<|im_end|>")
    template = json.loads(need_asset("tokenizers", "qwen3", "tokenizer_config.json").read_text())[
        "chat_template"
    ]
    assert val("tokenizer.chat_template") == template
    types = val("tokenizer.ggml.token_type")
    assert types[tok.convert_tokens_to_ids("<|im_start|>")] == 3  # CONTROL
    assert len(val("tokenizer.ggml.merges")) > 100000


def _tj(pre: dict, ignore_merges: bool = False) -> dict:
    return {
        "pre_tokenizer": pre,
        "normalizer": None,
        "model": {"type": "BPE", "ignore_merges": ignore_merges},
    }


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _bytelevel(use_regex: bool) -> dict:
    return {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": use_regex,
    }


def test_pre_tokenizer_derived_from_definition() -> None:
    seq = {"type": "Sequence", "pretokenizers": [_split(LLAMA3), _bytelevel(False)]}
    assert derive_pre(_tj(seq, ignore_merges=True), None) == "llama-bpe"
    assert derive_pre(_tj(seq, ignore_merges=False), None) == "smaug-bpe"
    qwen = {"type": "Sequence", "pretokenizers": [_split(QWEN2), _bytelevel(False)]}
    assert derive_pre(_tj(qwen), False) == "qwen2"
    assert derive_pre(_tj(_bytelevel(True)), None) == "gpt-2"
    digits = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _bytelevel(True)],
    }
    assert derive_pre(_tj(digits), False) == "smollm"
    assert derive_pre(_tj(digits), True) == "starcoder"
    # llama.cpp's adapted spelling of the contractions is the same pre-tokenizer
    adapted = LLAMA3.replace(
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)", "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    )
    assert derive_pre(_tj(_split(adapted), ignore_merges=True), None) == "llama-bpe"


def test_unknown_pre_tokenizer_is_refused() -> None:
    odd = {"type": "Sequence", "pretokenizers": [_split(r"\p{L}+|\s+"), _bytelevel(False)]}
    with pytest.raises(ConvertError, match=r"matches none that llama.cpp implements"):
        derive_pre(_tj(odd), None)
    with pytest.raises(ConvertError, match="Whitespace"):
        derive_pre(_tj({"type": "Whitespace"}), None)


def test_gpt2_regex_is_what_bytelevel_splits_by() -> None:
    """derive_pre reads ByteLevel(use_regex) as the GPT2 regex: the two must split text alike."""
    from tokenizers import Regex, pre_tokenizers

    bytelevel = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(GPT2), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    texts = all_inputs()
    assert len(texts) > 10
    for text in texts:
        assert [w for w, _ in split.pre_tokenize_str(text)] == [w for w, _ in bytelevel.pre_tokenize_str(text)], text
