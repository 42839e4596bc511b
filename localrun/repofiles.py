"""Which files of a Hub repository make a model: GGUF quantizations, split parts, and the
weights, config and tokenizer files of safetensors / MLX checkpoints."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from localrun.errors import HubError, UsageError

_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_QUANT = re.compile(
    r"(?<![a-z0-9])((?:ud-)?(?:i?q[1-8](?:_[0-9a-z]+)*|bf16|f16|f32|fp16|fp32|mxfp4(?:_moe)?|tq[12]_0))(?![a-z0-9])",
    re.IGNORECASE,
)
# Default pick: Q4_K_M, else the closest at or above 4 bits, else the largest below.
_PREFERENCE = [
    "Q4_K_M", "Q4_K_S", "Q4_K_L", "Q4_K_XL", "IQ4_XS", "IQ4_NL", "Q4_0", "Q4_1", "MXFP4", "MXFP4_MOE",
    "Q5_K_M", "Q5_K_S", "Q5_K_L", "Q5_K_XL", "Q5_0", "Q5_1", "Q6_K", "Q6_K_L", "Q6_K_XL", "Q8_0", "Q8_K_XL",
    "BF16", "F16", "FP16", "F32", "FP32",
    "Q3_K_L", "Q3_K_XL", "Q3_K_M", "IQ3_M", "IQ3_S", "Q3_K_S", "IQ3_XS", "IQ3_XXS", "Q2_K_L", "Q2_K_XL",
    "Q2_K", "IQ2_M", "IQ2_S", "IQ2_XS", "Q2_K_S", "IQ2_XXS", "TQ2_0", "IQ1_M", "IQ1_S", "TQ1_0",
]
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pth", ".pt", ".onnx", ".npz")
# What running a safetensors / MLX checkpoint needs, besides its *.safetensors weights.
RUNTIME_FILES = {
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "model.safetensors.index.json",
}


@dataclass(frozen=True)
class RepoFile:
    """One file of a repository, with its quantization when it is a GGUF."""

    path: str
    size: int
    sha256: str | None = None  # LFS files
    blob_id: str | None = None  # git object id
    quant: str | None = None
    split: tuple[int, int] | None = None  # (part, of) for split GGUFs

    @property
    def is_weights(self) -> bool:
        return self.path.lower().endswith(WEIGHT_SUFFIXES)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"path": self.path, "size": self.size, "sha256": self.sha256, "quant": self.quant,
                "split": list(self.split) if self.split else None}


def detect_quant(path: str) -> str | None:
    """The quantization tag in a GGUF file name, e.g. `Q4_K_M`, `IQ4_XS`, `BF16` (None if absent)."""
    name = _SPLIT.sub(".gguf", path.rsplit("/", 1)[-1])
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    found = _QUANT.findall(name) or _QUANT.findall(path)
    return found[-1].upper() if found else None


def _rank(quant: str | None) -> tuple[int, float, str]:
    base = (quant or "").upper().removeprefix("UD-")
    if base in _PREFERENCE:
        return (0, _PREFERENCE.index(base) + (0.5 if quant and quant.upper().startswith("UD-") else 0), base)
    bits = re.search(r"(\d+)", base)
    n = int(bits.group(1)) if bits else 0
    return (1, n if n >= 4 else 100 - n, base)


def split_of(path: str) -> tuple[int, int] | None:
    m = _SPLIT.search(path)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _family(repo: str) -> str:
    family = re.sub(r"[^a-z0-9._\-]+", "-", repo.split("/")[-1].lower()).strip("-._") or "model"
    return re.sub(r"[-_.]gguf$", "", family)


def gguf_choices(files: list[RepoFile]) -> dict[str, list[RepoFile]]:
    """GGUF models in a repository: a single file, or all parts of a split, keyed by first file."""
    groups: dict[str, list[RepoFile]] = {}
    for f in files:
        if not f.path.lower().endswith(".gguf"):
            continue
        key = _SPLIT.sub(".gguf", f.path) if f.split else f.path
        groups.setdefault(key, []).append(f)
    out = {}
    for parts in groups.values():
        parts.sort(key=lambda f: f.split or (1, 1))
        total = parts[0].split[1] if parts[0].split else 1
        if [p.split[0] if p.split else 1 for p in parts] == list(range(1, total + 1)):
            out[parts[0].path] = parts
    return out


def is_projector(path: str) -> bool:
    """Whether a file is a vision model's projector (an `mmproj` GGUF), not a model."""
    return "mmproj" in path.lower().rsplit("/", 1)[-1]


