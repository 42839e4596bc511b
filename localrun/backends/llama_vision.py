"""Images on the llama.cpp engine: llama.cpp's multimodal library (libmtmd) with a model's
projector file (mmproj).

A prompt with images is tokenized by `mtmd_tokenize`: text chunks give tokens, and each image chunk
gives placeholder tokens, one per position the image takes in the sequence
(`mtmd_input_chunk_get_n_pos`; M-RoPE models take fewer positions than embeddings). A placeholder
is a negative number made from the image's digest and its position within the image, so the
engine loop's prefix matching works unchanged on prompts with images: a conversation's next turn
finds its images in the KV cache and they are not encoded again, and two different images never
match. The engine evaluates a placeholder run for that sequence, inside its step: the image is
encoded (`mtmd_encode_chunk`) and its embeddings decoded at the run's positions
(`mtmd_helper_decode_image_chunk`). The embeddings are kept, by the image's digest, within a
memory budget (least recently used go first), so the same image in another sequence (a new
conversation, a regenerated reply that lands in another slot, a prompt cut from the KV cache) is
decoded again without being encoded again.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections import OrderedDict
from typing import Any

from localrun.errors import BadModelFileError, EngineError, UsageError

_SPAN = 1 << 20  # positions per image in the placeholder numbering
KEEP_IMAGES = 64  # tokenized images (a tiled one with all its tiles) kept for the prefill of queued requests (least recently used go)
EMBEDDINGS_BYTES = 256 << 20  # encoded images' embeddings kept for other sequences (least recently used go)
# The projector types llama.cpp runs on its LLaVA graph, which puts a CLIP tower's [CLS] token after the patches
_LLAVA_GRAPH = ("mlp", "mlp_norm", "ldp", "ldpv2", "glm_edge")
CLS_LAST = ("llama.cpp puts this projector's [CLS] token after the image's patches (llama.cpp issue 25814): "
            "it reads images otherwise than the model was trained, and may describe them less well")


def cls_last(path: str) -> bool:
    """Whether llama.cpp runs this projector with its [CLS] token in the wrong place: a CLIP tower
    (one with a class embedding) on its LLaVA graph (LLaVA 1.5 and 1.6, BakLLaVA, MobileVLM...)."""
    from localrun.errors import LocalrunError
    from localrun.gguf_header import read_gguf

    try:
        meta = read_gguf(path, whole_model=False)
    except LocalrunError:
        return False
    return (meta.metadata.get("clip.projector_type") in _LLAVA_GRAPH
            and any(t.name == "v.class_embd" for t in meta.tensors))


def placeholder(key: int, i: int) -> int:
    return -(1 + key * _SPAN + i)


def image_key(token: int) -> tuple[int, int]:
    """(image key, position within the image) of a placeholder token."""
    v = -token - 1
    return v // _SPAN, v % _SPAN


def image_start(tokens: list[int], i: int) -> int:
    """Where the image run that position i lies in starts (i itself if it starts one or is text)."""
    if i >= len(tokens) or tokens[i] >= 0:
        return i
    return i - image_key(tokens[i])[1]


class Vision:
    """One model's projector: image tokenization and evaluation for the engine's sequences."""

    def __init__(self, path: str, model: Any, threads: int, gpu: bool, flash_attn: bool | None = None) -> None:
        import importlib

        from localrun.backends.llama_loader import _STATE, LOG, last_log_error, library

        ll = library()  # the bindings, without the package's high-level half (see llama_loader._bindings)
        mt = importlib.import_module("llama_cpp.mtmd_cpp")

        if "mtmd_log" not in _STATE:  # the projector's log lines go where llama.cpp's go (not stderr)
            sink = _STATE["sink"]
            mt.mtmd_log_set(sink, ctypes.c_void_p(0))
            mt.mtmd_helper_log_set(sink, ctypes.c_void_p(0))
            _STATE["mtmd_log"] = True
        self.mt = mt
        self.path = path
        params = mt.mtmd_context_params_default()
        params.use_gpu = gpu
        params.n_threads = threads
        params.print_timings = False
        params.warmup = False
        if flash_attn is not None:  # --flash-attn on|off reaches the image encoder too (auto: llama.cpp decides)
            params.flash_attn_type = 1 if flash_attn else 0
        LOG.clear()
        self.ctx = mt.mtmd_init_from_file(path.encode(), model, params)
        if not self.ctx:
            raise BadModelFileError(f"the vision projector '{path}' cannot be loaded: "
                                    f"{last_log_error() or 'llama.cpp refused it'}",
                                    "a projector must be made for this model (its mmproj file)")
        if not mt.mtmd_support_vision(self.ctx):
            mt.mtmd_free(self.ctx)
            self.ctx = None
            raise BadModelFileError(f"'{path}' is not a vision projector (it reads no images)")
        self.warning = CLS_LAST if cls_last(path) else None  # what the user should know about how it runs
        self.marker = mt.mtmd_default_marker().decode()
        self.n_embd = ll.llama_model_n_embd_inp(model)  # what an image embedding's row holds, as the helper reads it
        self.embeddings: OrderedDict[int, Any] = OrderedDict()  # image key -> its encoded embeddings (c_float array)
        self.embeddings_bytes = 0
        self.chunks: OrderedDict[int, tuple[Any, int]] = OrderedDict()  # image key -> (owned chunk, n_pos)
        self.encoded = 0  # images encoded since load
        self.sizes: dict[int, tuple[int, int]] = {}  # image key -> (embeddings, positions), every image seen
        self.tiles: set[int] = set()  # keys of a tiled image's chunks after its first (they count as no image)

    def tokenize(self, text: str, images: list[bytes], add_special: bool) -> list[int]:
        """Tokens of a prompt whose images stand at markers in text, in order, as placeholders."""
        mt = self.mt
        bitmaps = []
        try:
            for n, data in enumerate(images, 1):
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                bitmap = mt.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
                if not bitmap:
                    raise UsageError(f"image {n} of the request could not be decoded (a damaged or truncated file?)",
                                     "send a complete PNG, JPEG, GIF or BMP file")
                bitmaps.append(bitmap)
                mt.mtmd_bitmap_set_id(bitmap, hashlib.sha256(data).hexdigest().encode())
            chunks = mt.mtmd_input_chunks_init()
            try:
                raw = text.encode()
                inp = mt.mtmd_input_text(raw, len(raw), add_special, True)
                arr = (mt.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
                rc = mt.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
                if rc == 1:
                    raise UsageError(f"the prompt has {text.count(self.marker)} image markers for {len(images)} images",
                                     f"do not write '{self.marker}' in messages")
                if rc != 0:
                    raise UsageError(f"the images could not be prepared for this model (mtmd_tokenize: {rc})")
                return self._flatten(chunks)
            finally:
                mt.mtmd_input_chunks_free(chunks)
        finally:
            for b in bitmaps:
                mt.mtmd_bitmap_free(b)

    def _flatten(self, chunks: Any) -> list[int]:
        mt = self.mt
        out: list[int] = []
        # A tiled image (SmolVLM, MiniCPM-V, ...) is several chunks with its one id: the tiles and the
        # overview. Each is keyed by its place among its image's chunks too.
        nth: dict[bytes, int] = {}
        for c in range(mt.mtmd_input_chunks_size(chunks)):
            chunk = mt.mtmd_input_chunks_get(chunks, c)
            if mt.mtmd_input_chunk_get_type(chunk) == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                ptr = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                text = [ptr[i] for i in range(n.value)]
                if text and min(text) < 0:  # mtmd's delimiter lookup found no such token (LLAMA_TOKEN_NULL)
                    raise BadModelFileError(f"the vision projector '{self.path}' writes image delimiters that this "
                                            "model's vocabulary does not have",
                                            "use the projector made for this model (its mmproj file)")
                out.extend(text)
                continue
            ident = mt.mtmd_input_chunk_get_id(chunk) or b""
            n_pos = mt.mtmd_input_chunk_get_n_pos(chunk)
            nth[ident] = part = nth.get(ident, -1) + 1
            key = int(hashlib.sha256(ident + n_pos.to_bytes(4, "little") + part.to_bytes(4, "little")).hexdigest()[:10], 16)
            if part:
                self.tiles.add(key)
            if key in self.chunks:
                self.chunks.move_to_end(key)
            else:
                self.chunks[key] = (mt.mtmd_input_chunk_copy(chunk), n_pos)
                self._evict()
            self.sizes[key] = (mt.mtmd_input_chunk_get_n_tokens(chunk), n_pos)
            out.extend(placeholder(key, i) for i in range(n_pos))
        return out

    def _evict(self) -> None:
        """Free the least recently used tokenized images beyond KEEP_IMAGES: a tiled image's chunks
        count as one image (SmolVLM's can be 17: four such images would pass a count of chunks)."""
        images = sum(key not in self.tiles for key in self.chunks)
        while images > KEEP_IMAGES:
            key, (chunk, _) = self.chunks.popitem(last=False)
            self.mt.mtmd_input_chunk_free(chunk)
            images -= key not in self.tiles

    def cells(self, tokens: list[int]) -> int:
        """KV cells these tokens fill: each image's embeddings in place of its placeholders."""
        n = len(tokens)
        for t in tokens:
            if t < 0:
                key, i = image_key(t)
                if i == 0 and key in self.sizes:
                    n_tokens, n_pos = self.sizes[key]
                    n += n_tokens - n_pos
        return n

    def eval(self, lctx: Any, token: int, n_past: int, seq: int, n_batch: int) -> tuple[int, bool]:
        """Decode the image whose run starts with this placeholder into the sequence at n_past,
        encoding it unless its embeddings are kept; (the positions it took, whether an image was
        encoded: of a tiled image's chunks, the first counts for the image)."""
        key, i = image_key(token)
        assert i == 0, "an image is evaluated from its start"
        found = self.chunks.get(key)
        if found is None:
            raise EngineError("an image of the request was dropped before it was evaluated "
                              f"(more than {KEEP_IMAGES} images waited)", "send fewer images at once")
        chunk, n_pos = found
        from localrun.backends.llama_loader import last_log_error

        mt = self.mt
        embd = self.embeddings.get(key)
        encoded = embd is None
        if embd is None:
            rc = mt.mtmd_encode_chunk(self.ctx, chunk)
            if rc != 0:
                reason = last_log_error()
                raise EngineError(f"encoding an image failed (code {rc}){': ' + reason if reason else ''}")
            size = mt.mtmd_input_chunk_get_n_tokens(chunk) * self.n_embd
            embd = (ctypes.c_float * size)()
            ctypes.memmove(embd, mt.mtmd_get_output_embd(self.ctx), ctypes.sizeof(embd))
            encoded = key not in self.tiles
            self.encoded += encoded
            self._keep(key, embd)
        else:
            self.embeddings.move_to_end(key)
        new = ctypes.c_int32(0)
        rc = mt.mtmd_helper_decode_image_chunk(self.ctx, lctx, chunk, embd, n_past, seq, n_batch, ctypes.byref(new),
                                               mt.mtmd_helper_post_decode_callback(), None)
        if rc != 0:
            reason = last_log_error()
            raise EngineError(f"evaluating an image failed (code {rc}){': ' + reason if reason else ''}",
                              "the context may be full; try a larger --ctx")
        return n_pos, encoded

    def _keep(self, key: int, embd: Any) -> None:
        """Keep an image's embeddings, letting the least recently used go beyond EMBEDDINGS_BYTES."""
        size = ctypes.sizeof(embd)
        if size > EMBEDDINGS_BYTES:
            return
        self.embeddings[key] = embd
        self.embeddings_bytes += size
        while self.embeddings_bytes > EMBEDDINGS_BYTES:
            self.embeddings_bytes -= ctypes.sizeof(self.embeddings.popitem(last=False)[1])

    def close(self) -> None:
        for chunk, _ in self.chunks.values():
            self.mt.mtmd_input_chunk_free(chunk)
        self.chunks.clear()
        self.embeddings.clear()
        self.embeddings_bytes = 0
        if self.ctx:
            self.mt.mtmd_free(self.ctx)
            self.ctx = None
