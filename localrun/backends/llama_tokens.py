"""Text and tokens on the llama.cpp engine: tokenizing, token pieces, the model's metadata,
a request's prompt, and incremental detokenizing."""

from __future__ import annotations

import codecs
import ctypes
import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

from localrun.backends.base import render_chat
from localrun.backends.llama_vision import Vision
from localrun.chat import PLAIN_STOPS, render_plain
from localrun.errors import EngineError, UsageError
from localrun.generation import Request
from localrun.store import ModelInfo

if TYPE_CHECKING:
    from localrun.reasoning import ReasoningFormat


class LlamaTokens:
    """The engine's vocabulary: text to tokens and back, and a request rendered into its prompt."""

    ll: Any
    model: Any
    model_info: ModelInfo
    vocab: Any
    n_vocab: int
    add_bos: bool
    bos: int
    eos: int
    _piece_buf: Any
    _pieces: dict[int, bytes]
    _template: str | None
    reasoning: ReasoningFormat | None
    vision: Vision | None
    vision_missing: str | None

    def _llg_tokenizer(self) -> Any:
        """llguidance's view of this vocabulary, with every end-of-generation token as its EOS."""
        from localrun.constraint import import_llguidance

        import_llguidance()
        from llguidance.llamacpp import lltokenizer_from_vocab

        eog = [t for t in range(self.n_vocab) if self.is_eog(t)] or [self.eos]
        with warnings.catch_warnings():  # it reads each token through a name llama-cpp-python deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(self.vocab, eos_token=eog)

    def special_id(self, text: str) -> int | None:
        """The id of the control or user-defined token spelled `text`, if the vocabulary has one."""
        ids = self.tokenize(text, add_special=False, parse_special=True)
        if len(ids) != 1:
            return None
        attr = self.ll.llama_vocab_get_attr(self.vocab, ids[0])
        return ids[0] if attr & (self.ll.LLAMA_TOKEN_ATTR_CONTROL | self.ll.LLAMA_TOKEN_ATTR_USER_DEFINED) else None

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (self.ll.llama_token * n_max)()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (self.ll.llama_token * n_max)()
            n = self.ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise EngineError("tokenization failed")
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        if not special:
            cached = self._pieces.get(token)
            if cached is None:
                cached = self._pieces[token] = self._piece(token, False)
            return cached
        return self._piece(token, True)

    def _piece(self, token: int, special: bool) -> bytes:
        n = self.ll.llama_token_to_piece(self.vocab, token, self._piece_buf, 256, 0, special)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = self.ll.llama_token_to_piece(self.vocab, token, big, -n, 0, special)
            return big.raw[:n]
        return self._piece_buf.raw[:n]

    def token_text(self, token: int) -> str:
        if token < 0 or token >= self.n_vocab:
            return ""
        return self.piece(token, special=True).decode("utf-8", errors="replace")

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = self.ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            self.ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def prompt_tokens(self, request: Request, stops: list[str]) -> list[int]:
        """Render the request (chat template or raw) and tokenize it (images as placeholders)."""
        images = [data for m in request.messages for data in m.images]
        if images:
            if self.vision is None:
                raise UsageError(f"'{self.model_info.name}' does not support images"
                                 + (f" ({self.vision_missing})" if self.vision_missing else ""),
                                 "send text only, or load a vision model with its projector (--mmproj FILE)")
            mark = self.vision.marker
            if any(mark in m.content for m in request.messages):
                raise UsageError(f"a message contains '{mark}', which marks an image on this model",
                                 "remove it from the text")
            # Each image goes before its message's text, as Ollama and llama-server place them.
            request = dataclasses.replace(request, messages=tuple(
                dataclasses.replace(m, content=mark * len(m.images) + m.content, images=()) if m.images else m
                for m in request.messages))
        if request.prompt is not None:
            tokens = self.tokenize(request.prompt, add_special=True, parse_special=False)
            return tokens or [self.bos]
        bos_text = self.token_text(self.bos)
        template = request.template or self._template
        if template:
            text = render_chat(template, self.reasoning, request, bos_text, self.token_text(self.eos))
        else:
            text = render_plain(request.messages)
            stops.extend(PLAIN_STOPS)
        # A template that writes the BOS itself must not get a second one.
        add_special = self.add_bos and not (bos_text and text.startswith(bos_text))
        if images:
            assert self.vision is not None
            return self.vision.tokenize(text, images, add_special)
        return self.tokenize(text, add_special=add_special, parse_special=True) or [self.bos]

    def text_tokens(self, text: str) -> list[int]:
        return self.tokenize(text, add_special=False, parse_special=True)

    def is_eog(self, token: int) -> bool:
        return bool(self.ll.llama_vocab_is_eog(self.vocab, token))

    def detokenizer(self, special: bool = False) -> _Utf8Pieces:
        return _Utf8Pieces(self.piece_special if special else self.piece)

    def piece_special(self, token: int) -> bytes:
        return self.piece(token, special=True)


class _Utf8Pieces:
    """Token pieces to text without splitting a UTF-8 character across chunks."""

    __slots__ = ("piece", "utf8")

    def __init__(self, piece: Any) -> None:
        self.piece = piece
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self.utf8.decode(self.piece(token))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)
