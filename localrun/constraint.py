"""Output constraints: a JSON schema, any JSON object, a GBNF grammar, a choice from a list.

Every constraint becomes one Lark grammar in llguidance's dialect, which both engines apply at
the sampler (a token mask per step, so only tokens that keep the output valid can be chosen).
A constraint is checked here, before any engine sees it: an invalid schema or grammar, or a JSON
Schema keyword that would not be enforced, is a UsageError naming it, never something dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localrun.errors import BackendUnavailableError, UsageError

# Keywords whose meaning is enforced while generating.
_ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "enum", "const", "items", "prefixItems",
    "minItems", "maxItems", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "pattern", "format",
    "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
# Annotations: they describe, they do not constrain.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly", "writeOnly",
    "deprecated", "$anchor",
})
FORMATS = ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid")
_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# Compact separators and no free whitespace: a small model cannot wander off into blank lines.
# oneOf is taken as anyOf (llguidance cannot enforce "exactly one"): what agents' tools declare
# (Qwen Code's) then constrains instead of failing the request.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": True}
KINDS = ("json", "schema", "grammar", "choice", "regex", "lark")


def check_schema(schema: Any, where: str = "schema") -> None:
    """Refuse a JSON schema with a keyword the decoder would not enforce, naming it and its place."""
    _walk(schema, where, "")


def _walk(node: Any, where: str, path: str) -> None:
    at = path or "/"
    if isinstance(node, bool):
        return
    if not isinstance(node, Mapping):
        raise UsageError(f"invalid {where}: the schema at {at} must be an object or a boolean, not {type(node).__name__}")
    for key in node:
        if key not in _ENFORCED and key not in _ANNOTATIONS and not str(key).startswith("x-"):
            raise UsageError(f"unsupported JSON Schema keyword '{key}' in the {where} (at {at})",
                             f"structured output enforces: {', '.join(sorted(_ENFORCED))}")
    types = node.get("type")
    for t in [types] if isinstance(types, str) else (types or []):
        if t not in _TYPES:
            raise UsageError(f"invalid {where}: unknown type {t!r} at {at}", f"use one of {', '.join(sorted(_TYPES))}")
    fmt = node.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise UsageError(f"unsupported string format {fmt!r} in the {where} (at {at})", f"supported: {', '.join(FORMATS)}")
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise UsageError(f"invalid {where}: only local references (#/...) are supported, not {ref!r} at {at}")
    required = node.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise UsageError(f"invalid {where}: 'required' at {at} must be a list of property names")
    for key in ("properties", "$defs", "definitions"):
        sub = node.get(key)
        if sub is None:
            continue
        if not isinstance(sub, Mapping):
            raise UsageError(f"invalid {where}: '{key}' at {at} must be an object")
        for name, child in sub.items():
            _walk(child, where, f"{path}/{key}/{name}")
    for key in ("additionalProperties", "items"):
        if key in node and not isinstance(node[key], bool):
            _walk(node[key], where, f"{path}/{key}")
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        sub = node.get(key)
        if sub is None:
            continue
        if not isinstance(sub, list) or not sub:
            raise UsageError(f"invalid {where}: '{key}' at {at} must be a non-empty list of schemas")
        for i, child in enumerate(sub):
            _walk(child, where, f"{path}/{key}/{i}")


def enforceable(node: Any) -> Any:
    """A copy of a schema without the keywords the decoder cannot enforce (propertyNames, if/then,
    uniqueItems...) and string formats it does not know. For a tool's parameters: the tool checks
    its own input, and an agent's tools (Claude Code's) must not fail a request over a keyword
    the grammar cannot hold; a response format keeps check_schema's refusal instead."""
    if isinstance(node, list):
        return [enforceable(n) for n in node]
    if not isinstance(node, Mapping):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, Mapping):
            out[key] = {name: enforceable(child) for name, child in value.items()}
        elif key == "format" and value not in FORMATS:
            continue
        elif key in ("enum", "const", "default", "examples") or key in _ANNOTATIONS or str(key).startswith("x-"):
            out[key] = value
        elif key in _ENFORCED:
            out[key] = enforceable(value)
    return out


