"""What every architecture shares: config keys to GGUF keys, tensor renames via gguf-py's map."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import gguf
import numpy as np

from convert import outtypes
from convert.errors import ConvertError

if TYPE_CHECKING:
    from convert.archs.projector import Projector
    from convert.vocab import Vocab

# Tensors that hold no weights llama.cpp uses.
SKIP_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of a source tensor seen as a matrix (every dimension but the last
    flattened): one part of a GGUF tensor that is written piece after piece."""

    source: str
    start: int = 0
    stop: int | None = None  # None: to the last row


@dataclass
class TensorSpec:
    """How one GGUF tensor is made from one source tensor (or from several pieces)."""

    name: str  # GGUF name
    source: str  # source (Hugging Face) tensor name; "" for a generated tensor
    shape: tuple[int, ...]  # numpy order (rows first)
    # Row-wise function on float32 rows; applied block by block unless `whole` is set.
    fn: Callable[[np.ndarray], np.ndarray] | None = None
    whole: bool = False  # fn needs the whole tensor at once (e.g. a row permutation)
    data: np.ndarray | None = None  # a generated tensor's values (float32)
    # Set: the tensor is these pieces one after another (a layer's experts stacked), streamed
    # block by block; `source` names the first piece's tensor and fn/whole do not apply.
    pieces: tuple[Piece, ...] = ()
    # A fixed type, whatever the output type (bytes that `produce` makes, e.g. MXFP4).
    qtype: gguf.GGMLQuantizationType | None = None
    # Set: the tensor's bytes, as work items made from the checkpoint's source tensors (by name),
    # for data that combines several sources block by block (MXFP4 blocks and their scales);
    # `source` and `also_reads` name what it reads.
    produce: Callable[[Mapping[str, Any]], Iterator[Callable[[], np.ndarray]]] | None = None
    also_reads: tuple[str, ...] = ()

    @property
    def sources(self) -> tuple[str, ...]:
        """Every source tensor this one reads, in order, once each."""
        if self.pieces:
            return tuple(dict.fromkeys(p.source for p in self.pieces))
        return ((self.source,) if self.source else ()) + self.also_reads


def permute_rows(n_head: int) -> Callable[[np.ndarray], np.ndarray]:
    """HF rotary layout (halves) to llama.cpp's interleaved (pairs) layout for Q/K rows."""

    def fn(w: np.ndarray) -> np.ndarray:
        rows = w.shape[0]
        return (
            w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        )

    return fn


def add_one(w: np.ndarray) -> np.ndarray:
    """Gemma RMSNorm multiplies by (1 + weight); llama.cpp multiplies by the stored weight."""
    return w + np.float32(1.0)


