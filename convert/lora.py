"""PEFT LoRA adapters: read and check them, turn them into llama.cpp adapter tensors, or merge them.

PEFT stores one update per targeted module, W' = W + scaling * (B @ A), with lora_A (r, in) and
lora_B (out, r) (embeddings: lora_embedding_A (r, rows), lora_embedding_B (dim, r)) and
scaling = alpha / r, or alpha / sqrt(r) with rsLoRA. llama.cpp applies
scale * adapter.lora.alpha / r * B @ A at run time, with r taken from each tensor.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from convert.errors import ConvertError
from convert.source import (
    SourceTensor,
    load_pickle,
    load_safetensors,
    read_json,
    tensors_from_state_dict,
)

if TYPE_CHECKING:
    from convert.checkpoint import BaseModel

CONFIG_FILE = "adapter_config.json"
_PREFIX = "base_model.model."
MERGE_HINT = "merge it into the model instead: localrun convert BASE_DIR --lora ADAPTER_DIR"
_PAIR = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B)$"
)
_LAYER = re.compile(r"\.(\d+)\.")
# LoraConfig fields that switch PEFT to a LoRA variant llama.cpp does not compute.
_VARIANTS = ("velora_config", "monteclora_config", "use_bdlora", "arrow_config", "kasa_config")
_OTHER_TYPES = {
    "IA3": "IA3 rescales activations",
    "PROMPT_TUNING": "prompt tuning adds virtual tokens",
    "MULTITASK_PROMPT_TUNING": "prompt tuning adds virtual tokens",
    "P_TUNING": "p-tuning adds virtual tokens",
    "PREFIX_TUNING": "prefix tuning adds virtual key/value tokens",
    "ADAPTION_PROMPT": "adaption prompts add gated prompt tokens",
    "LOHA": "LoHa multiplies low-rank pairs elementwise",
    "LOKR": "LoKr uses Kronecker products",
    "ADALORA": "AdaLoRA stores an SVD-shaped triplet",
    "OFT": "OFT rotates the weights",
    "BOFT": "BOFT rotates the weights",
    "VERA": "VeRA scales shared random matrices",
    "XLORA": "X-LoRA mixes adapters per token",
    "LN_TUNING": "it tunes the layer norms",
}


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    """Whether path is a PEFT adapter folder (it holds adapter_config.json)."""
    return (Path(path) / CONFIG_FILE).is_file()


def describe_module(module: str) -> str:
    """'q_proj of layer 0' for model.layers.0.self_attn.q_proj; the name itself without a layer."""
    m = _LAYER.search(f".{module}.")
    short = module.rsplit(".", 1)[-1]
    return f"{short} of layer {m.group(1)}" if m else module


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's get_pattern_key: the first pattern that matches the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


@dataclass(frozen=True)
class LoraWeight:
    """The low-rank update of one base weight: W + scaling * (B @ A)."""

    target: str  # base tensor name, e.g. model.layers.0.self_attn.q_proj.weight
    a: SourceTensor
    b: SourceTensor
    rank: int
    alpha: float  # this module's lora_alpha (alpha_pattern applied)
    scaling: float  # PEFT's factor: alpha / r, or alpha / sqrt(r) with rsLoRA
    embedding: bool = False  # lora_embedding_A/B: the update is (B @ A).T

    @property
    def module(self) -> str:
        return self.target.removesuffix(".weight")

    @property
    def base_shape(self) -> tuple[int, int]:
        """The (rows, columns) of the base weight the update fits."""
        if self.embedding:
            return (self.a.shape[1], self.b.shape[0])
        return (self.b.shape[0], self.a.shape[1])


@dataclass(frozen=True)
class Adapter:
    """One PEFT LoRA adapter folder, indexed but not loaded."""

    path: Path
    config: dict[str, Any]
    rank: int  # r of adapter_config.json (rank_pattern may differ per module)
    lora_alpha: float
    rslora: bool
    weights: dict[str, LoraWeight]  # by base tensor name
    full: dict[str, SourceTensor] = field(default_factory=dict)  # whole replacement tensors
    frozen: dict[str, tuple[int, ...]] = field(default_factory=dict)  # saved base_layer copies

    @property
    def name(self) -> str:
        return self.path.resolve().name

    @property
    def base_model(self) -> str | None:
        """base_model_name_or_path of adapter_config.json: a Hub id or a local path, if recorded."""
        value = self.config.get("base_model_name_or_path")
        return str(value) if value else None

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The short names of the modules the adapter updates (q_proj, down_proj, ...)."""
        return tuple(sorted({w.module.rsplit(".", 1)[-1] for w in self.weights.values()}))

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({w.rank for w in self.weights.values()}))

    @property
    def gguf_alpha(self) -> float:
        """adapter.lora.alpha for llama.cpp: its alpha / r must equal PEFT's scaling at rank r."""
        return self.lora_alpha * math.sqrt(self.rank) if self.rslora else self.lora_alpha

    @property
    def invocation_tokens(self) -> list[int] | None:
        """aLoRA: the tokens after which the adapter switches on."""
        tokens = self.config.get("alora_invocation_tokens")
        return [int(t) for t in tokens] if tokens else None

    def fold_factor(self, w: LoraWeight) -> float:
        """What lora_b is multiplied by so that llama.cpp's gguf_alpha / r gives w's scaling."""
        if w.rank == self.rank and w.alpha == self.lora_alpha:
            return 1.0
        return w.scaling * w.rank / self.gguf_alpha


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise ConvertError(
            f"adapter {folder} is not a folder",
            "pass a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)",
        )
    if not path.is_file():
        raise ConvertError(
            f"{folder} has no {CONFIG_FILE}",
            "pass a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)",
        )
    config = read_json(path)
    if not isinstance(config, dict):
        raise ConvertError(f"{path} does not hold a JSON object")
    return config


