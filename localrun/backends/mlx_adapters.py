"""PEFT LoRA adapters as one mlx-lm adapter folder, so that the MLX engine applies them on load.

A PEFT LoRA adds `scaling * B @ A` to a linear layer (A: rank x in, B: out x rank). mlx-lm's
LoRALinear adds `scale * (x @ lora_a) @ lora_b`, so lora_a = A.T and lora_b = B.T, with PEFT's
scaling and the user's scale folded into lora_b and mlx-lm's own scale set to 1. Several adapters
are one LoRA of their summed rank (their A stacked, their B side by side); mlx-lm gives every
wrapped layer the same rank, so smaller ones are padded with zeros, which add nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from localrun.errors import BackendUnavailableError, BadModelFileError, UsageError

FORMAT = 1  # of the folders written here: a change makes the cache convert again
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"

# PEFT options that change what a LoRA layer computes (beyond scaling * B @ A on a linear layer).
_VARIANTS = {
    "use_dora": "DoRA",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "lora_bias": "lora_bias",
    "modules_to_save": "modules_to_save (fully trained layers)",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA",
    "arrow_config": "Arrow routing",
    "use_bdlora": "block-diagonal LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
    "mica": "MiCA",
}
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+?)\.(?P<part>lora_[A-Za-z_]+)(?:\.default)?(?:\.(?P<leaf>weight|bias))?")
# Module paths around a model's decoder layers that are still the language model (not a vision tower).
_TEXT_PARENTS = {"model", "language_model", "text_model", "transformer", "decoder", "backbone"}


def merge_hint(folder: str) -> str:
    """How to run an adapter that MLX cannot apply: merged into its base model."""
    return f"merge it into its base model instead (a GGUF for llama.cpp): 'localrun convert BASE_DIR --lora {folder}'"


def llama_hint(folder: str) -> str:
    """How to run a LoRA that MLX cannot apply: merged, or as a GGUF adapter on llama.cpp."""
    return (f"run it on llama.cpp: 'localrun convert {folder}' then '--lora NAME', or merge it into its base "
            f"model: 'localrun convert BASE_DIR --lora {folder}'")


def _config(folder: Path) -> dict[str, Any]:
    """The adapter's adapter_config.json, checked to be a plain LoRA that mlx-lm can apply."""
    name = str(folder)
    try:
        cfg = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError as e:
        raise BadModelFileError(f"'{name}' is not a PEFT adapter folder (it has no {CONFIG})",
                                f"a PEFT LoRA folder holds {CONFIG} and {WEIGHTS}") from e
    except (OSError, ValueError) as e:
        raise BadModelFileError(f"cannot read '{folder / CONFIG}': {e}", "the adapter folder may be incomplete") from e
    if not isinstance(cfg, dict):
        raise BadModelFileError(f"'{folder / CONFIG}' is not a PEFT adapter config", "it must hold a JSON object")
    kind = str(cfg.get("peft_type") or "").upper()
    if kind != "LORA":
        raise BackendUnavailableError(f"'{name}' is an adapter of type {kind or 'unknown'}; the MLX engine applies only LoRA adapters",
                                      merge_hint(name))
    for key, what in _VARIANTS.items():
        if cfg.get(key):
            hint = llama_hint(name) if key == "fan_in_fan_out" else merge_hint(name)
            raise BackendUnavailableError(f"'{name}' uses {what}, which the MLX engine cannot apply as a LoRA", hint)
    return cfg


