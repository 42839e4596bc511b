"""Tokenizer files to GGUF vocabulary metadata: SentencePiece, byte-level BPE, SentencePiece-style BPE."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from convert.errors import ConvertError
from convert.pretokenizers import derive_pre, is_byte_level, sentencepiece_prefix, tokenizer_kind
from convert.source import read_json

T = gguf.TokenType
# Texts that end a turn in common chat templates; llama.cpp detects the same list at load time.
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|eot|>", "<|end_of_turn|>")


@dataclass
class Vocab:
    """Everything the tokenizer contributes to a GGUF file."""

    model: str  # tokenizer.ggml.model: "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    pre: str
    tokens: list[str]
    toktypes: list[int]
    scores: list[float] | None
    special: gguf.SpecialVocab
    add_space_prefix: bool | None = None
    remove_extra_whitespaces: bool | None = None
    eot: int | None = None
    notes: list[str] = field(default_factory=list)
    charsmap: bytes | None = None  # a Unigram normaliser's precompiled character map
    token_type_count: int | None = None  # an encoder's token types (BERT's segments)

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        w.add_token_types(self.toktypes)
        if self.add_space_prefix is not None:
            w.add_add_space_prefix(self.add_space_prefix)
        if self.token_type_count is not None:
            w.add_token_type_count(self.token_type_count)
        if self.remove_extra_whitespaces is not None:
            w.add_remove_extra_whitespaces(self.remove_extra_whitespaces)
        if self.charsmap:
            w.add_precompiled_charsmap(self.charsmap)
        self.special.add_to_gguf(w, quiet=True)
        if self.eot is not None and "eot" not in self.special.special_token_ids:
            w.add_eot_token_id(self.eot)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = read_json(path)
    return data if isinstance(data, dict) else {}


def looks_special(text: str) -> bool:
    """Added tokens that are control tokens even when not flagged special (as llama.cpp does)."""
    return (
        text in ("<pad>", "<mask>")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<｜") and text.endswith("｜>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def _pad(tokens: list[str], types: list[int], scores: list[float] | None, n: int) -> None:
    for i in range(len(tokens), n):
        tokens.append(f"[PAD{i}]")
        types.append(T.UNUSED)
        if scores is not None:
            scores.append(-1000.0)


def _apply_added(
    tokens: list[str],
    types: list[int],
    scores: list[float] | None,
    added: list[dict[str, Any]],
    spm: bool,
) -> None:
    for a in added:
        i, text = int(a["id"]), str(a["content"])
        if i >= len(tokens):
            _pad(tokens, types, scores, i + 1)
        if a.get("special") or looks_special(text):
            types[i] = T.CONTROL
        else:
            types[i] = T.USER_DEFINED
            if spm:
                text = text.replace("\u2581", " ")  # llama.cpp expects user tokens pre-normalized
        tokens[i] = text
        if scores is not None:
            scores[i] = -1000.0


def _sentencepiece(
    folder: Path, config_added: list[dict[str, Any]]
) -> tuple[list[str], list[int], list[float], bool, bool]:
    try:
        from sentencepiece import SentencePieceProcessor
        from sentencepiece import sentencepiece_model_pb2 as pb  # type: ignore[attr-defined]
    except ImportError as e:
        raise ConvertError(
            "tokenizer.model needs the sentencepiece package", "pip install 'localrun[convert]'"
        ) from e
    path = folder / "tokenizer.model"
    raw, proto = _sp_model(path)
    if proto.trainer_spec.model_type != pb.TrainerSpec.BPE:  # type: ignore[attr-defined]
        kind = pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)  # type: ignore[attr-defined]
        raise ConvertError(
            f"{path} is a SentencePiece {kind} model",
            "llama.cpp's 'llama' tokenizer implements SentencePiece BPE only",
        )
    sp = SentencePieceProcessor(model_proto=raw)
    tokens: list[str] = []
    types: list[int] = []
    scores: list[float] = []
    for i in range(sp.vocab_size()):
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        if sp.IsUnknown(i):
            types.append(T.UNKNOWN)
        elif sp.IsControl(i):
            types.append(T.CONTROL)
        elif sp.IsUnused(i):
            types.append(T.UNUSED)
        elif sp.IsByte(i):
            types.append(T.BYTE)
        else:
            types.append(T.NORMAL)
    added_json = _read_json(folder / "added_tokens.json")
    extra = [{"id": i, "content": t, "special": False} for t, i in added_json.items()]
    _apply_added(tokens, types, scores, extra + config_added, spm=True)
    norm = proto.normalizer_spec
    return tokens, types, scores, bool(norm.add_dummy_prefix), bool(norm.remove_extra_whitespaces)


def _sp_model(path: Path) -> tuple[bytes, Any]:
    """A SentencePiece model file's bytes and its parsed ModelProto."""
    from sentencepiece import sentencepiece_model_pb2 as pb  # type: ignore[attr-defined]

    raw = path.read_bytes()
    proto = pb.ModelProto()  # type: ignore[attr-defined]
    try:
        proto.ParseFromString(raw)
    except Exception as e:  # protobuf's DecodeError
        raise ConvertError(f"{path} is not a SentencePiece model: {e}") from e
    return raw, proto


