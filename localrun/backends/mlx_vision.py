"""Images on the MLX engine, through mlx-vlm: vision-language models in MLX folders (config.json
with a `vision_config`, as mlx-vlm's converter writes them) and in Hugging Face checkpoints.

mlx-vlm's processor turns a rendered prompt and its images into token ids (each image a run of
media tokens) and pixel tensors; its model gives the prompt's input embeddings (text embeddings
with the vision tower's features at the media tokens) and the positions of an M-RoPE model, and
its language model runs on them with a KV cache. mlx-vlm generates one sequence at a time (its
batch generator samples every sequence alike), so each sequence here runs beside the others with
its own KV cache, one token per engine step, sampled with its own settings, as mlx_speculative's
drafting sequences do. After the prompt, every forward pass gets the sequence's own M-RoPE offset
(`rope_deltas`, as mlx-vlm's batch generator passes it): the language model also keeps the last
prompt's offset on itself, which another sequence's prompt overwrites.

The engine loop sees each image's media tokens as placeholder tokens made from the image's digest
(llama_vision's numbering), so its prefix matching never takes one image for another, and a slot's
KV cache serves the prompt it shares a prefix with. On an M-RoPE model (Qwen-VL: mlx-vlm computes
its positions with get_rope_index) a prompt whose uncached part is text, as a conversation's next
turn, follows its cached images without encoding them again: its positions come from the whole
prompt, as mlx-vlm's own prompt cache does it. Otherwise (an image past the cached part, or
another family) the prompt is embedded whole, every image of it encoded again, and the language
model evaluates it from the end of the cached part.

Config layouts: mlx-vlm 0.7 reads some families (Qwen2-VL, Qwen2.5-VL...) in the layout their
checkpoints were published in (text settings at the root of config.json, M-RoPE sections in
`rope_scaling`, the vision config's model_type the family's own); transformers 5 saves them
otherwise (`text_config`, `rope_parameters`, "<family>_vision"). vlm_config() gives mlx-vlm the
layout it reads, and config_view() a folder to read it from (mlx-vlm takes no config but the file).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from io import BytesIO
from pathlib import Path
from typing import Any

from localrun.backends.llama_vision import placeholder
from localrun.chat import Message
from localrun.errors import BadModelFileError, EngineError, UsageError
from localrun.generation import Request

VLM_HINT = "install mlx-vlm with pip install 'localrun[mlx-vision]'"
PREFILL_STEP = 2048  # prompt tokens evaluated per forward pass (mlx-vlm's default)
KEEP_PROMPTS = 64  # prepared prompts with images kept for queued requests (least recently used go)
KEEP_PIXELS = 4  # of which this many keep their pixel tensors; the others are prepared again
_PIXEL_INPUTS = ("pixel_values", "pixel_values_videos", "cached_image_features")  # not for a text-only suffix


def keep_image_kwargs(processor: Any) -> None:
    """Let a processor's image processor see only the settings it takes. Some of mlx-vlm's own
    processors (LLaVA's) pass the text settings (padding...) to the image processor as well, which
    transformers 5 refuses ("unexpected keyword argument 'padding'") for every request."""
    image_processor = getattr(processor, "image_processor", None)
    names = set(getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", {}))
    if image_processor is None or not names or getattr(image_processor, "_localrun_kwargs", False):
        return
    cls = type(image_processor)

    def call(self: Any, images: Any, *args: Any, **kwargs: Any) -> Any:
        return cls.__call__(self, images, *args, **{k: v for k, v in kwargs.items()
                                                     if k in names or k == "return_tensors"})

    # a subclass of its own (a call is looked up on the class), so that it stays what it was
    image_processor.__class__ = type(cls.__name__, (cls,), {"__call__": call, "_localrun_kwargs": True})


def vlm_installed() -> bool:
    """Whether mlx-vlm is installed, without importing it (its import takes seconds)."""
    return importlib.util.find_spec("mlx_vlm") is not None


def read_config(folder: Path) -> dict[str, Any]:
    """A model folder's config.json ({} when it cannot be read)."""
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def is_vision_config(cfg: dict[str, Any]) -> bool:
    """Whether a config is a vision-language model's (mlx-vlm's and transformers' mark: a vision_config)."""
    return isinstance(cfg.get("vision_config"), dict)


def unsupported(cfg: dict[str, Any]) -> str | None:
    """Why mlx-vlm cannot run a vision-language model's family (None: it can)."""
    from importlib.metadata import version

    from mlx_vlm.utils import get_model_and_args

    try:
        get_model_and_args(copy.deepcopy(cfg))
    except (ValueError, KeyError):
        return f"mlx-vlm {version('mlx-vlm')} does not support its family '{cfg.get('model_type')}'"
    return None


def rope_keys(text: dict[str, Any]) -> dict[str, Any]:
    """What a text config saved by transformers 5 lacks for mlx-vlm: rope_theta, and rope_scaling
    (with an M-RoPE model's mrope_section) from rope_parameters."""
    from localrun.backends.mlx_model import mlx_rope_keys

    out = mlx_rope_keys(text)
    rope = text.get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" in rope and text.get("rope_scaling") is None:
        kind = rope.get("rope_type") or rope.get("type") or "default"
        out["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_theta"}, "rope_type": kind, "type": kind}
    return out


