"""The MLX engine's text side: prompts rendered and tokenized, replies detokenized, and the views
of its tokenizer that structured output and reasoning formats read."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from localrun.backends.base import render_chat
from localrun.backends.mlx_vision import VisionModel, with_image_parts
from localrun.chat import PLAIN_STOPS, render_plain
from localrun.constraint import import_llguidance
from localrun.errors import UsageError
from localrun.generation import Request
from localrun.store import ModelInfo

if TYPE_CHECKING:
    from localrun.reasoning import ReasoningFormat


SPM_SPACE = "\u2581"  # SentencePiece's space


class _Detok:
    """mlx-lm's streaming detokenizer, keeping the reply's leading space as llama.cpp does.

    mlx-lm drops it because it decodes replies on their own; a continuation needs it
    ("The capital of France is" + " Paris").
    """

    __slots__ = ("d",)

    def __init__(self, tokenizer: Any) -> None:
        detok = tokenizer.detokenizer  # a fresh copy
        if hasattr(detok, "trim_space"):  # SentencePiece
            detok.trim_space = False
        elif hasattr(detok, "_maybe_trim_space"):  # byte-level BPE
            detok._maybe_trim_space = lambda text: text
        self.d = detok

    def feed(self, token: int) -> str:
        self.d.add_token(token)
        return str(self.d.last_segment)

    def flush(self) -> str:
        self.d.finalize()
        return str(self.d.last_segment)


def token_pieces(tokenizer: Any) -> Callable[[int], bytes]:
    """Each token's bytes as it adds them to a reply, as llama.cpp's pieces are: a SentencePiece
    token's leading space ("\u2581") and a byte token's one byte (<0xE2>) included, a byte-level BPE
    token's characters mapped back to its bytes. Decoding one token alone would drop the space and
    turn a part of a character into U+FFFD. Read from mlx-lm's detokenizer's table, or from the
    tokenizer's own token strings where mlx-lm decodes naively (no tokenizer.json)."""
    detok = tokenizer.detokenizer
    table = getattr(detok, "tokenmap", None)
    if table is not None and hasattr(detok, "_maybe_trim_space"):  # byte-level BPE
        from mlx_lm.tokenizer_utils import _byte_decoder

        decoder, strings = _byte_decoder(), list(table)

        def bpe(t: int) -> bytes:
            text = strings[t] if 0 <= t < len(strings) else ""
            return b"".join(bytes([decoder[c]]) if c in decoder else c.encode() for c in text)

        return bpe
    if table is None:
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        strings = [t or "" for t in hf.convert_ids_to_tokens(list(range(len(hf))))]
        if not any(t.startswith(SPM_SPACE) for t in strings):
            return lambda t: str(tokenizer.decode([t])).encode()
        table = [bytes([int(t[3:5], 16)]) if t.startswith("<0x") and len(t) == 6 else t.encode() for t in strings]
    spm = list(table)
    return lambda t: spm[t].replace(SPM_SPACE.encode(), b" ") if 0 <= t < len(spm) else b""