# The projector a pull fetches when a repository publishes several: full precision, as llama.cpp's
# own vision repositories recommend, smallest first.
_PROJECTOR_PREFERENCE = ("F16", "FP16", "BF16", "F32", "FP32")


def projector_choices(files: list[RepoFile], model: list[RepoFile]) -> list[RepoFile]:
    """The projector files that go with a GGUF model, by name: those in the model's folder, else
    all of the repository's (a split model often sits in a subfolder below its projector)."""
    found = sorted((f for f in files if f.path.lower().endswith(".gguf") and is_projector(f.path) and not f.split),
                   key=lambda f: f.path)
    if not model or is_projector(model[0].path):
        return []
    folder = model[0].path.rpartition("/")[0]
    beside = [f for f in found if f.path.rpartition("/")[0] == folder]
    return beside or found


def choose_projector(choices: list[RepoFile]) -> RepoFile | None:
    """F16 when there are several, else BF16, else F32, else the first by name."""
    for wanted in _PROJECTOR_PREFERENCE:
        for f in choices:
            if (f.quant or "").upper() == wanted:
                return f
    return choices[0] if choices else None


def select(repo: str, files: list[RepoFile], selector: str | None, facts: dict[str, Any]) -> tuple[str, list[RepoFile], str | None]:
    """(format, files to fetch, quantization) for `repo[:selector]`."""
    choices = gguf_choices(files)
    if choices:
        return ("gguf", *_select_gguf(repo, choices, selector))
    weights = [f for f in files if "/" not in f.path and f.path.endswith(".safetensors")]
    if not weights:
        kinds = sorted({f.path.rsplit(".", 1)[-1] for f in files if f.is_weights})
        raise HubError(
            f"'{repo}' has no GGUF or safetensors weights" + (f" (only {', '.join(kinds)})" if kinds else ""),
            "choose a GGUF repository, e.g. with 'localrun search QUERY --format gguf'",
        )
    if selector:
        raise UsageError(f"'{repo}' is not a GGUF repository; ':{selector}' selects GGUF files only",
                         f"run 'localrun pull {repo}'")
    # Prefer the transformers shards over consolidated.* copies (Mistral repositories ship both).
    named = [f for f in weights if f.path.startswith("model")]
    weights = named or weights
    fmt = "mlx" if "mlx" in facts.get("tags", []) or facts.get("library_name") == "mlx" else "safetensors"
    extra = [f for f in files if f.path in RUNTIME_FILES]
    if not any(f.path == "config.json" for f in extra):
        raise HubError(f"'{repo}' has safetensors weights but no config.json", "choose a complete model repository")
    return fmt, sorted(extra + weights, key=lambda f: f.path), None


def _select_gguf(repo: str, choices: dict[str, list[RepoFile]], selector: str | None) -> tuple[list[RepoFile], str | None]:
    if selector and (selector.lower().endswith(".gguf") or "/" in selector):
        for parts in choices.values():
            if any(selector in (p.path, p.path.rsplit("/", 1)[-1]) for p in parts):
                return parts, parts[0].quant
        raise HubError(f"'{repo}' has no file '{selector}'", f"run 'localrun search --files {repo}'")
    candidates = {k: v for k, v in choices.items() if not is_projector(k)} or choices
    quants = sorted({v[0].quant or "?" for v in candidates.values()}, key=_rank)
    if selector:
        wanted = selector.upper()
        matches = [v for v in candidates.values() if (v[0].quant or "").upper() == wanted]
        if not matches:
            raise HubError(
                f"'{repo}' has no {selector} file",
                f"available: {', '.join(quants)}; e.g. 'localrun pull {repo}:{quants[0]}'",
            )
    else:
        best = min(candidates.values(), key=lambda v: _rank(v[0].quant))
        matches = [v for v in candidates.values() if v[0].quant == best[0].quant]
    if len(matches) > 1:
        raise HubError(
            f"'{repo}' has {len(matches)} {matches[0][0].quant or 'unlabelled'} models: "
            + ", ".join(m[0].path for m in matches),
            f"pick one with 'localrun pull {repo}:FILE'",
        )
    return matches[0], matches[0][0].quant


def default_name(repo: str, fmt: str, quant: str | None) -> str:
    """The store name of a pulled model: `family:quant` (GGUF) or `family:latest`."""
    tag = re.sub(r"[^a-z0-9._\-]+", "-", quant.lower()) if fmt == "gguf" and quant else "latest"
    return f"{_family(repo)}:{tag}"