def _tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy (bfloat16 widened to float32, which is exact)."""
    import safetensors

    try:
        items = safetensors.deserialize(path.read_bytes())
    except FileNotFoundError as e:
        other = " (adapter_model.bin is not read: save the adapter as safetensors)" if path.with_suffix(".bin").exists() else ""
        raise BadModelFileError(f"'{path.parent}' has no {path.name}{other}",
                                f"a PEFT LoRA folder holds {CONFIG} and {WEIGHTS}") from e
    except (OSError, safetensors.SafetensorError) as e:
        raise BadModelFileError(f"cannot read '{path}': {e}", "the file may be truncated; download the adapter again") from e
    out = {}
    for name, t in items:
        dtype, shape = t["dtype"], tuple(t["shape"])
        if dtype == "BF16":
            wide = np.frombuffer(bytes(t["data"]), dtype="<u2").astype(np.uint32) << 16
            out[name] = wide.view(np.float32).reshape(shape)
        elif dtype in _DTYPES:
            out[name] = np.frombuffer(bytes(t["data"]), dtype=np.dtype(_DTYPES[dtype]).newbyteorder("<")).reshape(shape)
        else:
            raise BadModelFileError(f"'{path}' holds {name} as {dtype}", "a LoRA adapter's tensors are floats")
    return out


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module path's end."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def _layer_of(module: str, stack: str, folder: str) -> tuple[str, int, str]:
    """(path above the decoder layers, layer index, path inside the layer) of a PEFT module path."""
    m = re.fullmatch(rf"(?P<parent>(?:.*\.)?){re.escape(stack)}\.(?P<idx>\d+)\.(?P<rest>.+)", module)
    if m is None or not set(m["parent"].split(".")[:-1]) <= _TEXT_PARENTS:
        raise BackendUnavailableError(f"'{folder}' adapts '{module}', outside the decoder layers that mlx-lm's LoRA wraps",
                                      llama_hint(folder))
    return m["parent"], int(m["idx"]), m["rest"]


def read_peft(folder: Path, scale: float, stack: str = "layers") -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer index, path inside the layer) -> (A, B with PEFT's scaling and `scale` folded in)."""
    cfg = _config(folder)
    name = str(folder)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in _tensors(folder / WEIGHTS).items():
        m = _KEY.fullmatch(key)
        if m is None or m["leaf"] != "weight" or m["part"] not in ("lora_A", "lora_B"):
            what = "an embedding LoRA" if m is not None and "embedding" in m["part"] else f"the tensor '{key}'"
            raise BackendUnavailableError(f"'{name}' holds {what}, which the MLX engine cannot apply as a LoRA",
                                          llama_hint(name))
        pairs.setdefault(m["module"], {})[m["part"]] = value
    if not pairs:
        raise BadModelFileError(f"'{folder / WEIGHTS}' holds no LoRA tensors", "the adapter folder may be incomplete")
    alpha = float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora"))
    out: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    parents = set()
    for module, pair in sorted(pairs.items()):
        a, b = pair.get("lora_A"), pair.get("lora_B")
        if a is None or b is None or a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
            shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in sorted(pair.items()))
            raise BadModelFileError(f"'{name}' has no matching lora_A/lora_B pair for '{module}' ({shapes})",
                                    "the adapter file may be damaged, or it is not a LoRA on linear layers")
        # PEFT's rank for the module (rank_pattern, else r) is the rank of its tensors.
        rank = a.shape[0]
        mod_alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, module, alpha))
        scaling = mod_alpha / (math.sqrt(rank) if rslora else rank)
        parent, idx, rest = _layer_of(module, stack, name)
        parents.add(parent)
        out[idx, rest] = (a.astype(np.float32), b.astype(np.float32) * np.float32(scaling * scale))
    if len(parents) > 1:
        raise BackendUnavailableError(f"'{name}' adapts layers of more than one stack ({', '.join(sorted(parents))})",
                                      llama_hint(name))
    return out


