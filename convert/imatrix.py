"""Importance-matrix files (llama-imatrix's GGUF format and the legacy .dat format)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from convert.errors import ConvertError


def load_imatrix(path: Path) -> dict[str, np.ndarray]:
    """Per-tensor importance values, normalised as llama-quantize does."""
    with open(path, "rb") as f:
        magic = f.read(4)
    try:
        return _load_gguf(path) if magic == b"GGUF" else _load_legacy(path)
    except (struct.error, ValueError, KeyError) as e:
        raise ConvertError(
            f"{path} is not an importance matrix: {e}", "make one with llama-imatrix"
        ) from e


def _load_gguf(path: Path) -> dict[str, np.ndarray]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        data = np.asarray(t.data, dtype=np.float32).reshape(-1)
        if t.name.endswith(".in_sum2"):
            sums[t.name[: -len(".in_sum2")]] = data
        elif t.name.endswith(".counts"):
            counts[t.name[: -len(".counts")]] = data
    out: dict[str, np.ndarray] = {}
    for name, s in sums.items():
        if name not in counts:
            raise ValueError(f"no counts for {name}")
        c = np.rint(counts[name])
        per = s.reshape(len(c), -1)
        values = np.where(c[:, None] > 0, per / np.maximum(c[:, None], 1), 1.0)
        out[name] = values.reshape(-1).astype(np.float32)
    if not out:
        raise ValueError("no tensors")
    return out


def _load_legacy(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    (n,) = struct.unpack_from("<i", data, 0)
    if n < 1:
        raise ValueError("no entries")
    pos = 4
    out: dict[str, np.ndarray] = {}
    for _ in range(n):
        (length,) = struct.unpack_from("<i", data, pos)
        name = data[pos + 4 : pos + 4 + length].decode()
        pos += 4 + length
        ncall, nval = struct.unpack_from("<ii", data, pos)
        pos += 8
        values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).astype(np.float32)
        pos += 4 * nval
        out[name] = values / ncall if ncall > 0 else values
    return out