def closed_objects(node: Any) -> Any:
    """A copy of schema where an object with `properties` and no `additionalProperties` takes
    no other keys (llama.cpp's and OpenAI strict mode's reading). Everything it allows still
    validates against the original; left open, a small model wanders off into invented keys."""
    if isinstance(node, list):
        return [closed_objects(n) for n in node]
    if not isinstance(node, Mapping):
        return node
    out = {k: (v if k in ("enum", "const", "default", "examples") else closed_objects(v)) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and isinstance(out["properties"], Mapping):
        out["additionalProperties"] = False
    return out


# Numbers as llama.cpp's schema grammars bound them: at most 16 integer digits. A fraction is
# bounded through multipleOf, whose finest step llguidance takes is 1e-10 (10 digits, no exponent).
INT_LIMIT = 10**16 - 1
FRACTION_STEP = 1e-10
_ANY = "__localrun_any"
_ANY_REF = {"$ref": f"#/$defs/{_ANY}"}
_COMPOSED = ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf", "not", "properties", "items",
             "prefixItems", "additionalProperties", "pattern", "format", "minLength", "maxLength")


def _bounded_number(node: dict[str, Any], integer: bool) -> None:
    if "minimum" not in node and "exclusiveMinimum" not in node:
        node["minimum"] = -INT_LIMIT
    if "maximum" not in node and "exclusiveMaximum" not in node:
        node["maximum"] = INT_LIMIT
    if not integer and "multipleOf" not in node:
        node["multipleOf"] = FRACTION_STEP


def bounded_numbers(node: Any) -> Any:
    """A copy of schema in which every number the output can hold has a bounded length: integer
    parts of at most 16 digits and fractions of at most 10 (unless the schema narrows them), also
    inside values of any type. Left unbounded, a model can write digits until its budget ends."""
    defs: dict[str, Any] = {}

    def walk(n: Any) -> Any:
        if n is True or (isinstance(n, Mapping) and not any(k in n for k in _COMPOSED)):
            defs[_ANY] = True
            return dict(_ANY_REF, **n) if isinstance(n, Mapping) else dict(_ANY_REF)
        if not isinstance(n, Mapping):
            return n
        out: dict[str, Any] = {}
        for k, v in n.items():
            if k in ("properties", "$defs", "definitions") and isinstance(v, Mapping):
                out[k] = {name: walk(child) for name, child in v.items()}
            elif k in ("items", "additionalProperties", "not") and isinstance(v, (Mapping, bool)):
                out[k] = walk(v) if v is not False else v
            elif k in ("prefixItems", "anyOf", "oneOf", "allOf") and isinstance(v, list):
                out[k] = [walk(child) for child in v]
            else:
                out[k] = v
        types = out.get("type")
        types = [types] if isinstance(types, str) else list(types or [])
        if "number" in types or "integer" in types:
            _bounded_number(out, "number" not in types)
        if "object" in types and "additionalProperties" not in out and "properties" not in out:
            out["additionalProperties"] = walk(True)
        if "array" in types and "items" not in out and "prefixItems" not in out:
            out["items"] = walk(True)
        return out

    root = walk(node)
    if defs:
        number: dict[str, Any] = {"type": "number"}
        _bounded_number(number, False)
        any_value = {"anyOf": [{"type": "string"}, number, {"type": ["boolean", "null"]},
                               {"type": "array", "items": _ANY_REF},
                               {"type": "object", "additionalProperties": _ANY_REF}]}
        root = dict(root)
        root["$defs"] = {**root.get("$defs", {}), _ANY: any_value}
    return root


def schema_lark(schema: Any, rule: str = "start") -> str:
    """The Lark rule for JSON that validates against schema (compact separators, closed objects,
    numbers of bounded length)."""
    body = bounded_numbers(closed_objects(schema)) if isinstance(schema, Mapping) or schema is True \
        else {"not": {}}
    body.setdefault("x-guidance", _JSON_STYLE)
    # '<' spelled \u003c: nothing inside a schema can be taken for a <<special:...>> placeholder
    return f"{rule}: %json {json.dumps(body, ensure_ascii=False).replace('<', chr(92) + 'u003c')}\n"


