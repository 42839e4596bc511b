"""llama.cpp tokenizes converted files exactly as the Hugging Face tokenizer does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from convert_helpers import (
    ASSETS,
    MIXED_TEXT,
    converter_cache,
    gguf_reader,
    llama_cpp_converter_dir,
    llama_probe,
    need_asset,
    reference_gguf,
)

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
def test_llama2_spm_parity(variant: str, checkpoints, converted, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, tok = checkpoints("llama")
    if variant == "tokenizer.model":
        out = convert.convert(_spm_folder(folder, tmp_path / "spm"), tmp_path / "m.gguf", outtype="f16").path
    else:
        out = converted("llama", outtype="f16").path
    texts = all_inputs()
    assert _parity(out, tok, texts) == []
    # The llama.cpp reference vectors of the same vocabulary agree too.
    inputs, expected = vocab_inputs("llama-spm")
    got = llama_probe(out, tokenize=inputs)
    assert [" ".join(str(t) for t in got[f"tok{i}"]) for i in range(len(inputs))] == [
        e.strip() for e in expected
    ]


def test_qwen3_bpe_parity(checkpoints, converted) -> None:  # noqa: ANN001
    _, _, tok = checkpoints("qwen3")
    out = converted("qwen3", outtype="f16").path
    assert _parity(out, tok, all_inputs()) == []


def test_qwen3_metadata(checkpoints, converted) -> None:  # noqa: ANN001
    _, _, tok = checkpoints("qwen3")
    out = converted("qwen3", outtype="f16").path  # the file the parity test tokenizes with
    r = gguf_reader(out)

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


# --- classification by behaviour: byte-level exports, SentencePiece space schemes ---------------

def _llama_tokens(gguf: Path, texts: list[str]) -> list[list[int]]:
    """llama.cpp's tokens with special tokens parsed (as a chat prompt is), in a child process."""
    got = llama_probe(gguf, tokenize=texts, parse_special=True)
    return [got[f"tok{i}"].tolist() for i in range(len(texts))]