def _check_config(config: dict[str, Any], folder: Path) -> None:
    """Refuse adapter kinds whose math is not plain LoRA, naming the kind."""
    peft_type = str(config.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        what = _OTHER_TYPES.get(peft_type, "not an update llama.cpp's LoRA loader applies")
        raise ConvertError(
            f"adapter '{folder.name}' has peft_type {peft_type} ({what}), not LORA",
            "only PEFT LoRA adapters (peft_type LORA) convert to llama.cpp adapters",
        )
    if config.get("use_dora"):
        raise ConvertError(
            f"adapter '{folder.name}' is a DoRA adapter (use_dora: true): llama.cpp has no DoRA",
            "merge it in PyTorch (peft's merge_and_unload) and convert the merged model",
        )
    refusals = {
        "fan_in_fan_out": "stores transposed (Conv1D-style) weights",
        "lora_bias": "trains a bias on lora_B",
        "use_qalora": "is a QA-LoRA adapter",
        "layer_replication": "replicates layers",
        "trainable_token_indices": "trains single token embeddings",
        "target_parameters": "targets raw parameters (e.g. MoE experts)",
    }
    for key, what in refusals.items():
        if config.get(key):
            raise ConvertError(
                f"adapter '{folder.name}' {what} ({key} in {CONFIG_FILE}), which the converter does not "
                "support",
                "train a plain LoRA adapter, or merge it in PyTorch and convert the merged model",
            )
    variants = [k for k in _VARIANTS if config.get(k)]
    if str(config.get("init_lora_weights")).lower() == "mica":
        variants.append("init_lora_weights=mica")
    if variants:
        raise ConvertError(
            f"adapter '{folder.name}' uses the LoRA variant {', '.join(variants)}: llama.cpp applies "
            "plain LoRA only",
            "merge it in PyTorch (peft's merge_and_unload) and convert the merged model",
        )


def _adapter_tensors(folder: Path) -> dict[str, SourceTensor]:
    safe = folder / "adapter_model.safetensors"
    if safe.is_file():
        return load_safetensors([safe])
    binary = folder / "adapter_model.bin"
    if binary.is_file():
        return tensors_from_state_dict(load_pickle(binary))
    raise ConvertError(
        f"{folder} has no adapter_model.safetensors or adapter_model.bin",
        "download or save the complete adapter",
    )


def _base_name(key: str) -> str:
    name = key.removeprefix(_PREFIX)
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def read_adapter(folder: str | os.PathLike[str]) -> Adapter:
    """Index and check a PEFT LoRA adapter folder (adapter_config.json + adapter_model.*)."""
    folder = Path(folder)
    config = _read_config(folder)
    _check_config(config, folder)
    tensors = _adapter_tensors(folder)
    # PEFT's defaults where the config leaves them out
    rank = int(config["r"] if config.get("r") is not None else 8)
    lora_alpha = float(config["lora_alpha"] if config.get("lora_alpha") is not None else 8)
    rslora = bool(config.get("use_rslora"))
    if lora_alpha == 0:
        raise ConvertError(
            f"adapter '{folder.name}' has lora_alpha 0: the adapter changes nothing",
            f"fix lora_alpha in {CONFIG_FILE}",
        )
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    halves: dict[str, dict[str, SourceTensor]] = {}
    full: dict[str, SourceTensor] = {}
    frozen: dict[str, tuple[int, ...]] = {}
    for key, t in tensors.items():
        name = _base_name(key)
        if m := _PAIR.match(name):
            halves.setdefault(m["module"], {})[m["kind"]] = t
        elif ".base_layer.weight" in name or ".original_module." in name:
            frozen[name.replace(".base_layer", "")] = t.shape  # PEFT's copy of the base weight
        elif ".lora_" in name:
            raise ConvertError(
                f"adapter '{folder.name}' holds tensor {key!r}, which is not a LoRA A/B matrix",
                "only plain LoRA adapters are supported",
            )
        else:  # modules_to_save, trained biases, (mergekit) norms
            full[name.replace(".base_layer", "")] = t
    weights: dict[str, LoraWeight] = {}
    for module, parts in halves.items():
        embedding = "lora_embedding_A" in parts or "lora_embedding_B" in parts
        a = parts.get("lora_embedding_A" if embedding else "lora_A.weight")
        b = parts.get("lora_embedding_B" if embedding else "lora_B.weight")
        if a is None or b is None:
            have, lack = ("lora_A", "lora_B") if b is None else ("lora_B", "lora_A")
            raise ConvertError(
                f"adapter '{folder.name}' has {have} but no {lack} for {describe_module(module)}",
                "the adapter file is incomplete: save or download it again",
            )
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise ConvertError(
                f"adapter '{folder.name}': lora_A {a.shape} and lora_B {b.shape} of "
                f"{describe_module(module)} do not multiply",
                "the adapter file is damaged: save or download it again",
            )
        r = int(_pattern_value(rank_pattern, module, rank))
        alpha = float(_pattern_value(alpha_pattern, module, lora_alpha))
        if a.shape[0] != r:
            raise ConvertError(
                f"adapter '{folder.name}': {describe_module(module)} has rank {a.shape[0]} but "
                f"{CONFIG_FILE} says r={r}",
                "the adapter's config and weights do not belong together",
            )
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        target = f"{module}.weight"
        weights[target] = LoraWeight(target, a, b, r, alpha, scaling, embedding)
    if not weights and not full:
        raise ConvertError(
            f"adapter '{folder.name}' holds no LoRA tensors", "save the adapter again"
        )
    return Adapter(folder, config, rank, lora_alpha, rslora, weights, full, frozen)


# --- checks shared by both uses ------------------------------------------------------------------


def check_against(
    adapter: Adapter, shape_of: Callable[[str], tuple[int, ...] | None], label: str, tied: bool
) -> None:
    """Every update must fit a weight of the base (same shape); fail on the first that does not."""
    for w in sorted(adapter.weights.values(), key=lambda w: _order(w.target)):
        if tied and w.target == "lm_head.weight":
            raise ConvertError(
                f"adapter '{adapter.name}' updates lm_head, which the base '{label}' ties to its "
                "token embeddings: llama.cpp has no separate output weight to apply it to",
                "retrain without lm_head in target_modules",
            )
        have = shape_of(w.target)
        if have is None:
            raise ConvertError(
                f"adapter tensor {describe_module(w.module)} targets {w.target!r}, which the "
                f"base '{label}' does not have: this adapter was trained for another model",
                "pass the right one with --base",
            )
        want = w.base_shape
        if tuple(have) != want:
            raise ConvertError(
                f"adapter tensor {describe_module(w.module)} expects a {want[0]}x{want[1]} "
                f"weight, the base '{label}' has {'x'.join(map(str, have))}: this adapter was "
                "trained for another model",
                "pass the right one with --base",
            )
        if w.embedding and tied:
            raise ConvertError(
                f"adapter '{adapter.name}' updates the token embeddings, which the base '{label}' "
                "ties to its output layer: llama.cpp would apply the update to both",
                "retrain without embed_tokens in target_modules",
            )
    if tied and "lm_head.weight" in adapter.full:
        raise ConvertError(
            f"adapter '{adapter.name}' replaces lm_head, which the base '{label}' ties to its "
            "token embeddings: llama.cpp has no separate output weight to replace",
            "retrain without lm_head in modules_to_save",
        )
    for name, shape in [*adapter.frozen.items(), *((n, t.shape) for n, t in adapter.full.items())]:
        have = shape_of(name)
        if have is not None and tuple(have) != tuple(shape):
            raise ConvertError(
                f"adapter '{adapter.name}' holds {name} as {'x'.join(map(str, shape))}, the base "
                f"'{label}' has {'x'.join(map(str, have))} (a resized vocabulary?)",
                "pass the base the adapter was trained on with --base",
            )


def is_norm(name: str) -> bool:
    """Norm weights, which mergekit-style adapters carry whole and llama.cpp skips."""
    parts = name.rsplit(".", 2)
    return len(parts) >= 2 and "norm" in parts[-2]


# --- a llama.cpp adapter file ---------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterTensor:
    """One tensor of a GGUF adapter: a source tensor, and what to do to its float32 values."""

    name: str  # blk.0.attn_q.weight.lora_a
    shape: tuple[int, ...]  # numpy order
    source: SourceTensor
    fn: Callable[[np.ndarray], np.ndarray] | None = None


def _scaled(fn: Callable[[np.ndarray], np.ndarray] | None, factor: float):  # noqa: ANN202
    if factor == 1.0:
        return fn
    f = np.float32(factor)
    return (lambda x: fn(x) * f) if fn is not None else (lambda x: x * f)


def _transposed(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


def gguf_adapter_tensors(
    adapter: Adapter, base: BaseModel
) -> tuple[list[AdapterTensor], list[str]]:
    """The .lora_a/.lora_b tensors llama.cpp loads, named by the converter's architecture table.

    Returns the tensors and the skipped whole norm tensors; whole weights (modules_to_save,
    trained biases) cannot be carried and fail.
    """
    check_against(adapter, base.shape, base.label, base.tied)
    skipped: list[str] = []
    for name in adapter.full:
        if is_norm(name):
            skipped.append(name)
            continue
        why = "a trained bias" if name.endswith(".bias") else "modules_to_save"
        raise ConvertError(
            f"adapter '{adapter.name}' replaces the whole {name} ({why}), which a llama.cpp "
            "adapter cannot carry",
            MERGE_HINT,
        )
    out: list[AdapterTensor] = []
    for w in sorted(adapter.weights.values(), key=lambda w: _order(w.target)):
        specs = base.arch.specs(w.target, w.base_shape)
        if len(specs) != 1:
            raise ConvertError(
                f"adapter tensor {describe_module(w.module)} targets {w.target!r}, which "
                f"{base.arch.name} does not keep as one llama.cpp tensor",
                MERGE_HINT,
            )
        spec = specs[0]
        factor = adapter.fold_factor(w)
        if w.embedding:
            # llama.cpp gathers token rows of lora_a: (rows, r), and lora_b stays (dim, r).
            a_shape = (w.a.shape[1], w.a.shape[0])
            out.append(AdapterTensor(f"{spec.name}.lora_a", a_shape, w.a, _transposed))
            out.append(AdapterTensor(f"{spec.name}.lora_b", w.b.shape, w.b, _scaled(None, factor)))
            continue
        out.append(AdapterTensor(f"{spec.name}.lora_a", w.a.shape, w.a))
        # The architecture's row transform (Q/K permutation) acts on the output rows: B's.
        out.append(AdapterTensor(f"{spec.name}.lora_b", w.b.shape, w.b, _scaled(spec.fn, factor)))
    return out, skipped


def _order(name: str) -> tuple[int, str]:
    m = _LAYER.search(f".{name}.")
    return (int(m.group(1)) if m else -1, name)


def read_adapters(
    lora: Iterable[tuple[str | os.PathLike[str] | Adapter, float]],
) -> list[tuple[Adapter, float]]:
    """Read the adapters of (adapter folder or Adapter, scale) pairs."""
    out: list[tuple[Adapter, float]] = []
    for item in lora:
        try:
            source, scale = item
            scale = float(scale)
        except (TypeError, ValueError) as e:
            raise ConvertError(
                f"lora entry {item!r} is not (adapter folder, scale)",
                "pass lora=[(ADAPTER_DIR, 1.0), ...]",
            ) from e
        out.append((source if isinstance(source, Adapter) else read_adapter(source), scale))
    return out