def literal(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True)
class Constraint:
    """What the output must be. `grammar` is the Lark text the engines apply."""

    kind: str
    grammar: str
    source: Any = None  # the schema, grammar text or choices it was made from

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object."""
        return cls("json", schema_lark({"type": "object"}), {"type": "object"})

    @classmethod
    def schema(cls, schema: Any, where: str = "schema") -> Constraint:
        if isinstance(schema, str):
            schema = _load_json(schema, where)
        check_schema(schema, where)
        return cls("schema", _validated(schema_lark(schema), where), schema)

    @classmethod
    def gbnf(cls, text: str, where: str = "grammar") -> Constraint:
        """A llama.cpp GBNF grammar (root rule `root`); a Lark grammar is taken as it is."""
        if not isinstance(text, str) or not text.strip():
            raise UsageError(f"invalid {where}: it is empty")
        import_llguidance(where)
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(text)
        except Exception as e:  # the converter raises its own error types and ValueError
            raise UsageError(f"invalid {where}: {e}", "write it in GBNF (llama.cpp's grammar format)") from e
        return cls("grammar", _validated(lark, where), text)

    @classmethod
    def choice(cls, options: Sequence[str], where: str = "choice") -> Constraint:
        items = [o for o in options if isinstance(o, str)]
        if not items or len(items) != len(options) or any(not o for o in items):
            raise UsageError(f"invalid {where}: expected a non-empty list of non-empty strings")
        lark = "start: " + " | ".join(literal(o) for o in dict.fromkeys(items)) + "\n"
        return cls("choice", _validated(lark, where), list(items))

    @classmethod
    def regex(cls, pattern: str, where: str = "regex") -> Constraint:
        return cls("regex", _validated(f"start: /{pattern.replace('/', chr(92) + '/')}/\n", where), pattern)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], where: str = "constraint") -> Constraint:
        """From {"schema": ...} / {"grammar": ...} / {"choice": [...]} / {"format": "json"} (rows, settings)."""
        keys = [k for k in ("schema", "grammar", "choice", "format", "regex") if spec.get(k) is not None]
        if len(keys) > 1:
            raise UsageError(f"{where}: give one of schema, grammar, choice or format, not {' and '.join(keys)}")
        if not keys:
            raise UsageError(f"{where}: no constraint given")
        key, value = keys[0], spec[keys[0]]
        if key == "schema":
            return cls.schema(value, f"{where} schema")
        if key == "grammar":
            return cls.gbnf(value, f"{where} grammar")
        if key == "regex":
            return cls.regex(value, f"{where} regex")
        if key == "choice":
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",")]
            return cls.choice(value, f"{where} choice")
        if value == "json":
            return cls.json_object()
        if isinstance(value, Mapping):
            return cls.schema(value, f"{where} format")
        raise UsageError(f"{where}: format must be 'json' or a JSON schema, not {value!r}")

    def to_spec(self) -> dict[str, Any]:
        key = {"json": "format", "schema": "schema", "grammar": "grammar", "choice": "choice", "regex": "regex"}[self.kind]
        return {key: "json" if self.kind == "json" else self.source}


def read_text_or_file(value: str, what: str) -> str:
    """A CLI value that is either the text itself or the path of a file (or pipe) holding it."""
    if value.lstrip()[:1] in ("{", "[") or "\n" in value:
        return value
    p = Path(value).expanduser()
    try:
        if not p.exists() or p.is_dir():
            return value
        return p.read_text(encoding="utf-8")
    except OSError as e:
        if len(value) > 255:  # too long to be a path: it is the text
            return value
        raise UsageError(f"cannot read the {what} file {value}: {e.strerror}") from e


def _load_json(text: str, where: str) -> Any:
    try:
        return json.loads(read_text_or_file(text, where))
    except ValueError as e:
        raise UsageError(f"invalid {where}: not JSON ({e})", "give a JSON schema, or the path of a file with one") from e


def import_llguidance(where: str = "structured output") -> Any:
    """The llguidance module, or an error saying how to install it."""
    try:
        import llguidance
    except ImportError as e:
        raise BackendUnavailableError(f"the {where} needs llguidance (structured output), which is not installed",
                                      "pip install llguidance") from e
    return llguidance


def _validated(lark: str, where: str) -> str:
    """The grammar, once llguidance has compiled it (with no tokenizer: structure only)."""
    llguidance = import_llguidance(where)
    message = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark), None)
    if message and not message.startswith("WARNING"):
        raise UsageError(f"invalid {where}: {message.strip()}")
    return lark
