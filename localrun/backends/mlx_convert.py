"""Conversion to MLX format through mlx-lm's converter, registered in the store.

Sources: a Hugging Face safetensors folder, an MLX folder (to quantize it), or a GGUF file
(exported to Hugging Face layout with transformers first). mlx-lm prints its progress on
stdout; it is sent to stderr here so stdout keeps carrying results only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from localrun.errors import ConversionError, UsageError
from localrun.store import ModelInfo, Store, normalize_name, safetensors_header

Q_BITS = (2, 3, 4, 5, 6, 8)
Q_GROUP_SIZES = (32, 64, 128)
ProgressCallback = Callable[[str], None]


def mlx_tag(q_bits: int | None, q_group_size: int = 64) -> str:
    """The name tag of an MLX copy: 'mlx', 'mlx-q4' or 'mlx-q4-g32'."""
    if q_bits is None:
        return "mlx"
    return f"mlx-q{q_bits}" + (f"-g{q_group_size}" if q_group_size != 64 else "")


def convert_to_mlx(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    q_bits: int | None = None,
    q_group_size: int = 64,
    name: str | None = None,
    progress: ProgressCallback | None = None,
) -> ModelInfo:
    """Convert a model to an MLX folder with mlx-lm and register it in the store.

    Args:
        src: an installed model's name, a Hugging Face safetensors or MLX folder, or a .gguf file.
        out: the folder to create; default: a folder in the store's models directory.
        q_bits: quantize the weights to this many bits; None keeps their precision.
        q_group_size: weights per quantization scale (32, 64 or 128); smaller is more accurate.
        name: the store name of the result; default `family:mlx[-qN]`.
        progress: called with a short line at each stage ("loading ...", "quantizing ...").

    Returns:
        The registered model (format "mlx").

    Raises:
        UsageError: bad bits or group size, the output exists, or the name is taken.
        ConversionError: mlx-lm is missing or cannot convert this model.
        ModelNotFoundError, BadModelFileError: the source cannot be found or read.
    """
    if q_bits is not None and q_bits not in Q_BITS:
        raise UsageError(f"invalid value for --q-bits: {q_bits}", f"choose one of {', '.join(map(str, Q_BITS))}")
    if q_group_size not in Q_GROUP_SIZES:
        raise UsageError(f"invalid value for --q-group-size: {q_group_size}",
                         f"choose one of {', '.join(map(str, Q_GROUP_SIZES))}")
    _require_mlx_lm()
    store = Store()
    source = store.get(str(src))
    cfg = source.details.get("config") or {}
    if source.format == "mlx" and (cfg.get("quantization") or q_bits is None):
        raise UsageError(f"'{source.name}' is already in MLX format", "run it as it is, or convert the original checkpoint")
    family = source.name.split(":", 1)[0]
    src_tag = source.name.split(":", 1)[1] if ":" in source.name else "latest"
    tag = mlx_tag(q_bits, q_group_size)
    new_name = normalize_name(name) if name else f"{family}:{tag if src_tag in ('latest', 'mlx') else f'{src_tag}-{tag}'}"
    if new_name in store.names():
        raise UsageError(f"a model named '{new_name}' is already installed",
                         "choose another name with --name, or remove it first with 'localrun rm'")
    in_store = out is None
    dest = Path(out).expanduser().resolve() if out is not None else store.models_dir / re.sub(r"[^a-z0-9._-]+", "-", new_name)
    if dest.exists():
        raise UsageError(f"the output folder '{dest}' already exists", "choose another -o, or remove it first")
    dest.parent.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda _line: None)
    # Build under a temporary name beside the destination; rename only when complete.
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        hf_folder = Path(source.path)
        if source.format == "gguf":
            say(f"exporting {source.name} from GGUF to Hugging Face layout (transformers)")
            hf_folder = export_gguf(Path(source.path), work / "hf")
        say(f"loading {source.name}" + (f"; quantizing to {q_bits} bits, group size {q_group_size}" if q_bits else ""))
        _run_mlx_lm_convert(_mlx_lm_view(hf_folder, work / "src"), work / "mlx", q_bits, q_group_size, cfg)
        say(f"writing {dest}")
        os.replace(work / "mlx", dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    try:
        return store.add(dest, name=new_name, source="store" if in_store else "added")
    except BaseException:
        if in_store:
            shutil.rmtree(dest, ignore_errors=True)
        raise


def _mlx_lm_view(src: Path, work: Path) -> Path:
    """The checkpoint as mlx-lm reads it: transformers 5 writes some config keys where mlx-lm's
    models do not look (rope_theta and the rope scaling inside rope_parameters, which the models
    would replace by their defaults; Qwen3-MoE's num_local_experts for num_experts, without which mlx-lm cannot load it),
    and gpt-oss experts in a layout mlx-lm does not read. Where needed, a folder of links to the
    checkpoint's files with those keys added and those tensors rewritten."""
    import json

    try:
        cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return src  # mlx-lm says what is wrong with it
    from localrun.backends.mlx_model import mlx_rope_keys

    extra: dict[str, Any] = mlx_rope_keys(cfg)
    for a, b in (("num_experts", "num_local_experts"), ("num_local_experts", "num_experts")):
        if cfg.get(a) is None and isinstance(cfg.get(b), int):
            extra[a] = cfg[b]
    fused = _fused_expert_files(src, cfg)
    if not extra and not fused:
        return src
    work.mkdir(parents=True)
    for entry in src.iterdir():
        if entry.name != "config.json" and entry.name not in fused and entry.name != "model.safetensors.index.json":
            os.symlink(entry.resolve(), work / entry.name)
    (work / "config.json").write_text(json.dumps({**cfg, **extra}, indent=2) + "\n", encoding="utf-8")
    renamed = {name: _unfuse(src / name, work / name) for name in sorted(fused)}
    index = src / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
        new_names = {old: new for names in renamed.values() for old, new in names.items()}
        data["weight_map"] = {new_names.get(k, k): v for k, v in data.get("weight_map", {}).items()}
        (work / index.name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return work


# gpt-oss experts as transformers saves them unquantized: one tensor per layer, [experts, in, out]
# with no ".weight"; mlx-lm reads them as [experts, out, in] named "...gate_up_proj.weight".
_FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def _fused_expert_files(src: Path, cfg: dict[str, Any]) -> set[str]:
    """The safetensors files of a gpt-oss checkpoint that hold experts in transformers' layout."""
    if cfg.get("model_type") != "gpt_oss":
        return set()
    return {f.name for f in src.glob("*.safetensors") if any(k.endswith(_FUSED_EXPERTS) for k in safetensors_header(f))}


def _unfuse(src: Path, dst: Path) -> dict[str, str]:
    """Write src with its fused expert tensors transposed and renamed; returns old -> new names."""
    import mlx.core as mx

    arrays = mx.load(str(src))
    assert isinstance(arrays, dict)
    renamed = {}
    for k in [k for k in arrays if k.endswith(_FUSED_EXPERTS)]:
        arrays[f"{k}.weight"] = mx.contiguous(mx.swapaxes(arrays.pop(k), -1, -2))
        renamed[k] = f"{k}.weight"
    mx.save_safetensors(str(dst), arrays, metadata={"format": "mlx"})
    return renamed


def _require_mlx_lm() -> None:
    from localrun.backends.mlx import INSTALL_HINT, mlx_installed

    if not mlx_installed():
        raise ConversionError("converting to MLX needs mlx and mlx-lm, which are not installed", INSTALL_HINT)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _run_mlx_lm_convert(src: Path, dst: Path, q_bits: int | None, q_group_size: int, cfg: dict[str, Any]) -> None:
    from mlx_lm.convert import convert

    dtype = None
    if q_bits is not None:
        # Scales and unquantized layers keep the checkpoint's dtype; F32 would waste half the gain.
        src_dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        dtype = "bfloat16" if src_dtype == "bfloat16" else "float16"
    try:
        with _stdout_to_stderr():
            convert(str(src), str(dst), quantize=q_bits is not None, q_bits=q_bits,
                    q_group_size=q_group_size if q_bits is not None else None, dtype=dtype)
    except (ValueError, FileNotFoundError, KeyError, OSError, TypeError) as e:
        raise ConversionError(f"mlx-lm cannot convert '{src}': {e}",
                              "the checkpoint may be incomplete or of an architecture this mlx-lm does not know") from e



def export_gguf(gguf: Path, dst: Path) -> Path:
    """Write a GGUF model as a Hugging Face checkpoint (dequantized) with transformers."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ConversionError("converting a GGUF file to MLX needs transformers and torch",
                              "pip install transformers torch, or convert the original safetensors checkpoint") from e
    try:
        with _stdout_to_stderr():
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            # The weights are dequantized on load; what is left is a plain checkpoint.
            model.hf_quantizer = None  # type: ignore[assignment]
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(str(dst))
            tokenizer.save_pretrained(str(dst))
    except (ValueError, OSError, KeyError, IndexError, RuntimeError, AssertionError) as e:
        raise ConversionError(f"transformers cannot export '{gguf}' to Hugging Face layout: {e}",
                              "convert the original safetensors checkpoint instead") from e
    return dst
