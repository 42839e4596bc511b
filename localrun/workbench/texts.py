"""The texts the workbench measures with, built from Python's own standard library so that they
need no download: the calibration set of importance matrices and the ladder's held-out
evaluation text (kept apart from it)."""

from __future__ import annotations

import hashlib

from localrun.errors import UsageError

DEFAULT_SET_CHARS = 120_000  # 36k tokens (70 chunks of 512) with SmolLM2's tokenizer
_CODE_MODULES = (
    "textwrap", "heapq", "bisect", "fractions", "statistics", "json.decoder", "json.encoder",
    "shlex", "difflib", "csv", "colorsys", "calendar", "string", "functools", "dataclasses",
    "argparse", "base64", "ipaddress", "tokenize", "graphlib",
)
# Unicode blocks for the list part: Latin-1, Greek, Cyrillic, Hebrew, Arabic, Devanagari,
# Hiragana, CJK, mathematical operators, emoji.
_UNICODE_RANGES = (
    (0x00C0, 0x0100), (0x0391, 0x03CA), (0x0410, 0x0450), (0x05D0, 0x05EB), (0x0621, 0x064B),
    (0x0905, 0x0940), (0x3041, 0x3097), (0x4E00, 0x4E60), (0x2200, 0x2250), (0x1F600, 0x1F650),
)
_BLOCK_CHARS = 2500


def default_calibration(max_chars: int = DEFAULT_SET_CHARS) -> tuple[str, str]:
    """localrun's calibration text and its name: real text from Python's own standard library.

    Blocks of about 2,500 characters in turn: two of prose (the Python reference topics that
    `help()` shows, pydoc_data.topics), one of code (the source of common stdlib modules), one of
    lists (Unicode code points with their names, from unicodedata, over ten scripts). The same
    Python version gives the same text; the name records the version and a digest.
    """
    import platform
    import random
    import unicodedata

    rng = random.Random(0)  # the same order on every run (and every Python since 3.2)
    prose, code, lists = _prose_blocks(), _code_blocks(), _list_blocks()
    for blocks in (prose, code, lists):
        rng.shuffle(blocks)
    sources = [prose, prose, code, lists]
    out: list[str] = []
    size = 0
    while size < max_chars and any(sources):
        for src in sources:
            if src and size < max_chars:
                block = src.pop(0)
                out.append(block)
                size += len(block) + 2
    text = "\n\n".join(out)
    if len(text) < 10_000:
        raise UsageError("this Python lacks the standard library text of the default calibration set",
                         "pass --calibration FILE")
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    name = (f"localrun-calibration-v1 (Python {platform.python_version()} reference topics, stdlib "
            f"source, Unicode {unicodedata.unidata_version} names; {len(text)} characters, sha256 {digest})")
    return text, name


def _split(text: str, sep: str) -> list[str]:
    """Cut text into blocks of about _BLOCK_CHARS at separators."""
    blocks, cur = [], ""
    for part in text.split(sep):
        if cur and len(cur) + len(part) > _BLOCK_CHARS:
            blocks.append(cur.strip("\n"))
            cur = ""
        cur = f"{cur}{sep}{part}" if cur else part
    if cur.strip():
        blocks.append(cur.strip("\n"))
    return [b for b in blocks if b.strip()]


def _prose_blocks() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [b for key in sorted(topics) for b in _split(topics[key], "\n\n")]


def _code_blocks() -> list[str]:
    import importlib
    import inspect

    blocks: list[str] = []
    for name in _CODE_MODULES:
        try:
            source = inspect.getsource(importlib.import_module(name))
        except (ImportError, OSError, TypeError):
            continue  # a Python without sources
        blocks += _split(source, "\n")
    return blocks


def _list_blocks() -> list[str]:
    import unicodedata

    blocks = []
    for n, (lo, hi) in enumerate(_UNICODE_RANGES):
        rows = [(c, unicodedata.name(chr(c), "")) for c in range(lo, hi)]
        rows = [(c, name) for c, name in rows if name]
        if n % 2:  # a Markdown table, then a bullet list: both shapes occur in real text
            lines = ["| code point | character | name |", "|---|---|---|"]
            lines += [f"| U+{c:04X} | {chr(c)} | {name.title()} |" for c, name in rows]
        else:
            lines = [f"- U+{c:04X} {chr(c)}: {name.lower()}" for c, name in rows]
        blocks += _split("\n".join(lines), "\n")
    return blocks


def default_text(max_chars: int = 60_000) -> tuple[str, str]:
    """A held-out evaluation text localrun builds itself, apart from the calibration set: the
    docstrings of a fixed list of Python standard-library modules (the same for the same Python).
    Returns (text, description)."""
    import importlib
    import sys

    names = tuple(n for n in (
        "abc", "asyncio", "collections", "contextlib", "datetime", "decimal", "email", "enum", "http", "inspect",
        "itertools", "logging", "mailbox", "operator", "pathlib", "pickle", "queue", "random", "re", "sched",
        "shutil", "socket", "subprocess", "tarfile", "tempfile", "threading", "timeit", "typing", "unittest",
        "urllib", "uuid", "warnings", "wave", "weakref", "zipfile") if n not in _CODE_MODULES)  # the calibration set's code: kept out
    parts: list[str] = []
    for n in names:
        try:
            mod = importlib.import_module(n)
        except Exception:  # noqa: BLE001 - a module this Python lacks is left out
            continue
        docs = [mod.__doc__ or ""] + [getattr(mod, a).__doc__ or "" for a in sorted(dir(mod))
                                        if not a.startswith("_") and callable(getattr(mod, a, None))]
        parts.extend(d.strip() for d in docs if isinstance(d, str) and len(d.strip()) > 200)
    text = "\n\n".join(dict.fromkeys(parts))[:max_chars]
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return text, (f"localrun-eval-v1 (docstrings of {len(names)} standard-library modules, Python "
                  f"{sys.version.split()[0]}; {len(text)} characters, sha256 {digest})")