class MLXText:
    """MLXEngine's text <-> tokens half: mlx-lm's tokenizer and the model's chat template."""

    tokenizer: Any
    n_vocab: int
    eos: set[int]
    model_info: ModelInfo
    template: str | None
    reasoning: ReasoningFormat | None
    vision: VisionModel | None
    vision_refused: str | None
    vision_hint: str

    def _no_images(self) -> UsageError:
        """Why this model reads no images, and what to do."""
        name = self.model_info.name
        if self.vision_refused:
            return UsageError(f"'{name}' is a vision-language model, but {self.vision_refused}: on MLX it reads text only",
                              self.vision_hint)
        return UsageError(f"'{name}' is a text-only model: it reads no images",
                          "send text only, or run a vision-language model (an MLX folder made by mlx_vlm.convert, "
                          "or a GGUF with its projector on the llama.cpp engine)")

    def _llg_tokenizer(self) -> Any:
        """llguidance's view of the Hugging Face tokenizer, with every EOS token as its EOS, once
        it is shown to agree with the model's own tokenizer (BackendUnavailableError if not)."""
        from localrun.backends.grammar_vocab import agreeing_tokenizer

        import_llguidance()
        hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise UsageError(f"structured output on MLX needs a fast (tokenizer.json) tokenizer; "
                             f"'{self.model_info.name}' has another kind ({type(hf).__name__})")

        def emitted(ids: list[int]) -> str:  # what a reply of these tokens shows
            detok = self.detokenizer()
            return "".join(detok.feed(t) for t in ids) + detok.flush()

        return agreeing_tokenizer(backend, self.n_vocab, sorted(self.eos), self.model_info.name, emitted)

    @functools.cached_property
    def piece(self) -> Callable[[int], bytes]:
        """A token's bytes in a reply (token_pieces), for logprobs; the table is read once."""
        return token_pieces(self.tokenizer)

    def special_id(self, text: str) -> int | None:
        """The id of the added (special) token spelled `text`, if the tokenizer has one."""
        hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
        added: dict[str, int] = getattr(hf, "get_added_vocab", dict)()
        tid = added.get(text)
        return int(tid) if tid is not None else None

    def _chat_template(self) -> str | None:
        tpl = getattr(self.tokenizer, "chat_template", None)
        if isinstance(tpl, dict):
            tpl = tpl.get("default") or next(iter(tpl.values()), None)
        return tpl if isinstance(tpl, str) and tpl.strip() else None

    def _encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        tok = self.tokenizer
        if parse_special:
            return list(tok.encode(text, add_special_tokens=add_special))
        try:
            return list(tok.encode(text, add_special_tokens=add_special, split_special_tokens=True))
        except TypeError:  # a slow tokenizer without the option
            return list(tok.encode(text, add_special_tokens=add_special))

    def prompt_tokens(self, request: Request, stops: list[str]) -> list[int]:
        """Render the request (chat template or raw) and tokenize it, as the llama.cpp engine does."""
        tok = self.tokenizer
        fallback = [tok.bos_token_id if tok.bos_token_id is not None else 0]
        if request.images:
            return self._image_prompt(request)
        if request.prompt is not None:
            return self._encode(request.prompt, add_special=True, parse_special=False) or fallback
        bos = tok.bos_token or ""
        template = request.template or self.template
        if template:
            text = render_chat(template, self.reasoning, request, bos, tok.eos_token or "")
        elif getattr(tok, "_chat_template", None) is not None:
            # A renderer shipped as Python inside mlx-lm itself (not model-provided Jinja).
            text = tok.apply_chat_template([m.to_dict() for m in request.messages], tokenize=False,
                                           add_generation_prompt=True)
        else:
            text = render_plain(request.messages)
            stops.extend(PLAIN_STOPS)
        # A template that writes the BOS itself must not get a second one.
        return self._encode(text, add_special=not (bos and text.startswith(bos)), parse_special=True) or fallback

    def _image_prompt(self, request: Request) -> list[int]:
        """A chat request with images, rendered with their content parts and prepared by mlx-vlm's processor."""
        if self.vision is None:
            raise self._no_images()
        template = request.template or self.template
        if not template:
            raise UsageError(f"'{self.model_info.name}' has no chat template to place images in",
                             "give the request a template, or send text only")
        tok = self.tokenizer
        bos = tok.bos_token or ""
        text = render_chat(template, self.reasoning, with_image_parts(request), bos, tok.eos_token or "")
        images = [data for m in request.messages for data in m.images]
        return self.vision.prompt(text, images, add_special=not (bos and text.startswith(bos)))

    def is_eog(self, token: int) -> bool:
        return token in self.eos

    def text_tokens(self, text: str) -> list[int]:
        return self._encode(text, add_special=False, parse_special=True)

    def detokenizer(self, special: bool = False) -> _Detok:
        return _Detok(self.tokenizer)