def vlm_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config in the layout mlx-vlm reads for its family (see the module's docstring); the
    same config when nothing differs. Raises ValueError for a family mlx-vlm does not support."""
    from mlx_vlm.utils import get_model_and_args

    out = copy.deepcopy(cfg)
    module, family = get_model_and_args(out)
    text = out.get("text_config")
    if isinstance(text, dict):
        text.update(rope_keys(text))
        if family == "gemma3":
            _gemma3_keys(out, text)
        probe = copy.deepcopy(out)
        try:
            module.ModelConfig.from_dict(probe)
        except (TypeError, ValueError, KeyError):
            pass
        if probe.get("text_config") != text:  # its ModelConfig rebuilt text_config from the root
            out.update({k: v for k, v in text.items() if k not in out and k != "model_type"})
    vision = out.get("vision_config")
    vision_class = getattr(module, "VisionConfig", None)
    default = next((f.default for f in fields(vision_class) if f.name == "model_type"), None) \
        if vision_class is not None and hasattr(vision_class, "__dataclass_fields__") else None
    if isinstance(vision, dict) and vision.get("model_type") == f"{family}_vision" and default == family:
        vision["model_type"] = family
    return out


def _gemma3_keys(cfg: dict[str, Any], text: dict[str, Any]) -> None:
    """Write into a Gemma 3 config (and its text_config) the settings mlx-vlm reads where
    transformers does not write them."""
    if "mm_tokens_per_image" in cfg and "mm_tokens_per_image" not in text:
        text["mm_tokens_per_image"] = cfg["mm_tokens_per_image"]
    if "hidden_size" not in cfg and isinstance(text.get("hidden_size"), int):
        # mlx-vlm divides the image features by the root of this (default 2048), and the text model
        # multiplies every input by the root of its own width: unchanged only when they are equal
        cfg["hidden_size"] = text["hidden_size"]
    pattern = _sliding_pattern(text.get("layer_types"))
    if pattern is not None and "sliding_window_pattern" not in text:
        text["sliding_window_pattern"] = pattern


def _sliding_pattern(layer_types: Any) -> int | None:
    """Gemma 3's sliding_window_pattern (every n-th layer attends fully), which mlx-vlm reads, from
    the layer_types transformers 5 saves instead; None when they follow no such pattern."""
    if not isinstance(layer_types, list) or "full_attention" not in layer_types:
        return None
    n = layer_types.index("full_attention") + 1
    want = ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(len(layer_types))]
    return n if layer_types == want else None


@contextmanager
def config_view(folder: Path) -> Iterator[Path]:
    """The folder as mlx-vlm should read it: itself, or, when its config needs vlm_config's changes,
    a temporary folder of links to its files with the changed config.json (the model's own folder
    is never written). Raises ValueError for a family mlx-vlm does not support."""
    cfg = read_config(folder)
    fixed = vlm_config(cfg)
    if fixed == cfg:
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="localrun-mlx-vlm-") as tmp:
        view = Path(tmp)
        for entry in folder.iterdir():
            if entry.name != "config.json":
                (view / entry.name).symlink_to(entry.absolute())
        (view / "config.json").write_text(json.dumps(fixed, indent=2), encoding="utf-8")
        yield view


@dataclass(frozen=True)
class _WithImages(Message):
    """A message whose images reach the chat template as content parts before its text, the shape
    transformers' processors render them in; the template writes each image as its family does."""

    def to_dict(self, thinking_as: str | None = "thinking") -> dict[str, Any]:
        out = super().to_dict(thinking_as)
        if self.images:
            out["content"] = [{"type": "image"} for _ in self.images] + (
                [{"type": "text", "text": self.content}] if self.content else [])
        return out


def with_image_parts(request: Request) -> Request:
    """The request with its messages' images as content parts (for render_chat)."""
    messages = tuple(_WithImages(**{f.name: getattr(m, f.name) for f in fields(m)}) if m.images else m
                     for m in request.messages)
    return replace(request, messages=messages)


@dataclass(eq=False)
class _Prompt:
    """A prompt with images as the processor prepared it."""

    text: str
    images: list[bytes]
    add_special: bool
    ids: list[int]  # what the model reads: media tokens where the loop's tokens hold placeholders
    inputs: dict[str, Any] | None  # the processor's tensors (None once dropped: prepared again)


@dataclass(eq=False)
class VisionSeq:
    """A sequence on the vision-language model."""

    cache: list[Any]
    sampler: Callable[[Any], Any]
    processors: list[Callable[[Any, Any], Any]]
    logprobs: int | None
    ids: list[int]  # the prompt as the model reads it
    seen: list[int]  # the logits processors' view: what the cache holds past the reused prefix
    pos: int  # tokens in the cache
    embeds: Any  # input embeddings of the prompt from pos, until it is evaluated
    kwargs: dict[str, Any]  # the language model's inputs for the prompt (positions over all of it, grids)
    decode: dict[str, Any] = field(default_factory=dict)  # ... for each later token (its rope_deltas)
    parts: bool = True  # whether the prompt may be evaluated in chunks
    images: int = 0  # images its prompt evaluation encoded
    last: int = -1  # the latest sampled token, evaluated next (-1: the prompt is still evaluating)


class VisionModel:
    """A vision-language model loaded by mlx-vlm and the sequences that run on it."""

    def __init__(self, folder: Path, name: str) -> None:
        """Load it (of a family mlx-vlm supports: see unsupported())."""
        import mlx.core as mx
        from mlx_vlm.apc import multimodal_token_ids_from_config
        from mlx_vlm.utils import load

        self.mx: Any = mx
        self.model: Any = None
        self.lm: Any = None
        self.processor: Any = None
        self.name = name
        cfg = read_config(folder)
        self.family = str(cfg.get("model_type"))
        with config_view(folder) as view:
            try:
                self.model, self.processor = load(str(view))
            except FileNotFoundError as e:
                raise BadModelFileError(f"cannot load vision model '{name}' ({folder}): {e}",
                                        "an MLX model is a folder with config.json, *.safetensors and tokenizer files") from e
            except (ValueError, KeyError, OSError, TypeError, AttributeError) as e:
                raise BadModelFileError(f"cannot load vision model '{name}' ({folder}) with mlx-vlm: {e}",
                                        "the folder may be incomplete, or made for another mlx-vlm; "
                                        "try 'pip install -U mlx-vlm'") from e
            self.config = vlm_config(cfg)
        keep_image_kwargs(self.processor)
        # mlx-vlm sets a module without weights to None (a folder converted for text only)
        dropped = [k for k, v in vars(self.model).items() if v is None and any(w in k for w in ("vision", "visual"))]
        if dropped:
            raise BadModelFileError(f"vision model '{name}' ({folder}) has no weights for its {', '.join(dropped)}",
                                    "make its MLX folder with mlx_vlm.convert, which keeps the vision tower")
        self.lm = self.model.language_model
        self.media = multimodal_token_ids_from_config(self.model.config)
        # Families that must read a prompt in one pass (a policy of their own) get no chunks and no prefix reuse.
        self.parts = not any(getattr(m, "no_chunked_prefill", False) or callable(getattr(m, "chunked_prefill_policy", None))
                             for m in (self.model, self.lm))
        self.prompts: OrderedDict[tuple[int, ...], _Prompt] = OrderedDict()  # by the loop's tokens
        self.seqs: dict[int, VisionSeq] = {}
        self.encoded = 0  # images encoded since load

    @property
    def eos_token_ids(self) -> list[int] | None:
        """The model's end-of-sequence tokens as mlx-vlm reads them (generation config included)."""
        eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            eos = (self.config.get("text_config") or {}).get("eos_token_id")
        if eos is None:
            return None
        return [int(e) for e in eos] if isinstance(eos, list | tuple) else [int(eos)]

    # -- prompts ---------------------------------------------------------------------------------
    def prompt(self, text: str, images: list[bytes], add_special: bool) -> list[int]:
        """Tokens of a rendered prompt with its images: each image's media tokens as placeholders."""
        from mlx_vlm.apc import media_token_spans

        entry = _Prompt(text, list(images), add_special, [], None)
        self._prepare(entry)
        spans = media_token_spans(entry.ids, self.media)
        if not spans:
            raise UsageError(f"the chat template of '{self.name}' placed none of the {len(images)} images in the prompt",
                             "the model's template must write image content parts; check its chat template")
        tokens = list(entry.ids)
        per_image = len(spans) == len(images)  # one run of media tokens each: an image's own placeholders
        combined = hashlib.sha256(b"".join(hashlib.sha256(d).digest() for d in images)).digest()
        n = 0
        for i, (a, b) in enumerate(spans):
            ident = hashlib.sha256(images[i]).digest() if per_image else combined
            key = int(hashlib.sha256(ident + (b - a).to_bytes(4, "little")).hexdigest()[:10], 16)
            for j in range(a, b):
                tokens[j] = placeholder(key, j - a if per_image else n)
                n += 1
        key_tokens = tuple(tokens)
        self.prompts[key_tokens] = entry
        self.prompts.move_to_end(key_tokens)
        while len(self.prompts) > KEEP_PROMPTS:
            self.prompts.popitem(last=False)
        for old in list(self.prompts.values())[:-KEEP_PIXELS]:
            old.inputs = None
        return tokens

    def _prepare(self, entry: _Prompt) -> None:
        """The processor's token ids and tensors for a prompt (UsageError for an image it cannot read)."""
        import numpy as np
        from mlx_vlm.utils import prepare_inputs

        pictures = [self._picture(n, data) for n, data in enumerate(entry.images, 1)]
        try:
            inputs = prepare_inputs(self.processor, images=pictures, prompts=[entry.text],
                                    image_token_index=getattr(self.model.config, "image_token_index", None),
                                    add_special_tokens=entry.add_special)
        except Exception as e:  # noqa: BLE001 - a processor's refusal of one request's images, of any kind
            raise UsageError(f"the images could not be prepared for '{self.name}' (mlx-vlm: {e})",
                             "send a smaller or plainer image") from e
        entry.ids = [int(t) for t in np.array(inputs["input_ids"]).reshape(-1)]
        entry.inputs = inputs

    @staticmethod
    def _picture(n: int, data: bytes) -> Any:
        from PIL import Image, ImageOps

        try:
            with Image.open(BytesIO(data)) as file:
                return ImageOps.exif_transpose(file).convert("RGB")
        except Exception as e:  # noqa: BLE001 - Pillow raises many kinds of errors for a damaged file
            raise UsageError(f"image {n} of the request could not be decoded ({e})",
                             "send a complete PNG, JPEG, GIF or BMP file") from e

    # -- sequences -------------------------------------------------------------------------------
    def reuse(self, cache: list[Any] | None, tokens: list[int], keep: int) -> tuple[list[Any] | None, int]:
        """The slot's cache cut back to the `keep` tokens it shares with the prompt, and keep; (None, 0)
        when it cannot serve (a family read in one pass, a memory that cannot be cut back)."""
        if cache is None or keep <= 0 or not self.parts or not all(c.is_trimmable() for c in cache):
            return None, 0
        offset = getattr(cache[0], "offset", None)
        if not isinstance(offset, int) or offset < keep:
            return None, 0
        for c in cache:
            c.trim(offset - keep)
        return cache, keep

    def start(self, slot: int, tokens: list[int], keep: int, cache: list[Any] | None,
              sampler: Callable[[Any], Any], processors: list[Callable[[Any, Any], Any]], logprobs: int | None) -> None:
        """Place a sequence: its prompt embedded (images encoded where they lie past the reused prefix)."""
        from mlx_vlm.models.cache import make_prompt_cache

        prompt = self.prompts.get(tuple(tokens)) if min(tokens, default=0) < 0 else None
        if min(tokens, default=0) < 0 and prompt is None:
            raise EngineError(f"the images of a request were dropped before it started (more than {KEEP_PROMPTS} "
                              "requests with images waited)", "send fewer requests with images at once")
        if prompt is not None:
            self.prompts.move_to_end(tuple(tokens))
            if prompt.inputs is None:
                self._prepare(prompt)
        ids = prompt.ids if prompt is not None else list(tokens)
        cache = cache if cache is not None else make_prompt_cache(self.lm)
        q = VisionSeq(cache, sampler, processors, logprobs, ids, list(ids[keep:]), keep, None, {},
                      parts=self.parts)
        self._embed(q, prompt, tokens, keep)
        self.seqs[slot] = q

    def _embed(self, q: VisionSeq, prompt: _Prompt | None, tokens: list[int], keep: int) -> None:
        """The prompt's input embeddings from `keep` and the language model's inputs (as mlx-vlm's
        generate_step passes them: the processor's tensors and the embedding's positions)."""
        mx = self.mx
        inputs = dict(prompt.inputs or {}) if prompt is not None else {}
        data = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        mask = inputs.get("attention_mask")
        ids = mx.array([q.ids])
        rope = self._positions(ids, data, mask) if prompt is not None and keep > 0 and min(tokens[keep:]) >= 0 else None
        if rope is not None:
            # Every image lies in the cached prefix: embed the text after it, with positions from the whole prompt.
            rest = {k: v for k, v in data.items() if k not in _PIXEL_INPUTS}
            feats = self.model.get_input_embeddings(ids[:, keep:], None, mask=None if mask is None else mask[:, keep:],
                                                    **rest)
            embeds, kwargs = feats.inputs_embeds, {**rest, **_features(feats),
                                                   "position_ids": rope[0], "rope_deltas": rope[1]}
        else:
            pixels = inputs.get("pixel_values") if prompt is not None else None
            feats = self.model.get_input_embeddings(ids, pixels, mask=mask, **data)
            embeds, kwargs = feats.inputs_embeds[:, keep:], {**data, **_features(feats)}
            if pixels is not None:
                q.images = len(prompt.images) if prompt is not None else 0
                self.encoded += q.images
        q.embeds = embeds
        q.kwargs = kwargs
        if q.parts:
            from mlx_vlm.generate import common

            enabled = getattr(common, "_chunked_prefill_enabled", None)
            if callable(enabled):
                q.parts = bool(enabled(self.model, input_ids=ids, inputs_embeds=embeds, prompt_cache=q.cache,
                                       prefill_kwargs=kwargs))

    def _positions(self, ids: Any, data: dict[str, Any], mask: Any) -> tuple[Any, Any] | None:
        """An M-RoPE model's positions and offset over the whole prompt, which let a text suffix
        follow cached images (None: the model computes none, or could not)."""
        get_rope_index = getattr(self.lm, "get_rope_index", None)
        if not callable(get_rope_index):
            return None
        try:
            position_ids, rope_deltas = get_rope_index(ids, data.get("image_grid_thw"), data.get("video_grid_thw"), mask)
        except Exception:  # noqa: BLE001 - as mlx-vlm's prompt cache does then, the whole prompt is embedded
            return None
        return position_ids, rope_deltas

    def step(self) -> list[tuple[int, int, Any]]:
        """One forward pass for each sequence: (slot, token, log-probabilities) of those that sampled."""
        mx = self.mx
        out: list[tuple[int, int, Any]] = []
        for slot, q in self.seqs.items():
            if q.last < 0:
                n = q.embeds.shape[1]
                take = min(n, PREFILL_STEP) if q.parts else n
                a = q.pos
                result = self.lm(mx.array([q.ids[a:a + take]]), inputs_embeds=q.embeds[:, :take], cache=q.cache,
                                 n_to_process=take, logits_to_keep=1, **q.kwargs)
                q.pos += take
                q.embeds = q.embeds[:, take:]
                if take < n:
                    mx.eval([c.state for c in q.cache])
                    continue
                rope = q.kwargs.get("rope_deltas")
                rope = rope if isinstance(rope, mx.array) else getattr(self.lm, "_rope_deltas", None)
                q.decode = {"rope_deltas": rope} if rope is not None else {}
                q.embeds, q.kwargs = None, {}  # the prompt's inputs (a model's visual features among them) go
            else:
                q.seen.append(q.last)
                result = self.lm(mx.array([[q.last]]), cache=q.cache, logits_to_keep=1, **q.decode)
                q.pos += 1
            q.decode.update({k: v for k in ("cross_attention_states", "encoder_outputs")
                             if (v := getattr(result, k, None)) is not None})
            logits = (result.logits if hasattr(result, "logits") else result)[:, -1, :]
            if q.processors:
                context = mx.array(q.seen)
                for process in q.processors:
                    logits = process(context, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            tok = int(q.sampler(logprobs).item())
            q.last = tok
            out.append((slot, tok, logprobs if q.logprobs is not None else None))
        return out

    def finish(self, slot: int) -> tuple[list[Any] | None, int]:
        """Take the slot's sequence out: its KV cache and how many tokens it holds."""
        q = self.seqs.pop(slot, None)
        return (q.cache, q.pos) if q is not None else (None, 0)

    def images_encoded(self, slot: int) -> int:
        q = self.seqs.get(slot)
        return q.images if q is not None else 0

    def close(self) -> None:
        self.seqs = {}
        self.prompts.clear()
        self.model = self.lm = self.processor = None


def _features(feats: Any) -> dict[str, Any]:
    """What an embedding gives the language model besides the embeddings (positions, masks...)."""
    return {k: v for k, v in feats.to_dict().items() if k != "inputs_embeds" and v is not None}