def _merge_pairs(merges: list[Any]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for m in merges:
        if isinstance(m, str):
            a, _, b = m.partition(" ")
            out.append((a, b))
        else:
            out.append((m[0], m[1]))
    return out


def _spm_style_bpe(tj: dict[str, Any]) -> tuple[list[str], list[int], list[float]]:
    """A tokenizer.json that encodes a SentencePiece BPE (▁ for spaces, <0xNN> byte tokens)."""
    model = tj["model"]
    vocab: dict[str, int] = model["vocab"]
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [int(T.UNUSED)] * n
    # llama.cpp's SentencePiece merges the adjacent pair whose result scores highest: score a
    # token by its merge rank so that the earliest merge wins, as in BPE.
    scores = [-1e9] * n
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = T.BYTE if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok) else T.NORMAL
        if len(tok) == 1 or types[i] == T.BYTE:
            scores[i] = 0.0
    for rank, (a, b) in enumerate(_merge_pairs(model.get("merges", []))):
        j = vocab.get(a + b)
        if j is not None and scores[j] < -rank:
            scores[j] = float(-rank)
    if (unk := model.get("unk_token")) in vocab:
        types[vocab[unk]] = T.UNKNOWN
    return tokens, types, scores


def _check_byte_tokens(tokens: list[str], source: str) -> None:
    """llama.cpp's SentencePiece tokenizer falls back to <0xNN> tokens and aborts without them."""
    present = set(tokens)
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in present]
    if missing:
        raise ConvertError(
            f"{source} is a SentencePiece-style vocabulary without {len(missing)} of the 256 byte "
            f"tokens (e.g. {missing[0]}) that llama.cpp falls back to for text outside the "
            "vocabulary; llama.cpp would crash on such text",
            "convert a tokenizer with byte fallback, or a byte-level BPE tokenizer.json",
        )


def _byte_level_bpe(tj: dict[str, Any]) -> tuple[list[str], list[int]]:
    vocab: dict[str, int] = tj["model"]["vocab"]
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [int(T.UNUSED)] * n
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = T.NORMAL
    return tokens, types


def _eot(tokens: list[str], types: list[int]) -> int | None:
    index = {t: i for i, t in enumerate(tokens) if types[i] in (T.CONTROL, T.USER_DEFINED)}
    return next((index[t] for t in EOT_TEXTS if t in index), None)


