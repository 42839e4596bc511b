"""Checkpoint readers: tensors are indexed up front and read lazily, a block of rows at a time."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from gguf.utility import SafetensorsLocal

from convert.errors import ConvertError

# Source dtypes the converter accepts, with their numpy storage (BF16 is kept as raw uint16).
DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),  # packed quantized data (MXFP4 blocks and scales)
}


class TensorReader(Protocol):
    """Where the bytes of one source tensor come from."""

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the first dimension, in the storage dtype."""
        ...


@dataclass
class SourceTensor:
    """One tensor of a checkpoint, not yet read."""

    name: str
    dtype: str  # "F32", "F16" or "BF16"
    shape: tuple[int, ...]
    reader: TensorReader

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.dtype].itemsize

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) in the storage dtype (BF16 as uint16), shaped like the tensor."""
        stop = self.rows if stop is None else stop
        return self.reader.read_rows(start, stop)

    @property
    def matrix_rows(self) -> int:
        """Rows of the tensor seen as a matrix: every dimension but the last flattened."""
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if self.shape else 1

    def read_matrix(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the matrix view (2D), read without the rest of the tensor."""
        direct = getattr(self.reader, "read_matrix_rows", None)
        if direct is not None:
            return direct(start, stop)
        if len(self.shape) < 2:
            return self.read().reshape(1, -1)[start:stop]
        # Any other reader: the first-dimension rows that hold the range (e.g. one expert).
        per = int(np.prod(self.shape[1:-1], dtype=np.int64))
        first, last = start // per, -(-stop // per)
        block = self.read(first, last).reshape(-1, self.shape[-1])
        return block[start - first * per : stop - first * per]


class _FileRange:
    """A tensor stored contiguously in a file: rows are read with pread, never all mapped."""

    def __init__(self, path: Path, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any]):
        self.path, self.offset, self.shape, self.dtype = path, offset, shape, dtype
        self.row_elems = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        count = (stop - start) * self.row_elems
        out = np.empty(count, dtype=self.dtype)
        buf = out.data.cast("B")
        pos = self.offset + start * self.row_elems * self.dtype.itemsize
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < len(buf):
                n = os.preadv(fd, [buf[done:]], pos + done)
                if n <= 0:
                    raise ConvertError(
                        f"{self.path} is truncated", "download or save the checkpoint again"
                    )
                done += n
        finally:
            os.close(fd)
        shape = (stop - start, *self.shape[1:]) if self.shape else ()
        return out.reshape(shape)

    def read_matrix_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows of the tensor seen as a matrix (every dimension but the last flattened)."""
        cols = self.shape[-1] if self.shape else 1
        n = int(np.prod(self.shape, dtype=np.int64))
        return _FileRange(self.path, self.offset, (n // cols, cols), self.dtype).read_rows(
            start, stop
        )


class _TorchTensor:
    """A tensor held by torch (a pickled .bin loaded with mmap, or an in-memory module)."""

    def __init__(self, tensor: Any):
        self.tensor = tensor

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        t = self.tensor.detach()
        return self._numpy(t[start:stop] if t.dim() > 0 else t)

    def read_matrix_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows of the tensor seen as a matrix (every dimension but the last flattened)."""
        t = self.tensor.detach()
        return self._numpy(t.reshape(-1, t.shape[-1] if t.dim() else 1)[start:stop])

    @staticmethod
    def _numpy(t: Any) -> np.ndarray:
        import torch

        t = t.to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()


def torch_dtype_name(dtype: Any) -> str:
    """ "F32"/"F16"/"BF16" for a torch dtype, or a ConvertError for anything else."""
    import torch

    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    if dtype not in names:
        raise ConvertError(
            f"tensor dtype {dtype} is not supported",
            "the converter reads F32, F16 and BF16 checkpoints",
        )
    return names[dtype]


def tensors_from_state_dict(state: Mapping[str, Any]) -> dict[str, SourceTensor]:
    """Index an in-memory state dict (torch tensors) without copying it."""
    out: dict[str, SourceTensor] = {}
    for name, t in state.items():
        if not hasattr(t, "dtype") or not hasattr(t, "shape"):
            continue
        if not t.is_floating_point():
            continue  # integer buffers (position ids, masks) are not weights
        out[name] = SourceTensor(name, torch_dtype_name(t.dtype), tuple(t.shape), _TorchTensor(t))
    return out


def _sharded_files(folder: Path, index_name: str, pattern: str) -> list[Path]:
    """The shards an index file names (all of them must be there), else the files matching pattern."""
    index = folder / index_name
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise ConvertError(
                f"{folder} is missing shard(s) {', '.join(missing)} named in {index_name}",
                "download the complete checkpoint",
            )
        return [folder / f for f in files]
    return sorted(p for p in folder.glob(pattern) if not p.name.startswith("."))


def _safetensors_files(folder: Path) -> list[Path]:
    return _sharded_files(folder, "model.safetensors.index.json", "*.safetensors")


