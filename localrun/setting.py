"""A setting: its declaration on a dataclass field (`setting(...)`), and how its values are read from
JSON (an API body, a batch row, GGUF metadata) and from text (a CLI flag, a Modelfile PARAMETER).
settings.py declares the settings themselves and resolves a request's."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from localrun.errors import UsageError

DRAFTERS = ("lookup", "model")  # speculative decoding's drafters: prompt lookup, the loaded draft model
# The places a setting is named outside: a CLI flag, the OpenAI chat/completions field, an Ollama
# option, a Modelfile PARAMETER, a batch row's key, GGUF metadata (the model's own defaults), and
# the Anthropic Messages and OpenAI Responses fields.
FRONTS = ("cli", "openai", "ollama", "modelfile", "batch", "gguf", "anthropic", "responses")
MAX_BIAS = 100.0  # a logit bias's bound, as OpenAI's


@dataclass(frozen=True)
class Setting:
    """One setting: its field, kind, default, check, help, and names outside."""

    name: str
    kind: str  # float int bool text stops bias drafter adapters layers moe switch choice
    default: Any
    check: Callable[[Any], bool] | None
    expected: str  # what a valid value is, in words ("a number in (0, 1]")
    help: str
    names: Mapping[str, tuple[str, ...]]  # front -> its names there, the first one winning
    group: str = "generation"  # the CLI's help group
    # an outside value that means "not set" (seed -1), everywhere or by front
    unset: Callable[[Any], bool] | Mapping[str, Callable[[Any], bool]] | None = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    scope: str = "generation"  # or "load"

    def is_unset(self, value: Any, front: str) -> bool:
        """Whether an outside value means "not set" in this front (Ollama's num_predict -1)."""
        rule = self.unset.get(front) if isinstance(self.unset, Mapping) else self.unset
        return rule is not None and rule(value)

    def outside(self, front: str) -> str | None:
        """The setting's first name in a front, or None where it is not taken there."""
        names = self.names.get(front)
        return names[0] if names else None

    @property
    def flag(self) -> str:
        """How errors name it where no front is known: its CLI flag, else its field."""
        return self.outside("cli") or self.name

    def valid(self, value: Any, label: str) -> None:
        """Raise UsageError naming `label` unless value passes the check."""
        if value is None or self.check is None:
            return
        try:
            ok = self.check(value)
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            raise UsageError(f"invalid value for {label}: {value!r}", f"expected {self.expected}")

    def coerce(self, value: Any, label: str, front: str = "") -> Any:
        """A value as a front gives it (JSON from an API body, a batch row or GGUF metadata; what
        `parse` made of a flag or a PARAMETER) as this setting's type, checked."""
        kind = self.kind
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, int | float) or not finite(value):
                raise UsageError(f"invalid value for {label}: {value!r}", "expected a finite number")
            value = float(value)
        elif kind == "int":
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"invalid value for {label}: {value!r}", "expected an integer")
        elif kind == "bool":
            if not isinstance(value, bool):
                raise UsageError(f"invalid value for {label}: {value!r}", "expected true or false")
        elif kind == "stops":
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
                raise UsageError(f"invalid value for {label}: {value!r}", "expected a string or a list of strings")
            value = tuple(s for s in items if s)
        elif kind == "bias":
            value = _bias(value, label)
        elif kind == "drafter":  # "on" and "off" are the resolver's to decide
            return _drafter_value(value, label, models=front in ("cli", "modelfile"))
        elif kind in ("text", "choice"):
            if not isinstance(value, str):
                raise UsageError(f"invalid value for {label}: {value!r}", f"expected {self.expected}")
        self.valid(value, label)
        return value

    def parse(self, text: str, label: str, front: str) -> Any:
        """A value from text (a CLI flag, a Modelfile PARAMETER) as that front keeps it: typed and
        checked, but a stop is one text and a drafter its text ('lookup' or a model's name)."""
        kind, raw = self.kind, text if self.kind == "stops" else text.strip()
        try:
            if kind == "float":
                value: Any = float(raw)
                if not finite(value):
                    raise ValueError
            elif kind == "int":
                value = int(raw)
            elif kind == "bool":
                if raw.lower() not in ("true", "false"):
                    raise ValueError
                value = raw.lower() == "true"
            elif kind == "bias":
                value = _bias_text(raw)
            elif kind == "layers":
                value = raw if raw == "auto" else int(raw)
            elif kind == "moe":
                value = raw if raw == "all" else int(raw)
            elif kind == "switch":
                value = {"auto": None, "on": True, "off": False}[raw.lower()]
            elif kind == "choice":
                value = raw.lower()
            elif kind == "drafter":
                if not raw or any(c.isspace() for c in raw):
                    raise ValueError
                value = "lookup" if raw.lower() == "lookup" else raw
            else:  # text, stops
                value = raw
        except (ValueError, KeyError):
            raise UsageError(f"invalid value for {label}: {text!r}", f"expected {self.expected}") from None
        if kind not in ("stops", "drafter", "text") and not self.is_unset(value, front):
            self.valid(value, label)
        return value