def combine(adapters: Sequence[tuple[str, float]], layers_prefix: str = "model.layers.") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The tensors and the adapter_config.json of the mlx-lm adapter equal to these adapters together."""
    if not adapters:
        raise UsageError("no LoRA adapters to convert", "give at least one PEFT adapter folder")
    stack = layers_prefix.rstrip(".").rsplit(".", 1)[-1]
    parts: dict[tuple[int, str], list[tuple[np.ndarray, np.ndarray]]] = {}
    for folder, scale in adapters:
        for key, pair in read_peft(Path(folder).expanduser(), scale, stack).items():
            parts.setdefault(key, []).append(pair)
    rank = 0
    stacked = {}
    for (idx, rest), pairs in sorted(parts.items()):
        if len({(a.shape[1], b.shape[0]) for a, b in pairs}) > 1:
            raise BadModelFileError(f"the adapters disagree on the shape of layer {idx}'s '{rest}'",
                                    "adapters applied together must be made for the same base model")
        a = np.concatenate([a for a, _ in pairs], axis=0)
        b = np.concatenate([b for _, b in pairs], axis=1)
        stacked[idx, rest] = (a, b)
        rank = max(rank, a.shape[0])
    weights = {}
    for (idx, rest), (a, b) in stacked.items():
        pad = rank - a.shape[0]
        name = f"{layers_prefix}{idx}.{rest}"
        weights[f"{name}.lora_a"] = np.ascontiguousarray(np.pad(a, ((0, pad), (0, 0))).T)
        weights[f"{name}.lora_b"] = np.ascontiguousarray(np.pad(b, ((0, 0), (0, pad))).T)
    config = {
        "fine_tune_type": "lora",
        # -1: every layer; where an adapter leaves a layer alone, mlx-lm's zero lora_b adds nothing.
        "num_layers": -1,
        "lora_parameters": {"rank": rank, "scale": 1.0, "dropout": 0.0, "keys": sorted({rest for _, rest in stacked})},
        "localrun": {"format": FORMAT, "adapters": [[str(p), float(s)] for p, s in adapters]},
    }
    return weights, config


def _publish(weights: dict[str, np.ndarray], config: dict[str, Any], out_dir: Path) -> bool:
    """Write the folder under a temporary name and rename it into place; False if out_dir exists."""
    from safetensors.numpy import save_file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        save_file(weights, str(tmp / "adapters.safetensors"), metadata={"format": "mlx"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if out_dir.exists():
                return False
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def to_mlx_adapter(adapters: Sequence[tuple[str, float]], out_dir: Path, layers_prefix: str = "model.layers.") -> Path:
    """Write the mlx-lm adapter folder that applies these PEFT LoRA folders at these scales."""
    out_dir = Path(out_dir)
    if out_dir.exists() or not _publish(*combine(adapters, layers_prefix), out_dir):
        raise UsageError(f"the output folder '{out_dir}' already exists", "choose another folder, or remove it first")
    return out_dir


def cache_key(adapters: Sequence[tuple[str, float]], layers_prefix: str = "model.layers.") -> str:
    """A hash of the adapters' paths, file times and scales: a changed file is converted again."""
    items: list[Any] = [FORMAT, layers_prefix]
    for folder, scale in adapters:
        path = Path(folder).expanduser().resolve()
        stamps = []
        for f in (CONFIG, WEIGHTS):
            try:
                st = (path / f).stat()
                stamps.append([f, st.st_mtime_ns, st.st_size])
            except OSError:
                stamps.append([f, None, None])  # reading it reports what is missing
        items.append([str(path), float(scale), stamps])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    """Where converted adapter folders are kept, one per set of adapters and scales."""
    from localrun.store import home

    return home() / "cache" / "mlx-adapters"


def mlx_adapter(adapters: Sequence[tuple[str, float]], layers_prefix: str = "model.layers.") -> Path:
    """The cached mlx-lm adapter folder of these adapters, converted on first use."""
    out = cache_dir() / cache_key(adapters, layers_prefix)
    if (out / "adapter_config.json").is_file():
        return out
    weights, config = combine(adapters, layers_prefix)
    if out.exists():
        shutil.rmtree(out, ignore_errors=True)  # not written here: folders appear complete or not at all
    _publish(weights, config, out)  # False: another process made the same folder meanwhile
    return out
