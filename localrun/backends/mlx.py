"""The MLX engine, through mlx-lm: MLX model folders and Hugging Face safetensors checkpoints.

Sequences run through mlx-lm's BatchGenerator (continuous batching: prefill in chunks, the next
token computed while the current one is handed out), driven by the shared engine loop. The chat
template is rendered by localrun's sandboxed Jinja, not by transformers. It runs inside the
engine worker process. A vision-language model (config.json with a vision_config) loads through
mlx-vlm when it is installed, and its sequences run beside each other on it (mlx_vision). Its
text side is in mlx_text, its samplers in mlx_sampling, its drafting in mlx_speculative.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

from localrun.backends.base import Abilities, Embeddings, Ranked, Sampled, token_logprob
from localrun.backends.drafting import DraftControl, PromptLookup, StepCost, worth_drafting
from localrun.backends.grammar import Grammars, GrammarState
from localrun.backends.mlx_model import flat_rope, layers_prefix
from localrun.backends.mlx_sampling import biasing, constrain, forcing, make_sampler, penalties
from localrun.backends.mlx_speculative import MLXDrafting, MLXDraftModel, SpecSeq
from localrun.backends.mlx_text import MLXText
from localrun.backends.mlx_vision import (
    VLM_HINT,
    VisionModel,
    is_vision_config,
    read_config,
    unsupported,
    vlm_installed,
)
from localrun.errors import (
    BackendUnavailableError,
    BadModelFileError,
    EngineError,
    UsageError,
)
from localrun.fit import context_for
from localrun.generation import TokenLogprob
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import ModelInfo

INSTALL_HINT = "install MLX with pip install 'localrun[mlx]' (Metal on Apple Silicon, mlx[cpu] on Linux)"
ABILITIES = Abilities(load_adapters=True, structured_output=True, drafting=True, images=True)


def mlx_installed() -> bool:
    """Whether mlx (with its native core) and mlx-lm are installed, without importing them."""
    if importlib.util.find_spec("mlx_lm") is None:
        return False
    spec = importlib.util.find_spec("mlx")  # a namespace package: finding it runs no code
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(any(Path(p).glob("core*")) for p in spec.submodule_search_locations)


def _import() -> tuple[Any, Any]:
    try:
        import mlx.core as mx
        import mlx_lm
    except ImportError as e:
        raise BackendUnavailableError(f"the MLX engine is not installed ({e.name} is missing)", INSTALL_HINT) from e
    return mx, mlx_lm


def device_name(mx: Any) -> str:
    """'Metal GPU (Apple M2)', 'CUDA GPU (...)' or 'CPU (...)': where MLX computes by default."""
    dev = mx.default_device()
    try:
        name = str(mx.device_info().get("device_name") or "")
    except Exception:  # noqa: BLE001 - a name is a nicety
        name = ""
    suffix = f" ({name})" if name else ""
    if dev.type == mx.gpu:
        kind = "Metal GPU" if mx.metal.is_available() else "CUDA GPU"
        return kind + suffix
    return "CPU" + suffix


def system_info() -> dict[str, Any]:
    """Versions of mlx, mlx-lm and mlx-vlm (None: not installed) and the device MLX runs on."""
    mx, _ = _import()
    from importlib.metadata import PackageNotFoundError, version

    try:
        vlm: str | None = version("mlx-vlm")
    except PackageNotFoundError:
        vlm = None
    return {
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "mlx_vlm": vlm,
        "device": device_name(mx),
        "metal": bool(mx.metal.is_available()),
    }


class MLXBackend:
    """MLX-format folders and Hugging Face safetensors checkpoints on MLX (Metal GPU or CPU)."""

    name = "mlx"
    title = "MLX"
    formats = ("mlx", "safetensors")
    install_hint = INSTALL_HINT
    packages = ("mlx", "mlx-lm", "mlx-vlm")
    abilities = ABILITIES
    copies_from = ("gguf",)
    copy_hint = "make an MLX copy with 'localrun convert {path} --to mlx'"

    def available(self) -> bool:
        return mlx_installed()

    def warm(self) -> None:
        _import()

    def load(self, model: ModelInfo, options: LoadOptions) -> MLXEngine:
        if options.cpu_moe:
            raise UsageError(
                f"--cpu-moe works only with the llama.cpp engine, and '{model.name}' runs on MLX"
                " (MLX keeps every weight in unified memory)",
                "drop --cpu-moe, or run a GGUF copy of the model on llama.cpp",
            )
        if options.kv_type != "f16":
            # mlx-lm's QuantizedKVCache has no batched form: its BatchGenerator refuses to merge one
            raise UsageError(
                f"--kv-type {options.kv_type}: the MLX engine keeps an f16 KV cache only (mlx-lm batches no "
                f"quantized cache), and '{model.name}' runs on MLX",
                "drop --kv-type, or run a GGUF copy of the model on llama.cpp "
                f"('localrun convert {model.path}' makes one from a Hugging Face checkpoint)",
            )
        return MLXEngine(model, options)

    def system_info(self) -> dict[str, Any]:
        return system_info()

    @staticmethod
    def describe(facts: dict[str, Any]) -> list[tuple[str, str]]:
        images = f", mlx-vlm {facts['mlx_vlm']}" if facts.get("mlx_vlm") else " (no mlx-vlm: no images)"
        return [("version", f"mlx {facts.get('mlx')}, mlx-lm {facts.get('mlx_lm')}{images}"),
                ("device", str(facts.get("device")))]


class MLXEngine(MLXText, MLXDrafting):
    """A model on MLX whose sequences run through mlx-lm's continuous batching (BatchGenerator).

    A slot's KV cache is taken back from the generator when its request ends, so the next
    request in that slot reuses the common prefix (MLX caches cannot be copied between slots).
    A vision-language model loads through mlx-vlm instead, and its sequences, with images or
    without, run beside each other on it (mlx_vision).
    """

    abilities = ABILITIES
    can_copy = False
    can_save = False  # an mlx-lm cache is updated in place: keeping one would mean copying every array

    def save(self, slot: int) -> tuple[Any, int] | None:
        return None

    def restore(self, slot: int, state: Any) -> bool:
        return False

    def __init__(self, model: ModelInfo, options: LoadOptions) -> None:
        self.mx, mlx_lm = _import()
        self.model_info = model
        path = Path(model.path)
        self.vision: VisionModel | None = None  # a vision-language model, loaded by mlx-vlm
        self.vision_refused: str | None = None  # why a vision-language model reads text only here
        self.vision_hint = ""  # and what to do about it
        self.gen: Any = None
        self.lora = options.lora
        config = self._load_vision(path, options) if is_vision_config(read_config(path)) else None
        if config is None:
            try:
                self.model, self.tokenizer, config = mlx_lm.load(str(path), return_config=True,
                                                                 model_config=flat_rope(path))
            except FileNotFoundError as e:
                raise BadModelFileError(f"cannot load model '{model.name}' ({path}): {e}",
                                        "an MLX model is a folder with config.json, *.safetensors and tokenizer files") from e
            except (ValueError, KeyError, OSError) as e:
                refused = f"; it is a vision-language model, and {self.vision_refused}" if self.vision_refused else ""
                raise BadModelFileError(f"cannot load model '{model.name}' ({path}): {e}{refused}",
                                        "the folder may be incomplete, or of an architecture this mlx-lm does not know; "
                                        "try 'pip install -U mlx-lm'") from e
        from mlx_lm.generate import BatchGenerator

        if self.lora and self.vision is None:
            self._apply_lora()
        self.config = config
        n_train = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
        self.n_ctx = context_for(model, options, n_train).tokens  # the trained context, if memory holds it
        self.n_train = n_train
        self.n_slots = options.n_parallel
        self.n_vocab = int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
                              or len(self.tokenizer.get_vocab()))
        self.template = self._chat_template()
        self.eos = set(self.tokenizer.eos_token_ids)
        # No stop tokens here: the engine loop ends sequences (EOS included) itself.
        if self.vision is None:
            self.gen = BatchGenerator(self.model, completion_batch_size=max(1, self.n_slots),
                                      prefill_batch_size=max(1, min(8, self.n_slots)), prefill_step_size=2048)
        self.uids: dict[int, int] = {}  # generator uid -> slot
        self.slot_uid: list[int | None] = [None] * self.n_slots
        self.saved: list[Any] = [None] * self.n_slots  # a finished slot's KV cache, for prefix reuse
        self.logprobs: list[int | None] = [None] * self.n_slots
        self.grammar: list[GrammarState | None] = [None] * self.n_slots  # fed by the logits processor
        # Read by each slot's forcing processor (None: a request without a thinking budget has none)
        self.forced: list[list[int] | None] = [None] * self.n_slots
        from localrun.reasoning import detect

        self.reasoning = detect(self.template, lambda t: self.special_id(t) is not None)
        self.grammars = Grammars(self._llg_tokenizer, self.special_id, self.n_vocab,
                                 lambda t: str(self.tokenizer.decode([t])))
        self.spec: dict[int, SpecSeq] = {}  # slot -> a sequence that drafts, beside the generator
        self.spec_counts: list[tuple[int, int]] = [(0, 0)] * self.n_slots  # drafted and kept, of one moved to it
        self.drafter: MLXDraftModel | None = None  # speculative decoding's draft model (--draft MODEL), if loaded
        self.draft_refused: str | None = None  # why the draft model asked for does not draft (draft_optional)
        self._cost = StepCost()  # what a drafting sequence's forward pass costs, to weigh drafts against
        self._drafting_steps = 0
        self._gen_step = 0.0  # a generator step's time with one sequence decoding (a recent average)
        self._gen_uid: int | None = None  # the sequence of the last such step
        self.options = options
        if options.draft and self.vision is not None:  # a server's optional draft model (a required one loads it with mlx-lm)
            self.draft_refused = f"'{model.name}' is a vision-language model, and on MLX it does not draft"
        elif options.draft:
            try:
                self.drafter = MLXDraftModel(options.draft, Path(options.draft).name, self.tokenizer, self.n_slots)
            except (UsageError, BadModelFileError) as e:
                if not options.draft_optional:
                    self.close()
                    raise
                self.draft_refused = e.message

    def _load_vision(self, path: Path, options: LoadOptions) -> dict[str, Any] | None:
        """Load a vision-language model through mlx-vlm: its config, or None when mlx-vlm cannot
        (not installed, or not for its family: the model then loads as text, vision_refused says why)."""
        if not vlm_installed():
            self.vision_refused, self.vision_hint = "mlx-vlm, which reads its images, is not installed", VLM_HINT
            return None
        # Adapters and a draft model work on mlx-lm's model of its language part, as before mlx-vlm.
        if self.lora or (options.draft and not options.draft_optional):
            flag = "--lora" if self.lora else "--draft"
            self.vision_refused = f"with {flag} it loads through mlx-lm, which reads no images"
            self.vision_hint = f"load it without {flag} to send it images"
            return None
        self.vision_refused = unsupported(read_config(path))
        if self.vision_refused:
            self.vision_hint = "run a GGUF copy of it with its projector (--mmproj) on the llama.cpp engine"
            return None
        try:
            self.vision = VisionModel(path, self.model_info.name)
        except BadModelFileError as e:  # e.g. a vision tower missing: the language model may still load
            self.vision_refused, self.vision_hint = f"mlx-vlm could not load it ({e.message})", e.hint or ""
            return None
        self.model = self.vision.model
        from mlx_lm.utils import load_tokenizer

        self.tokenizer = load_tokenizer(path, eos_token_ids=self.vision.eos_token_ids)
        return self.vision.config

    def _apply_lora(self) -> None:
        """Convert the PEFT adapters to one mlx-lm adapter (cached) and apply it with mlx-lm's loader."""
        from mlx_lm.tuner.utils import load_adapters

        from localrun.backends.mlx_adapters import llama_hint, mlx_adapter

        folder = mlx_adapter(self.lora, layers_prefix(self.model))
        names = ", ".join(f"'{p}'" for p, _ in self.lora)
        try:
            load_adapters(self.model, str(folder))
        except (ValueError, KeyError) as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            reason = lines[1] if len(lines) > 1 else (lines[0] if lines else type(e).__name__)
            raise BackendUnavailableError(
                f"cannot apply the LoRA adapter {names} to '{self.model_info.name}' on MLX: {reason}",
                "an adapter runs only on the base model it was trained for; if this is its base, "
                + llama_hint(self.lora[0][0] if len(self.lora) == 1 else "ADAPTER_DIR")) from e
        self.model.eval()
        self.mx.eval(self.model.parameters())

    def info(self) -> dict[str, Any]:
        quant = self.config.get("quantization")
        n_layers = len(getattr(self.model, "layers", []))
        out: dict[str, Any] = {
            "engine": "mlx",
            "n_ctx": self.n_ctx,
            "n_ctx_train": self.n_train,
            "n_parallel": self.n_slots,
            "device": device_name(self.mx),
            "n_layers": n_layers,
            "offloaded": f"{n_layers}/{n_layers}" if self.mx.default_device().type == self.mx.gpu else None,
            "n_vocab": self.n_vocab,
            "chat_template": self.template is not None,
            "quantization": f"{quant['bits']}bit/g{quant['group_size']}" if isinstance(quant, dict) and "bits" in quant else None,
        }
        if self.lora:
            out["lora"] = [{"path": path, "scale": scale} for path, scale in self.lora]
        if self.drafter is not None:
            out["draft_model"] = self.drafter.name
        if self.draft_refused:
            out["draft_refused"] = self.draft_refused
        if self.vision is not None:
            out.update(vision=f"mlx-vlm ({self.vision.family})", images_encoded=self.vision.encoded)
        elif self.vision_refused:
            out["warning"] = f"a vision-language model, but {self.vision_refused}: it reads text only"
        return out

    def force(self, slot: int, tokens: list[int]) -> None:
        """BatchGenerator samples a sequence's next token while handing out the current one: once
        the sequence generates, that token, sampled before the force, is replaced by the first
        forced one (it is what the next step feeds the model), and the rest are queued for the
        forcing processor of a request started with a thinking budget."""
        queued = self.forced[slot]
        assert queued is not None, "only a request started with a thinking budget can be forced"
        queue = list(tokens)
        batch = getattr(self.gen, "_generation_batch", None)
        uid = self.slot_uid[slot]
        if queue and batch is not None and uid in batch.uids and batch._next_tokens is not None:
            mx = self.mx
            ahead = batch._next_tokens
            picked = mx.arange(ahead.shape[0]) == batch.uids.index(uid)
            batch._next_tokens = mx.where(picked, mx.array(queue.pop(0), dtype=ahead.dtype), ahead)
        queued[:] = queue

    # -- the engine loop's operations -----------------------------------------------------
    def start(self, slot: int, tokens: list[int], params: GenerationParams, seed: int, source: int, keep: int) -> int:
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if params.lora:
            raise UsageError("the MLX engine applies LoRA adapters when the model loads, not per request",
                             "give --lora when loading, e.g. 'localrun run BASE --engine mlx --lora ADAPTER', "
                             "or use the llama.cpp engine for per-request adapters")
        mx = self.mx
        cache, self.saved[slot] = self.saved[slot], None
        if self.vision is not None:
            if params.speculative and not self.options.draft_optional:
                raise UsageError(f"'{self.model_info.name}' is a vision-language model, and on MLX it does not draft",
                                 "drop --draft")
            cache, keep = self.vision.reuse(cache, tokens, keep if source == slot else 0)
        elif cache is not None and keep > 0 and source == slot and can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, cache[0].offset - keep)
        else:
            cache, keep = None, 0
        mx.random.seed(seed)
        processors = []
        if params.logit_bias:
            processors.append(biasing(mx, params.logit_bias))
        if params.penalized:
            processors.append(penalties(mx, params, len(tokens) - keep))
        grammar = self.grammars.state(params.grammar, params.grammar_trigger, params.budget(self.n_ctx, len(tokens)))
        if grammar is not None:
            processors.append(constrain(mx, grammar, len(tokens) - keep))
        queued: list[int] | None = None
        if params.think_budget is not None and self.reasoning is not None:
            # Only a thought's budget forces tokens; any processor sends the whole batch down
            # mlx-lm's per-sequence path at every step.
            queued = []
            processors.append(forcing(mx, queued))
        self.forced[slot] = queued
        self.logprobs[slot] = params.logprobs
        self.grammar[slot] = grammar
        self.spec_counts[slot] = (0, 0)
        sampler = make_sampler(mx, params, self.n_vocab)
        if self.vision is not None:
            self.vision.start(slot, tokens, keep, cache, sampler, processors, params.logprobs)
            return keep
        if params.speculative == "model" and self.drafter is None and not self.options.draft_optional:
            raise UsageError(f"no draft model is loaded with '{self.model_info.name}'"
                             + (f" ({self.draft_refused})" if self.draft_refused else ""),
                             "load one with --draft MODEL, or use --draft lookup")
        # A grammar's state follows one token at a time; a server's draft model that cannot draft
        # for this model (draft_optional) gives no drafts, and info() says why.
        by_model = params.speculative == "model" and self.drafter is not None
        # A sequence that could not draft on (see _spec_step) starts in the generator.
        drafts = grammar is None and (by_model or params.speculative == "lookup") and (params.draft_always or (
            not self.uids and not self.spec and worth_drafting(self._min_rate(by_model), params.draft_max)))
        if drafts:
            from mlx_lm.models.cache import make_prompt_cache

            cache = cache if cache is not None else make_prompt_cache(self.model)
            if can_trim_prompt_cache(cache):  # a memory that cannot be cut back to the kept drafts does not draft
                control = DraftControl(draft_max=params.draft_max, draft_min=params.draft_min,
                                       min_rate=0.6 if by_model else 0.3, start=2 if by_model else 4,
                                       always=params.draft_always)
                self.spec[slot] = SpecSeq(tokens, cache, sampler, processors, params.logprobs, control,
                                          params.budget(self.n_ctx, len(tokens)), tokens[keep:-1], keep, keep,
                                          lookup=None if by_model else PromptLookup(tokens),
                                          history=list(tokens) if by_model else None)
                return keep
        (uid,) = self.gen.insert([tokens[keep:]], max_tokens=[self.n_ctx - len(tokens)],
                                 caches=[cache] if cache is not None else None,
                                 samplers=[sampler], logits_processors=[processors])
        self.uids[uid] = slot
        self.slot_uid[slot] = uid
        return keep

    def set_lora(self, lora: tuple[tuple[str, float], ...]) -> None:
        if lora:
            raise UsageError("the MLX engine applies LoRA adapters when the model loads, not per request",
                             "give --lora when loading, e.g. 'localrun run BASE --engine mlx --lora ADAPTER', "
                             "or use the llama.cpp engine for per-request adapters")

    def prefill(self, slot: int, tokens: list[int], start: int) -> None:
        raise EngineError("the MLX engine cannot share a prefill between slots")

    def step(self) -> list[Sampled]:
        if self.vision is not None:
            return [self._sampled(slot, tok, lps) for slot, tok, lps in self.vision.step()]
        out = self._spec_step() if self.spec else []
        if not self.uids:
            return out
        t0 = time.perf_counter()
        generated = self.gen.next_generated()
        # What a kept draft saves: a step of one sequence that generated in the step before too
        # (the first step of a sequence evaluates its prompt).
        uid = generated[0].uid if len(self.uids) == 1 and len(generated) == 1 else None
        if uid is not None and uid == self._gen_uid:
            took = time.perf_counter() - t0
            self._gen_step = 0.9 * self._gen_step + 0.1 * took if self._gen_step else took
        self._gen_uid = uid
        for r in generated:
            slot = self.uids.get(r.uid)
            if slot is None:
                continue  # a sequence removed while its token was in flight
            out.append(self._sampled(slot, int(r.token), r.logprobs))
        return out

    def _sampled(self, slot: int, tok: int, logprobs: Any) -> Sampled:
        top, g = self.logprobs[slot], self.grammar[slot]
        return Sampled(slot, tok, self._logprob(logprobs, tok, top) if top is not None else None,
                       g is not None and g.breaks(tok, self.is_eog(tok)))

    def prompt_cells(self, tokens: list[int]) -> int:
        return len(tokens)  # an image's placeholders stand for its embeddings one for one here

    def images_encoded(self, slot: int) -> int:
        return self.vision.images_encoded(slot) if self.vision is not None else 0

    def finish(self, slot: int) -> int:
        if self.vision is not None:
            self.grammar[slot] = None
            self.saved[slot], n = self.vision.finish(slot)
            return n
        q = self.spec.pop(slot, None)
        if q is not None:
            self.saved[slot] = q.cache
            return q.pos
        uid = self.slot_uid[slot]
        if uid is None:
            return 0
        self.slot_uid[slot] = None
        self.grammar[slot] = None
        self.uids.pop(uid, None)
        caches = self.gen.remove([uid], return_prompt_caches=True)
        entry = caches.get(uid) if isinstance(caches, dict) else None
        if entry is None:
            return 0
        cache = entry[0]
        self.saved[slot] = cache
        return int(cache[0].offset) if cache and hasattr(cache[0], "offset") else 0

    def _logprob(self, logprobs: Any, token: int, top: int) -> TokenLogprob:
        import numpy as np

        lp = np.array(logprobs.astype(self.mx.float32)).reshape(-1)
        return token_logprob(lp, token, top, self.piece)

    def embed(self, texts: list[str | list[int]]) -> Embeddings:
        raise UsageError(f"'{self.model_info.name}' runs on MLX, which has no embedding mode here",
                         "use a GGUF embedding model (it runs on llama.cpp)")

    def rerank(self, query: str, documents: list[str]) -> Ranked:
        raise UsageError(f"'{self.model_info.name}' runs on MLX, which has no reranking mode here",
                         "use a reranker converted to GGUF (it runs on llama.cpp)")

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None
        self.spec = {}
        if self.gen is not None:
            self.gen.close()
        if self.vision is not None:
            self.vision.close()
        self.saved = [None] * self.n_slots
        self.model = None
        self.mx.clear_cache()
