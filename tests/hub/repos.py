"""Repositories for the local Hub, built from the real stories260K GGUF."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..ggufs import rewrite_gguf
from .server import HubServer

QUANTS = {"Q2_K": 10, "Q4_0": 2, "Q4_K_M": 15, "Q5_K_M": 17, "Q8_0": 7, "F16": 1}
QUANT_REPO = "test/Stories-260K-GGUF"
SPLIT_REPO = "test/Stories-Split-GGUF"
NOQ4_REPO = "test/Stories-HighBit-GGUF"
ST_REPO = "test/Stories-260K"
MLX_REPO = "mlx-test/Stories-260K-4bit"
GATED_REPO = "gated-org/Stories-Gated-GGUF"
HUGE_REPO = "test/Huge-GGUF"


def write_gguf(src: Path, dst: Path, extra: dict[str, Any], split_max_tensors: int = 0) -> list[Path]:
    """Copy a GGUF with metadata overrides (uint32 values), optionally split into parts."""
    import gguf

    rewrite_gguf(src, dst, add={k: (v, gguf.GGUFValueType.UINT32) for k, v in extra.items()},
                 split_max_tensors=split_max_tensors)
    if split_max_tensors:
        return sorted(dst.parent.glob(dst.stem + "-*-of-*.gguf"))
    return [dst]


def build_files(src: Path, root: Path) -> dict[str, dict[str, Path]]:
    """Files of every test repository, written once under root."""
    root.mkdir(parents=True, exist_ok=True)
    readme = root / "README.md"
    readme.write_text("# test model\n")
    quant_files: dict[str, Path] = {"README.md": readme}
    for quant, ftype in QUANTS.items():
        dst = root / f"stories-260k-{quant}.gguf"
        write_gguf(src, dst, {"general.file_type": ftype})
        quant_files[dst.name] = dst
    split_dir = root / "split"
    split_dir.mkdir()
    parts = write_gguf(src, split_dir / "stories-Q8_0.gguf", {"general.file_type": 7}, split_max_tensors=30)
    split_files: dict[str, Path] = {f"Q8_0/{p.name}": p for p in parts}
    split_files["stories-Q4_0.gguf"] = quant_files["stories-260k-Q4_0.gguf"]
    highbit = {"stories-260k-Q8_0.gguf": quant_files["stories-260k-Q8_0.gguf"],
               "stories-260k-Q2_K.gguf": quant_files["stories-260k-Q2_K.gguf"],
               "stories-260k-Q5_K_M.gguf": quant_files["stories-260k-Q5_K_M.gguf"]}
    st = root / "st"
    st.mkdir()
    from safetensors.numpy import save_file

    save_file({"model.embed_tokens.weight": np.ones((512, 64), dtype=np.float16)}, str(st / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 5,
              "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 64,
              "max_position_embeddings": 2048, "torch_dtype": "float16"}
    (st / "config.json").write_text(json.dumps(config))
    (st / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (st / "tokenizer_config.json").write_text("{}")
    (st / "generation_config.json").write_text('{"do_sample": false}')
    (st / "pytorch_model.bin").write_bytes(b"\x80" + b"\0" * 4000)
    (st / "onnx.onnx").write_bytes(b"\0" * 3000)
    st_files = {p.name: p for p in st.iterdir()}
    st_files["README.md"] = readme
    mlx = root / "mlx"
    mlx.mkdir()
    (mlx / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 64, "bits": 4}}))
    mlx_files = {"config.json": mlx / "config.json", "model.safetensors": st / "model.safetensors",
                 "tokenizer.json": st / "tokenizer.json"}
    return {"quant": quant_files, "split": split_files, "highbit": highbit, "st": st_files, "mlx": mlx_files}


def populate(hub: HubServer, files: dict[str, dict[str, Path]]) -> None:
    """Serve every test repository."""
    hub.add_repo(QUANT_REPO, files["quant"], tags=["gguf", "llama"], downloads=5000, likes=40,
                 last_modified="2025-03-01T10:00:00.000Z")
    hub.add_repo(SPLIT_REPO, files["split"], tags=["gguf"], downloads=100, likes=2)
    hub.add_repo(NOQ4_REPO, files["highbit"], tags=["gguf"], downloads=10, likes=1)
    hub.add_repo(ST_REPO, files["st"], tags=["safetensors", "transformers"], downloads=900, likes=70,
                 library_name="transformers", last_modified="2025-05-01T10:00:00.000Z")
    hub.add_repo(MLX_REPO, files["mlx"], tags=["mlx", "safetensors"], library_name="mlx", downloads=50)
    # A file that claims to be enormous: only its header is ever read.
    hub.add_repo(HUGE_REPO, {"huge-Q4_K_M.gguf": files["quant"]["stories-260k-Q4_K_M.gguf"]},
                 claimed_sizes={"huge-Q4_K_M.gguf": 1 << 60}, tags=["gguf"])
    hub.add_repo(GATED_REPO, {"stories-Q4_K_M.gguf": files["quant"]["stories-260k-Q4_K_M.gguf"]},
                 tags=["gguf"], gated="manual", downloads=7)