def load_vocab(folder: Path, n_vocab: int | None, add_space_prefix: bool | None = None) -> Vocab:
    """Read the tokenizer files of a Hugging Face folder.

    n_vocab is the embedding's row count: the token list is padded with [PADn] tokens up to it.
    """
    tj = _read_json(folder / "tokenizer.json")
    tc = _read_json(folder / "tokenizer_config.json")
    decoder = tc.get("added_tokens_decoder") or {}
    config_added = [{"id": int(i), **v} for i, v in decoder.items() if isinstance(v, dict)]
    json_added = tj.get("added_tokens") or []
    scores: list[float] | None
    prefix: bool | None = None
    remove_ws: bool | None = None
    model_type = (tj.get("model") or {}).get("type")
    spm_file = (folder / "tokenizer.model").is_file()
    # What the tokenizer does decides, not its flags: a byte-level tokenizer.json wins over a
    # stray tokenizer.model (some exports write one), as it does in transformers.
    kind: str | None = None
    if model_type == "BPE" and (not spm_file or is_byte_level(tj)):
        kind = tokenizer_kind(tj)

    if spm_file and kind is None:
        tokens, types, scores, prefix, remove_ws = _sentencepiece(folder, config_added)
        model, pre = "llama", "default"
        if add_space_prefix is not None:
            prefix = add_space_prefix
        if tc.get("add_prefix_space") is not None:
            prefix = bool(tc["add_prefix_space"])
        _check_byte_tokens(tokens, str(folder / "tokenizer.model"))
    elif kind == "sentencepiece":
        tokens, types, scores = _spm_style_bpe(tj)
        _apply_added(tokens, types, scores, json_added, spm=True)
        model, pre = "llama", "default"
        prefix = sentencepiece_prefix(tj, add_space_prefix)
        _check_byte_tokens(tokens, str(folder / "tokenizer.json"))
    elif kind == "byte-level":
        tokens, types = _byte_level_bpe(tj)
        _apply_added(tokens, types, None, json_added, spm=False)
        scores = None
        model = "gpt2"
        pre = derive_pre(tj, tc.get("clean_up_tokenization_spaces"))
    elif tj:
        raise ConvertError(
            f"tokenizer.json model type {model_type!r} is not supported",
            "supported: SentencePiece BPE (tokenizer.model) and BPE tokenizer.json files",
        )
    else:
        raise ConvertError(
            f"no tokenizer found in {folder}",
            "add tokenizer.json or tokenizer.model (and tokenizer_config.json) from the original model",
        )

    if n_vocab is not None:
        if len(tokens) > n_vocab:
            raise ConvertError(
                f"the tokenizer has {len(tokens)} tokens but the embedding only {n_vocab} rows",
                "the tokenizer files do not belong to this checkpoint",
            )
        _pad(tokens, types, scores, n_vocab)
    special = gguf.SpecialVocab(folder, load_merges=(model == "gpt2"), n_vocab=len(tokens))
    if model == "gpt2" and not special.merges:
        raise ConvertError("the BPE tokenizer has no merges", "tokenizer.json looks incomplete")
    return Vocab(
        model=model,
        pre=pre,
        tokens=tokens,
        toktypes=[int(t) for t in types],
        scores=scores,
        special=special,
        add_space_prefix=prefix,
        remove_extra_whitespaces=remove_ws,
        eot=_eot(tokens, types),
    )


def xlmr_unigram(folder: Path, n_vocab: int | None, type_count: int = 1) -> Vocab:
    """XLM-RoBERTa's SentencePiece Unigram vocabulary (sentencepiece.bpe.model) in fairseq's
    order, as llama.cpp's "t5" (UGM) tokenizer reads it: <s> <pad> </s> <unk> first, every other
    piece one place later, [PADn] up to the embedding's rows, the normaliser's character map."""
    try:
        from sentencepiece import SentencePieceProcessor
        from sentencepiece import sentencepiece_model_pb2 as pb  # type: ignore[attr-defined]
    except ImportError as e:
        raise ConvertError("sentencepiece.bpe.model needs the sentencepiece package",
                           "pip install 'localrun[convert]'") from e
    path = folder / "sentencepiece.bpe.model"
    if not path.is_file():
        raise ConvertError(f"{folder} has no sentencepiece.bpe.model",
                           "add the model's sentencepiece.bpe.model (XLM-RoBERTa's tokenizer) from the original model")
    raw, proto = _sp_model(path)
    if proto.trainer_spec.model_type != pb.TrainerSpec.UNIGRAM:  # type: ignore[attr-defined]
        raise ConvertError(f"{path} is not a SentencePiece Unigram model", "XLM-RoBERTa's tokenizer is Unigram")
    sp = SentencePieceProcessor(model_proto=raw)
    size = max(n_vocab or 0, sp.vocab_size())
    tokens = [f"[PAD{i}]" for i in range(size)]
    scores = [-10000.0] * size
    types = [int(T.UNUSED)] * size
    for i in range(sp.vocab_size()):
        tokens[i] = sp.IdToPiece(i)
        scores[i] = sp.GetScore(i)
        types[i] = int(T.UNKNOWN if sp.IsUnknown(i) else T.CONTROL if sp.IsControl(i) else
                       T.UNUSED if sp.IsUnused(i) else T.BYTE if sp.IsByte(i) else T.NORMAL)
    # fairseq's order: the four specials, then the pieces from SentencePiece's id 3 on
    tokens = ["<s>", "<pad>", "</s>", "<unk>", *tokens[3:-1]]
    scores = [0.0] * 4 + scores[3:-1]
    types = [int(T.CONTROL)] * 3 + [int(T.UNKNOWN)] + types[3:-1]
    norm = proto.normalizer_spec
    special = gguf.SpecialVocab(folder, n_vocab=len(tokens))
    return Vocab(model="t5", pre="default", tokens=tokens, toktypes=types, scores=scores, special=special,
                 add_space_prefix=bool(norm.add_dummy_prefix), remove_extra_whitespaces=bool(norm.remove_extra_whitespaces),
                 charsmap=bytes(norm.precompiled_charsmap) or None, token_type_count=type_count)