def setting(default: Any, *, kind: str, help: str, check: Callable[[Any], bool] | None = None,
            expected: str = "", group: str = "generation",
            unset: Callable[[Any], bool] | Mapping[str, Callable[[Any], bool]] | None = None,
            choices: tuple[str, ...] = (), metavar: str | None = None,
            **names: str | tuple[str, ...]) -> Any:
    """A dataclass field declared as a setting (the field's name and type come from the class)."""
    spec = {"kind": kind, "check": check, "expected": expected, "help": help, "group": group, "unset": unset,
            "choices": choices, "metavar": metavar,
            "names": {k: (v,) if isinstance(v, str) else tuple(v) for k, v in names.items()}}
    unknown = set(names) - set(FRONTS)
    if unknown:
        raise TypeError(f"unknown fronts {sorted(unknown)}")
    return field(default=default, metadata={"setting": spec})


def finite(value: Any) -> bool:
    """math.isfinite, false for an int too large for a float (JSON allows any number of digits)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _bias(value: Any, label: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) or its pairs, as sorted (token, bias) pairs."""
    items = value.items() if isinstance(value, Mapping) else value
    out: dict[int, float] = {}
    try:
        for token, bias in items:
            tid = int(token)
            if isinstance(bias, bool) or not isinstance(bias, int | float) or isinstance(token, bool | float):
                raise ValueError
            out[tid] = float(bias)
    except (TypeError, ValueError):
        raise UsageError(f"invalid value for {label}: {value!r}",
                         'expected {"TOKEN_ID": BIAS, ...}, a token id and a number from -100 to 100') from None
    return tuple(sorted(out.items()))


def _bias_text(text: str) -> tuple[tuple[int, float], ...]:
    """A --logit-bias flag: TOKEN=BIAS, or llama.cpp's TOKEN+BIAS / TOKEN-BIAS."""
    for sep in ("=", "+", "-"):
        token, found, bias = text.partition(sep)
        if found and token.strip().isdigit():
            value = float(bias) * (-1 if sep == "-" else 1)
            return ((int(token), value),)
    raise ValueError(text)


def _drafter_value(value: Any, label: str, models: bool = False) -> str:
    """An API's speculative field: a drafter, true ("on": the server's drafter, else lookup), or
    false / "none" / "off" ("off": no drafts even where a preset or the server drafts). With
    `models` (a flag, a PARAMETER) any other text names a draft model: "model"."""
    if value is True:
        return "on"
    if value is False or value in ("none", "off"):
        return "off"
    if value in DRAFTERS:
        return str(value)
    if models and isinstance(value, str) and value:
        return "model"
    raise UsageError(f"invalid value for {label}: {value!r}", "expected true, false, \"lookup\", \"model\" or \"none\"")


def adapters(value: Any) -> tuple[tuple[str, float], ...]:
    """(path, scale) pairs as a tuple of tuples (JSON brings them back as lists)."""
    out = []
    for item in value or ():
        path, scale = item
        scale = float(scale)
        if not math.isfinite(scale):
            raise UsageError(f"invalid value for --lora: {path}:{scale}", "expected a finite scale, e.g. ADAPTER:0.5")
        out.append((str(path), scale))
    return tuple(out)


def bias_ok(pairs: Any) -> bool:
    return all(-MAX_BIAS <= b <= MAX_BIAS and t >= 0 for t, b in pairs)


def seed_unset(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v < 0


def nonpositive(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v <= 0


def negative(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v < 0