def load_safetensors(files: list[Path]) -> dict[str, SourceTensor]:
    """Index the tensors of safetensors files (read lazily, in file order)."""
    out: dict[str, SourceTensor] = {}
    for path in files:
        try:
            local = SafetensorsLocal(path)
        except (ValueError, OSError) as e:
            raise ConvertError(f"{path} is not a readable safetensors file: {e}") from e
        # Keep file order so that reading is sequential on disk.
        items = sorted(local.tensors.items(), key=lambda kv: kv[1].data_range.offset)
        for name, lt in items:
            dtype = lt.dtype
            if dtype not in DTYPES:
                raise ConvertError(
                    f"tensor {name!r} in {path.name} has dtype {dtype}",
                    "the converter reads F32, F16 and BF16 checkpoints",
                )
            shape = tuple(int(d) for d in lt.shape)
            expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
            rng = lt.data_range
            if rng.size != expected:
                raise ConvertError(
                    f"tensor {name!r} in {path.name} has {rng.size} bytes, expected {expected}"
                )
            if rng.offset + rng.size > path.stat().st_size:
                raise ConvertError(f"{path} is truncated", "download or save the checkpoint again")
            reader = _FileRange(path, rng.offset, shape, DTYPES[dtype])
            out[name] = SourceTensor(name, dtype, shape, reader)
    return out


def _bin_files(folder: Path) -> list[Path]:
    return _sharded_files(folder, "pytorch_model.bin.index.json", "pytorch_model*.bin")


def load_pickle(path: Path) -> dict[str, Any]:
    """torch.load with weights_only=True: a pickle that would run code is refused, never run."""
    try:
        import torch
    except ImportError as e:
        raise ConvertError(
            f"{path.name} is a pickled PyTorch checkpoint and torch is not installed",
            "install torch (pip install 'localrun[torch]') or convert from safetensors",
        ) from e
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # legacy format
    except pickle.UnpicklingError as e:
        raise ConvertError(
            f"refusing to load {path}: the pickle holds code or objects other than tensors "
            f"({str(e).splitlines()[0][:200]})",
            "convert only checkpoints you trust, saved as safetensors or plain state dicts",
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise ConvertError(f"{path} is not a readable PyTorch checkpoint: {e}") from e
    if (
        isinstance(state, Mapping)
        and "state_dict" in state
        and isinstance(state["state_dict"], Mapping)
    ):
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise ConvertError(f"{path} does not hold a state dict (found {type(state).__name__})")
    return dict(state)


def _repo_name(folder: Path) -> str:
    """`org/name` for a Hugging Face cache snapshot (models--org--name/snapshots/REV), else the name."""
    folder = Path(os.path.abspath(folder))
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--"):
        return repo[len("models--") :].replace("--", "/", 1)
    return folder.name


def check_native_layout(folder: str | os.PathLike[str]) -> None:
    """Refuse a model folder in its publisher's native layout (params.json + consolidated weights)
    with the Hugging Face layout to use instead: the converter reads config.json folders only."""
    folder = Path(folder)
    if (
        not folder.is_dir()
        or (folder / "config.json").is_file()
        or not (folder / "params.json").is_file()
    ):
        return
    names = sorted(p.name for p in folder.iterdir())
    weights = [
        n for n in names if n.startswith("consolidated") and n.endswith((".safetensors", ".pth"))
    ]
    mistral_tok = [n for n in names if n == "tekken.json" or n.startswith("tokenizer.model.v")]
    repo = _repo_name(folder)
    name = repo.rsplit("/", 1)[-1]
    found = ", ".join(["params.json", *weights[:1], *mistral_tok[:1]])
    if mistral_tok or any(n.endswith(".safetensors") for n in weights):
        raise ConvertError(
            f"{folder} is in Mistral's native layout ({found}), not the Hugging Face layout",
            f"convert the Hugging Face (transformers) layout of {repo} instead: config.json, "
            "model*.safetensors and tokenizer.json, from the same repository where it carries "
            f"them, else from a transformers-format copy such as a '-hf' repository or "
            f"mistral-community/{name}",
        )
    if weights:
        raise ConvertError(
            f"{folder} is in Meta's original Llama layout ({found}), not the Hugging Face layout",
            f"convert the Hugging Face (transformers) layout of {name} instead (for Llama 2: "
            f"meta-llama/{name}-hf), or make one with transformers' convert_llama_weights_to_hf.py",
        )


def load_checkpoint(folder: Path) -> dict[str, SourceTensor]:
    """Index every weight of a Hugging Face folder (safetensors first, else pytorch_model*.bin)."""
    files = _safetensors_files(folder)
    if files:
        return load_safetensors(files)
    bins = _bin_files(folder)
    if bins:
        out: dict[str, SourceTensor] = {}
        for path in bins:
            out.update(tensors_from_state_dict(load_pickle(path)))
        return out
    raise ConvertError(
        f"no weights found in {folder}",
        "expected model.safetensors, model-*-of-*.safetensors with its index, or pytorch_model*.bin",
    )


def read_json(path: Path) -> Any:
    """A JSON file's value; malformed JSON is a ConvertError naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path} is not valid JSON: {e}") from e


def iter_row_blocks(rows: int, row_bytes: int, block_bytes: int) -> Iterator[tuple[int, int]]:
    """Split rows into [start, stop) blocks of about block_bytes each."""
    step = max(1, block_bytes // max(row_bytes, 1))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)