def _special_parity(gguf: Path, folder: Path, texts: list[str]) -> list[str]:
    """Texts that llama.cpp and the folder's Hugging Face tokenizer tokenize differently."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    got = _llama_tokens(gguf, texts)
    return [
        f"{t!r}: llama.cpp {g} HF {tok.encode(t, add_special_tokens=False)}"
        for t, g in zip(texts, got, strict=True)
        if g != tok.encode(t, add_special_tokens=False)
    ]


# Leading, repeated and trailing spaces, newlines and text right after special tokens.
SPACE_TEXTS = [
    "Hi",
    " Hi",
    "  Hi",
    "   three leading spaces",
    "a  b   c    d",
    "trailing spaces  ",
    "\nnewline first",
    "line one\nline two\n\n  indented\n",
    "\t tab then space",
    " \n \n",
    MIXED_TEXT,
]


def _with_specials(bos: str, eos: str) -> list[str]:
    return SPACE_TEXTS + [
        f"{bos}Hi",
        f"{bos} Hi",
        f"{bos}  two spaces",
        f"{bos}\nnewline",
        f"Hi{eos}there",
        f"Hi{eos} there",
        f"{eos}{bos}x",
        f"one {bos} two {eos}  three",
    ]


@pytest.fixture(scope="module")
def smollm2_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's real byte-level tokenizer as transformers exports it from the GGUF, beside a
    small random Llama of the same vocabulary, with the inert byte_fallback flag set as some
    exports write it."""
    import torch
    import transformers as tf

    from tests.conftest import starter_or_fail

    gguf_path = starter_or_fail()
    folder = tmp_path_factory.mktemp("smollm2-export")
    tok = tf.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(folder)
    config = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tj_path = folder / "tokenizer.json"
    tj = json.loads(tj_path.read_text(encoding="utf-8"))
    assert tj["pre_tokenizer"]["type"] == "ByteLevel"
    tj["model"]["byte_fallback"] = True
    tj_path.write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def smollm2_f16(smollm2_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export converted to F16 once, for the tests that only read the file."""
    out = tmp_path_factory.mktemp("smollm2-f16") / "m.gguf"
    return convert.convert(smollm2_export, out, outtype="f16").path


def test_byte_level_export_with_byte_fallback_flag(smollm2_export: Path, smollm2_f16: Path) -> None:
    from localrun.gguf_header import read_gguf

    out = smollm2_f16
    fields = gguf_reader(out).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    read_gguf(out)  # localrun's own check accepts what the converter wrote
    texts = all_inputs() + _with_specials("<|im_start|>", "<|im_end|>")
    texts.append("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert _special_parity(out, smollm2_export, texts) == []


def test_49152_token_vocabulary_says_it_adds_no_bos(
    smollm2_export: Path, smollm2_f16: Path, tmp_path: Path
) -> None:
    # SmolLM2's (and Granite 3's) tokenizer adds no BOS in transformers and its config does not
    # say so; llama.cpp's converter writes add_bos_token = false for that vocabulary size, and
    # so does localrun's: the same key, the same value, the same flag in llama.cpp.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_export))
    assert len(tok) == 49152 and tok.encode("Hi") == tok.encode("Hi", add_special_tokens=False)
    out = smollm2_f16
    key = "tokenizer.ggml.add_bos_token"
    assert gguf_reader(out).fields[key].contents() is False
    ref = reference_gguf(llama_cpp_converter_dir(converter_cache()), smollm2_export, tmp_path / "ref.gguf", "f16")
    assert ref.fields[key].contents() is False
    assert llama_probe(out, tokenize=["Hi"])["add_bos"].tolist() == [False]


# How each transformers writes "no normalizer" into tokenizer.json: 4.x an empty Sequence, 5.x null.
NO_NORMALIZER = {
    "transformers-5": None,
    "transformers-4.57": {"type": "Sequence", "normalizers": []},
    "nested": {"type": "Sequence", "normalizers": [{"type": "Sequence", "normalizers": []}]},
}


@pytest.mark.parametrize("how", list(NO_NORMALIZER))
def test_empty_normalizer_is_no_normalizer(how: str) -> None:
    from convert.pretokenizers import tokenizer_kind

    tj = _tj(_bytelevel(True)) | {"normalizer": NO_NORMALIZER[how], "decoder": _bytelevel(True)}
    assert derive_pre(tj, None) == "gpt-2"
    assert tokenizer_kind(tj) == "byte-level"
    # A real step inside the same Sequences is still read, and refused
    lower = {"type": "Sequence", "normalizers": [{"type": "Sequence", "normalizers": []}, {"type": "Lowercase"}]}
    with pytest.raises(ConvertError, match="with normalizer Lowercase"):
        derive_pre(tj | {"normalizer": lower}, None)


@pytest.mark.parametrize("how", ["transformers-5", "transformers-4.57"])
def test_smollm2_with_either_exports_normalizer_converts(smollm2_export: Path, tmp_path: Path, how: str) -> None:
    """SmolLM2's real tokenizer.json with "no normalizer" as each transformers writes it converts,
    and llama.cpp tokenizes the result as Hugging Face tokenizers does."""
    tj = _llama_tj(smollm2_export)
    tj["normalizer"] = NO_NORMALIZER[how]
    folder = _with_tokenizer_json(smollm2_export, tmp_path / "export", tj)
    from tokenizers import Tokenizer

    # the export is really written that way (tokenizers keeps an empty Sequence as a Sequence)
    assert (Tokenizer.from_file(str(folder / "tokenizer.json")).normalizer is None) == (how == "transformers-5")
    out = convert.convert(folder, tmp_path / "m.gguf", outtype="f16").path
    texts = all_inputs() + _with_specials("<|im_start|>", "<|im_end|>")
    assert _special_parity(out, folder, texts) == []


def _with_tokenizer_json(src: Path, dst: Path, tj: dict) -> Path:
    """The checkpoint at src with another tokenizer.json."""
    shutil.copytree(src, dst)
    (dst / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    return dst


METASPACE_FIRST = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}


def _llama_tj(folder: Path) -> dict:
    return json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "variant",
    [
        "transformers",  # Metaspace 'always' behind a normalizer that doubles a leading ▁
        "prepend",  # Llama 2's own tokenizer.json: Prepend(▁) + Replace(' ', ▁)
        "never",  # Metaspace 'never': no prefix anywhere
    ],
)
def test_sentencepiece_json_spaces_and_specials(
    variant: str, checkpoints, converted, tmp_path: Path  # noqa: ANN001
) -> None:
    folder, _, _ = checkpoints("llama")
    tj = _llama_tj(folder)
    if variant == "prepend":
        tj["normalizer"] = {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "\u2581"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
            ],
        }
        tj["pre_tokenizer"] = None
    elif variant == "never":
        tj["normalizer"] = None
        tj["pre_tokenizer"] = {**METASPACE_FIRST, "prepend_scheme": "never"}
    if variant == "transformers":  # the checkpoint as it is: its shared conversion
        out = converted("llama", outtype="f16").path
    else:
        folder = _with_tokenizer_json(folder, tmp_path / "ckpt", tj)
        out = convert.convert(folder, tmp_path / "m.gguf", outtype="f16").path
    assert _special_parity(out, folder, _with_specials("<s>", "</s>")) == []


@pytest.mark.parametrize("normalizer", [None, "replace"])
def test_metaspace_first_is_refused_before_writing(normalizer, checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    """transformers' LlamaTokenizer saves Metaspace(prepend_scheme='first'): no ▁ before a leading
    space or after a special token, which llama.cpp's SentencePiece tokenizer cannot do."""
    folder, _, _ = checkpoints("llama")
    tj = _llama_tj(folder)
    tj["pre_tokenizer"] = METASPACE_FIRST
    tj["normalizer"] = (
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"} if normalizer else None
    )
    folder = _with_tokenizer_json(folder, tmp_path / "ckpt", tj)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    with pytest.raises(ConvertError, match=r"prepend_scheme first\) makes ' Hi' into '▁Hi' where") as e:
        convert.convert(folder, out, outtype="f16")
    assert "tokenizer.model" in (e.value.hint or "")
    assert list(out.parent.iterdir()) == []


def test_transformers_llama_tokenizer_is_refused(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    """The file transformers' LlamaTokenizer class writes for the Llama 2 vocabulary."""
    from transformers import LlamaTokenizer

    folder, _, _ = checkpoints("llama")
    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    (dst / "tokenizer.json").unlink()
    LlamaTokenizer.from_pretrained(str(need_asset("tokenizers", "llama2-spm"))).save_pretrained(dst)
    assert _llama_tj(dst)["pre_tokenizer"]["prepend_scheme"] == "first"
    with pytest.raises(ConvertError, match="prepend_scheme first"):
        convert.convert(dst, tmp_path / "m.gguf", outtype="f16")
    assert not (tmp_path / "m.gguf").exists()


def test_missing_byte_tokens_are_refused_before_writing(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, _ = checkpoints("llama")
    tj = _llama_tj(folder)
    vocab = tj["model"]["vocab"]
    for b in (0x41, 0xE2):
        vocab[f"<0x{b:02X}>-renamed"] = vocab.pop(f"<0x{b:02X}>")
    folder = _with_tokenizer_json(folder, tmp_path / "ckpt", tj)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    with pytest.raises(ConvertError, match=r"without 2 of the 256 byte tokens \(e.g. <0x41>\)"):
        convert.convert(folder, out, outtype="f16")
    assert list(out.parent.iterdir()) == []


def test_tokenizer_kind_from_pre_tokenizer_and_decoder() -> None:
    from convert.pretokenizers import tokenizer_kind

    bytelevel = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    meta = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always"}
    # byte_fallback does not decide: the ByteLevel steps do
    tj = {"model": {"type": "BPE", "byte_fallback": True}, "pre_tokenizer": bytelevel, "decoder": bytelevel}
    assert tokenizer_kind(tj) == "byte-level"
    replace = {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}
    tj = {"model": {"type": "BPE"}, "pre_tokenizer": meta, "decoder": {"type": "Sequence", "decoders": [replace]}}
    assert tokenizer_kind(tj) == "sentencepiece"
    for odd in (
        {"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Whitespace"}, "decoder": None},
        {"model": {"type": "BPE"}, "pre_tokenizer": meta, "decoder": bytelevel},
    ):
        with pytest.raises(ConvertError, match="neither byte-level .* nor SentencePiece-style"):
            tokenizer_kind(odd)