class Arch:
    """One architecture family. Subclasses say only what differs."""

    gguf_arch: ClassVar[gguf.MODEL_ARCH]
    # Extra Hugging Face tensor names (prefix match) that llama.cpp does not use.
    skip_prefixes: ClassVar[tuple[str, ...]] = ()
    # llama.cpp's graph reads output.weight even when the embeddings are tied: the plan copies
    # the embeddings there if the checkpoint has no output matrix.
    output_required: ClassVar[bool] = False
    # A vision-language family: the Arch of its projector file (mmproj), written beside the text
    # model from the same checkpoint.
    projector: ClassVar[type[Projector] | None] = None
    # The file carries a vocabulary and token embeddings (a projector has neither).
    has_vocab: ClassVar[bool] = True
    # What a user of the converted file should know about how llama.cpp runs it (said by convert).
    notice: ClassVar[str | None] = None

    def __init__(self, config: dict[str, Any]) -> None:
        if isinstance(config.get("text_config"), dict):
            config = {**config, **config["text_config"]}
        self.config = config
        self.n_layers = int(self.need("num_hidden_layers"))
        self.tensor_map = gguf.get_tensor_name_map(self.gguf_arch, self.n_layers)

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.gguf_arch]

    def need(self, *keys: str) -> Any:
        """The first of keys present in config.json, or a ConvertError."""
        for key in keys:
            if self.config.get(key) is not None:
                return self.config[key]
        raise ConvertError(
            f"config.json lacks {keys[0]!r}", "the checkpoint's config is incomplete"
        )

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key)
        return default if value is None else value

    # --- rope -------------------------------------------------------------------------------
    def rope(self, kind: str = "full_attention") -> dict[str, Any]:
        """Rope parameters (transformers 5 `rope_parameters` or the older flat keys)."""
        params = self.config.get("rope_parameters") or self.config.get("rope_scaling") or {}
        params = dict(params)
        if kind in params and isinstance(params[kind], dict):
            params = dict(params[kind])
        elif "full_attention" in params and isinstance(params["full_attention"], dict):
            params = dict(params["full_attention"])
        if "rope_theta" not in params and self.config.get("rope_theta") is not None:
            params["rope_theta"] = self.config["rope_theta"]
        if "rope_type" not in params and params.get("type") is not None:
            params["rope_type"] = params["type"]
        return params

    def head_dim(self) -> int:
        hd = self.config.get("head_dim")
        if hd:
            return int(hd)
        return int(self.need("hidden_size")) // int(self.need("num_attention_heads"))

    # --- metadata ---------------------------------------------------------------------------
    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        """Hyper-parameters common to llama.cpp's decoder-only models."""
        w.add_block_count(self.n_layers)
        if (n_ctx := self.get("max_position_embeddings")) is not None:
            w.add_context_length(int(n_ctx))
        w.add_embedding_length(int(self.need("hidden_size")))
        w.add_feed_forward_length(int(self.need("intermediate_size")))
        n_head = int(self.need("num_attention_heads"))
        w.add_head_count(n_head)
        w.add_head_count_kv(int(self.get("num_key_value_heads", n_head)))
        rope = self.rope()
        if (theta := rope.get("rope_theta")) is not None:
            w.add_rope_freq_base(float(theta))
        sliding = (self.get("rope_parameters") or {}).get("sliding_attention")
        if isinstance(sliding, dict) and sliding.get("rope_theta") is not None:
            w.add_rope_freq_base_swa(float(sliding["rope_theta"]))  # as llama.cpp's converter
        self.write_rope_scaling(w, rope)
        w.add_layer_norm_rms_eps(float(self.get("rms_norm_eps", 1e-6)))
        if self.config.get("head_dim") is not None:
            w.add_key_length(int(self.config["head_dim"]))
            w.add_value_length(int(self.config["head_dim"]))

    def write_rope_scaling(self, w: gguf.GGUFWriter, rope: dict[str, Any]) -> None:
        rope_type = (rope.get("rope_type") or "default").lower()
        factor = rope.get("factor")
        if rope_type == "linear" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(factor))
        elif rope_type == "yarn" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(factor))
            w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
            if (ext := rope.get("extrapolation_factor")) is not None:
                w.add_rope_scaling_yarn_ext_factor(float(ext))
            attn = rope.get("attention_factor", rope.get("attn_factor"))
            if attn is not None:
                # llama.cpp scales attention by YaRN's own 0.1 ln(factor) + 1 and ignores the key
                default = 0.1 * math.log(float(factor)) + 1.0 if float(factor) > 1.0 else 1.0
                if abs(float(attn) - default) > 1e-4 * default:
                    raise ConvertError(
                        f"the yarn attention factor {attn} differs from 0.1 ln({factor}) + 1 = "
                        f"{default:.4f}, the only one llama.cpp applies",
                        "llama.cpp would run this model with the wrong attention scale",
                    )
                w.add_rope_scaling_yarn_attn_factor(float(attn))
            if (fast := rope.get("beta_fast")) is not None:
                w.add_rope_scaling_yarn_beta_fast(float(fast))
            if (slow := rope.get("beta_slow")) is not None:
                w.add_rope_scaling_yarn_beta_slow(float(slow))
        elif rope_type not in ("default", "llama3", "longrope", "su"):
            raise ConvertError(
                f"rope type {rope_type!r} is not supported for {self.name}",
                "supported: default, linear, yarn, llama3, longrope",
            )

    def read_folder(self, folder: Path) -> None:
        """Read what the family needs from the model's folder besides config.json (a reranker's
        tokens, from its tokenizer); called once, before any tensor is planned."""

    def projector_class(self) -> type[Projector] | None:
        """The projector this checkpoint's config calls for (a family with several towers picks)."""
        return self.projector

    # --- tensors ----------------------------------------------------------------------------
    def skip(self, name: str) -> bool:
        return name.endswith(SKIP_SUFFIXES) or name.startswith(self.skip_prefixes)

    def gguf_name(self, name: str) -> str:
        new = self.tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ConvertError(
                f"tensor {name!r} has no llama.cpp equivalent for {self.name}",
                "the checkpoint may be a variant this converter does not know",
            )
        return new

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        """The GGUF tensor(s) made from one source tensor (none to drop it)."""
        if self.skip(name):
            return []
        new = self.gguf_name(name)
        return [TensorSpec(new, name, shape, fn=self.transform(name))]

    def joined_specs(self, shapes: Mapping[str, tuple[int, ...]]) -> list[TensorSpec]:
        """GGUF tensors made from several source tensors (a layer's experts stacked); the
        sources they read get no tensor of their own."""
        return []

    def transform(self, name: str) -> Callable[[np.ndarray], np.ndarray] | None:
        return None

    def ordered(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        """The file's tensors in the order written (default: the source's)."""
        return specs

    def tensor_type(
        self, name: str, shape: tuple[int, ...], outtype: gguf.GGMLQuantizationType
    ) -> gguf.GGMLQuantizationType:
        """The GGUF type of one tensor for a directly written output type."""
        return outtypes.tensor_type(name, shape, outtype)

    def extra_tensors(self) -> list[TensorSpec]:
        """Tensors computed from the config (rope factors)."""
        return []

    def tensor_name(
        self, key: gguf.MODEL_TENSOR, bid: int | None = None, suffix: str = ".weight"
    ) -> str:
        name = gguf.TENSOR_NAMES[key]
        return (name.format(bid=bid) if bid is not None else name) + suffix

    # --- vocabulary -------------------------------------------------------------------------
    def load_vocab(self, folder: Path, n_vocab: int | None) -> Vocab | None:
        """The family's own vocabulary reader (None: the common one, convert.vocab.load_vocab)."""
        return None

    def add_space_prefix(self) -> bool | None:
        """Override of the SentencePiece space prefix (None: from the tokenizer)."""
        return None

    def add_bos_token(self) -> bool | None:
        """Override of whether llama.cpp adds a BOS token (None: from tokenizer_config.json)."""
        return None


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """Per-frequency factors of Llama 3.1's rope scaling (llama.cpp's rope_freqs tensor)."""
    base = float(rope.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = float(rope.get("factor", 8.0))
    low = float(rope.get("low_freq_factor", 1.0))
    high = float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


# --- mixture of experts ---------------------------------------------------------------------------

_T = gguf.MODEL_TENSOR
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# model.layers.N.<block>.experts.E.<projection>.weight: one projection of one expert.
_PER_EXPERT = re.compile(
    r"^model\.layers\.(?P<bid>\d+)\.\w+\.experts\.(?P<xid>\d+)\.(?P<proj>\w+)\.weight$"
)


class MoeArch(Arch):
    """A mixture-of-experts family: each layer's experts become llama.cpp's stacked tensors
    [n_expert, rows, cols], written piece by piece (never a whole layer in memory)."""

    # Projection names of per-expert tensors (model.layers.N.<block>.experts.E.<name>.weight).
    expert_projs: ClassVar[Mapping[str, gguf.MODEL_TENSOR]] = {
        "gate_proj": _T.FFN_GATE_EXP,
        "up_proj": _T.FFN_UP_EXP,
        "down_proj": _T.FFN_DOWN_EXP,
    }
    # Name endings of 3D expert tensors: [n_expert, 2 * n_ff, n_embd] with the gate rows before
    # the up rows (transformers 5's in-memory layout), and [n_expert, n_embd, n_ff] down weights.
    fused_gate_up: ClassVar[tuple[str, ...]] = (
        ".experts.gate_up_proj",
        ".experts.gate_up_proj.weight",
    )
    fused_down: ClassVar[tuple[str, ...]] = (".experts.down_proj", ".experts.down_proj.weight")
    # Whether llama.cpp's graph renormalizes the top-k routing weights; None: the family's
    # config has no norm_topk_prob choice.
    topk_renorm: ClassVar[bool | None] = None

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.check_experts()  # before any weight is read

    def expert_count(self) -> int:
        return int(self.need("num_local_experts", "num_experts"))

    def check_experts(self) -> None:
        """Refuse configs that llama.cpp's graph for this family would compute differently."""
        renorm = self.config.get("norm_topk_prob")
        if self.topk_renorm is not None and renorm is not None and bool(renorm) != self.topk_renorm:
            how = "always" if self.topk_renorm else "never"
            raise ConvertError(
                f"llama.cpp's {self.name} {how} renormalizes the top-k routing weights, "
                f"but config.json sets norm_topk_prob to {renorm}",
                "llama.cpp cannot run this variant as it was trained",
            )
        if self.get("mlp_only_layers") or int(self.get("decoder_sparse_step", 1)) != 1:
            raise ConvertError(
                "the checkpoint mixes dense and expert layers (mlp_only_layers, decoder_sparse_step)",
                f"llama.cpp's {self.name} needs experts in every layer",
            )

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        w.add_expert_count(self.expert_count())
        w.add_expert_used_count(int(self.need("num_experts_per_tok")))
        if (n_ff := self.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(int(n_ff))

    def _bid(self, name: str) -> int:
        m = _LAYER.match(name)
        if m is None:
            raise ConvertError(f"expert tensor {name!r} belongs to no layer")
        return int(m[1])

    def _experts_shape(self, name: str, shape: tuple[int, ...], what: str) -> None:
        n = self.expert_count()
        if len(shape) != 3 or shape[0] != n:
            raise ConvertError(
                f"tensor {name!r} has shape {list(shape)}, expected [{n}, {what}]",
                "the checkpoint does not match its config.json",
            )

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        m = _PER_EXPERT.match(name)
        if m and m["proj"] in self.expert_projs:
            return []  # stacked with the layer's other experts by joined_specs
        if self.skip(name):
            return []
        if name.endswith(self.fused_gate_up):
            self._experts_shape(name, shape, "2 * n_ff, n_embd")
            if shape[1] % 2:
                raise ConvertError(f"tensor {name!r} has an odd number of gate/up rows")
            n, rows, ff = shape[0], shape[1], shape[1] // 2
            out = []
            for key, offset in ((_T.FFN_GATE_EXP, 0), (_T.FFN_UP_EXP, ff)):
                pieces = tuple(
                    Piece(name, e * rows + offset, e * rows + offset + ff) for e in range(n)
                )
                gguf_name = self.tensor_name(key, self._bid(name))
                out.append(TensorSpec(gguf_name, name, (n, ff, shape[2]), pieces=pieces))
            return out
        if name.endswith(self.fused_down):
            self._experts_shape(name, shape, "n_embd, n_ff")
            gguf_name = self.tensor_name(_T.FFN_DOWN_EXP, self._bid(name))
            return [TensorSpec(gguf_name, name, shape, pieces=(Piece(name),))]
        return super().specs(name, shape)

    def joined_specs(self, shapes: Mapping[str, tuple[int, ...]]) -> list[TensorSpec]:
        groups: dict[tuple[int, str], dict[int, str]] = {}
        for name in shapes:
            m = _PER_EXPERT.match(name)
            if m and m["proj"] in self.expert_projs:
                groups.setdefault((int(m["bid"]), m["proj"]), {})[int(m["xid"])] = name
        n = self.expert_count()
        out = []
        for (bid, proj), by_expert in groups.items():
            if sorted(by_expert) != list(range(n)):
                missing = sorted(set(range(n)) - set(by_expert))
                raise ConvertError(
                    f"layer {bid} has {len(by_expert)} experts' {proj} weights, config.json "
                    f"says {n}"
                    + (f" (missing: {', '.join(map(str, missing))})" if missing else ""),
                    "the checkpoint looks incomplete or does not match its config.json",
                )
            names = [by_expert[x] for x in range(n)]
            shape = shapes[names[0]]
            if len(shape) != 2 or any(shapes[x] != shape for x in names):
                raise ConvertError(f"the experts' {proj} weights of layer {bid} differ in shape")
            gguf_name = self.tensor_name(self.expert_projs[proj], bid)
            pieces = tuple(Piece(x) for x in names)
            out.append(TensorSpec(gguf_name, names[0], (n, *shape), pieces=pieces))
        return out
