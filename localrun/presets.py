"""Presets: a model with its own settings, written as Ollama's Modelfile.

A preset names its base (`FROM`: a model, a GGUF file, another preset) and adds sampling and load
parameters, a system prompt, a chat template, LoRA adapters, a starting conversation and a license.
It is a store entry that points at its base: no model bytes are copied. Settings apply in layers:
the model's defaults, then each preset from the base up, then the request's own options.

The Modelfile reader follows Ollama's parser (instructions are case-insensitive; values may be
quoted with `"` or, over several lines, with `\"\"\"`); an unknown instruction, parameter or bad
value is an error naming its line. A TEMPLATE written in Go's template language, as Ollama's own
Modelfiles have them, is translated to Jinja for the constructs those use (see `go_template`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from localrun import settings
from localrun.errors import UsageError

INSTRUCTIONS = ("from", "parameter", "system", "template", "adapter", "message", "license")
# Instructions of Ollama's format that localrun reads but has no use for (renderer/parser name
# Ollama's built-in Go code; requires its version).
IGNORED = ("renderer", "parser", "requires")
ROLES = ("system", "user", "assistant")


# PARAMETER names: the settings' Modelfile names (settings.py declares them, their types and checks).
PARAMETERS: tuple[str, ...] = tuple(settings.named("modelfile"))
# Ollama parameters localrun does not implement: refused by name in a Modelfile, skipped on import.
UNSUPPORTED = ("mirostat", "mirostat_eta", "mirostat_tau", "tfs_z", "num_keep", "penalize_newline",
               "numa", "num_gqa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap", "use_mlock",
               "main_gpu", "rope_frequency_base", "rope_frequency_scale")


@dataclass(frozen=True)
class Command:
    """One instruction of a Modelfile: its line, lower-case name and value (a parameter's name is
    the command's name, as in Ollama's parser)."""

    line: int
    name: str
    args: str


def _line_error(line: int, message: str, hint: str | None = None) -> UsageError:
    return UsageError(f"Modelfile line {line}: {message}", hint)


def parse_commands(text: str) -> list[Command]:
    """The instructions of a Modelfile, in order (comments and blank lines dropped)."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    out: list[Command] = []
    i, line, n = 0, 1, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
            continue
        if c in " \t":
            i += 1
            continue
        if c == "#":
            while i < n and text[i] != "\n":
                i += 1
            continue
        start_line = line
        j = i
        while j < n and text[j].isascii() and text[j].isalpha():
            j += 1
        word = text[i:j]
        if j >= n or text[j] not in " \t" or not word:
            raise _line_error(start_line, f"'{text[i:j + 1].strip() or text[i]}' is not an instruction",
                              f"instructions are {', '.join(s.upper() for s in INSTRUCTIONS)}")
        name = word.lower()
        if name not in INSTRUCTIONS and name not in IGNORED:
            raise _line_error(start_line, f"unknown instruction '{word}'",
                              f"instructions are {', '.join(s.upper() for s in INSTRUCTIONS)}")
        i = j
        while i < n and text[i] in " \t":
            i += 1
        if name in ("parameter", "message"):
            j = i
            while j < n and (text[j].isascii() and (text[j].isalnum() or text[j] == "_")):
                j += 1
            key = text[i:j]
            if not key or j >= n or text[j] not in " \t":
                what = "a parameter name and a value" if name == "parameter" else "a role and a message"
                raise _line_error(start_line, f"{word.upper()} needs {what}")
            i = j
            while i < n and text[i] in " \t":
                i += 1
        else:
            key = ""
        value, i, line = _value(text, i, line, start_line)
        if name == "parameter":
            out.append(Command(start_line, key.lower(), value))
        elif name == "message":
            if key not in ROLES:
                raise _line_error(start_line, f"message role '{key}' must be one of {', '.join(ROLES)}")
            out.append(Command(start_line, "message", f"{key}: {value}"))
        else:
            out.append(Command(start_line, name, value))
    return out


def _value(text: str, i: int, line: int, start_line: int) -> tuple[str, int, int]:
    """A value from i: `\"\"\"...\"\"\"` (may span lines), `"..."`, or the rest of the line."""
    n = len(text)
    quote = '"""' if text.startswith('"""', i) else '"' if text.startswith('"', i) else ""
    if quote:
        end = text.find(quote, i + len(quote))
        if end < 0:
            raise _line_error(start_line, f"a value opened with {quote} is never closed")
        value = text[i + len(quote):end]
        line += value.count("\n")
        i = end + len(quote)
    else:
        end = text.find("\n", i)
        end = n if end < 0 else end
        value = text[i:end].strip()
        i = end
        if not value:
            raise _line_error(start_line, "the instruction has no value")
        return value, i, line
    rest_end = text.find("\n", i)
    rest_end = n if rest_end < 0 else rest_end
    if text[i:rest_end].strip():
        raise _line_error(line, f"unexpected text after the quoted value: {text[i:rest_end].strip()!r}")
    return value, rest_end, line


def parse_parameter(name: str, value: str, line: int | None = None) -> tuple[str, Any]:
    """(name, typed value) of one PARAMETER; a clear error for an unknown name or a bad value."""
    where = f"Modelfile line {line}: " if line else ""
    name = name.lower()
    if name not in PARAMETERS:
        if name in UNSUPPORTED:
            raise UsageError(f"{where}parameter '{name}' is not supported by localrun",
                             f"supported: {', '.join(PARAMETERS)}")
        raise UsageError(f"{where}unknown parameter '{name}'", f"parameters are {', '.join(PARAMETERS)}")
    text = value if isinstance(value, str) else str(value)
    try:
        return name, settings.read_text(name, text)
    except UsageError as e:
        raise UsageError(f"{where}bad value {value!r} for parameter '{name}': {e.hint or e.message}") from None


@dataclass(frozen=True)
class Preset:
    """A preset's own settings (the base's and parents' settings apply under these)."""

    base: str  # FROM: a store name or an absolute path
    parameters: Mapping[str, Any] = field(default_factory=dict)  # Modelfile names; "stop" is a list
    system: str | None = None
    template: str | None = None  # Jinja, as the engines render it
    template_source: str | None = None  # the TEMPLATE as written, when it was translated from Go
    adapters: tuple[str, ...] = ()
    messages: tuple[Mapping[str, str], ...] = ()
    license: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"base": self.base, "parameters": dict(self.parameters)}
        for key in ("system", "template", "template_source"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.adapters:
            out["adapters"] = list(self.adapters)
        if self.messages:
            out["messages"] = [dict(m) for m in self.messages]
        if self.license:
            out["license"] = list(self.license)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Preset:
        return cls(base=str(data["base"]), parameters=dict(data.get("parameters") or {}), system=data.get("system"),
                   template=data.get("template"), template_source=data.get("template_source"),
                   adapters=tuple(data.get("adapters") or ()),
                   messages=tuple(dict(m) for m in data.get("messages") or ()),
                   license=tuple(data.get("license") or ()))

    def over(self, parent: Preset | None) -> Preset:
        """These settings over a parent's (the child wins; stop lists replace, adapters add up)."""
        if parent is None:
            return self
        return Preset(
            base=self.base, parameters={**parent.parameters, **self.parameters},
            system=self.system if self.system is not None else parent.system,
            template=self.template if self.template is not None else parent.template,
            template_source=self.template_source if self.template is not None else parent.template_source,
            adapters=(*parent.adapters, *self.adapters),
            messages=self.messages or parent.messages,
            license=self.license or parent.license,
        )

    def generation_values(self) -> dict[str, Any]:
        """The generation settings the preset sets (request options go over these)."""
        return settings.modelfile_values(self.parameters)

    @property
    def draft_model(self) -> str | None:
        """The draft model that `PARAMETER draft` names (None for lookup or no draft)."""
        value = self.parameters.get("draft")
        return None if value in (None, "lookup") else str(value)

    def load_values(self) -> dict[str, Any]:
        """LoadOptions fields the preset sets."""
        return settings.modelfile_load_values(self.parameters)

    def modelfile(self, header: str | None = None) -> str:
        """The Modelfile that `create` turns back into this preset."""
        lines = [f"# {header}"] if header else []
        lines.append(f"FROM {self.base}")
        for name, value in self.parameters.items():
            for v in value if isinstance(value, list) else [value]:
                lines.append(f"PARAMETER {name} {_quote(str(v))}")
        if self.template_source is not None or self.template is not None:
            lines.append(f"TEMPLATE {_quote(self.template_source if self.template_source is not None else self.template or '')}")
        if self.system is not None:
            lines.append(f"SYSTEM {_quote(self.system)}")
        lines += [f"ADAPTER {a}" for a in self.adapters]
        lines += [f"MESSAGE {m['role']} {_quote(m['content'])}" for m in self.messages]
        lines += [f"LICENSE {_quote(text)}" for text in self.license]
        return "\n".join(lines) + "\n"


def _quote(s: str) -> str:
    """A value as a Modelfile writes it: bare when it is one line without edge spaces, else quoted."""
    if "\n" in s or s != s.strip() or s.startswith('"') or not s:
        if '"' in s:
            if '"""' in s:
                raise UsageError("a value holds \"\"\" and cannot be written in a Modelfile")
            return f'"""{s}"""'
        return f'"{s}"'
    return s


def read_modelfile(text: str, resolve_path: Callable[[str], str] | None = None) -> Preset:
    """A Preset from a Modelfile's text. resolve_path turns a relative path (FROM, ADAPTER) into an
    absolute one (relative to the Modelfile's folder)."""
    commands = parse_commands(text)
    froms = [c for c in commands if c.name == "from"]
    if not froms:
        raise UsageError("the Modelfile has no FROM line", "start it with FROM MODEL (a model name, a GGUF file or a preset)")
    if len(froms) > 1:
        raise _line_error(froms[1].line, "a second FROM line", "a preset has one base")
    params: dict[str, Any] = {}
    system = template = source = None
    adapters: list[str] = []
    messages: list[dict[str, str]] = []
    licenses: list[str] = []
    base = froms[0].args
    if resolve_path and _looks_like_path(base):
        base = resolve_path(base)
    for c in commands:
        if c.name in ("from", *IGNORED):
            continue
        if c.name == "system":
            system = c.args
        elif c.name == "template":
            template, source = translate_template(c.args, c.line)
        elif c.name == "adapter":
            adapters.append(resolve_path(c.args) if resolve_path else c.args)
        elif c.name == "message":
            role, _, content = c.args.partition(": ")
            messages.append({"role": role, "content": content})
        elif c.name == "license":
            licenses.append(c.args)
        else:
            name, value = parse_parameter(c.name, c.args, c.line)
            if name == "stop":
                params.setdefault("stop", []).append(value)
            else:
                params[name] = value
    return Preset(base, params, system, template, source, tuple(adapters), tuple(messages), tuple(licenses))


def _looks_like_path(value: str) -> bool:
    return value.startswith((".", "/", "~")) or value.endswith(".gguf") or "\\" in value


def preset_from_fields(base: str, system: str | None = None, parameters: Mapping[str, Any] | None = None,
                       template: str | None = None, messages: Sequence[Mapping[str, str]] = (),
                       license: str | Sequence[str] | None = None, adapters: Sequence[str] = ()) -> Preset:
    """A Preset from Ollama's /api/create fields (`from`, `system`, `parameters`, ...)."""
    params: dict[str, Any] = {}
    for name, value in (parameters or {}).items():
        values = value if isinstance(value, list) else [value]
        for v in values:
            key, parsed = parse_parameter(name, str(v).lower() if isinstance(v, bool) else str(v))
            if key == "stop":
                params.setdefault("stop", []).append(parsed)
            else:
                params[key] = parsed
    tpl, source = translate_template(template, None) if template else (None, None)
    msgs = []
    for m in messages or ():
        role = m.get("role")
        if role not in ROLES:
            raise UsageError(f"message role {role!r} must be one of {', '.join(ROLES)}")
        msgs.append({"role": str(role), "content": str(m.get("content") or "")})
    licenses = (license,) if isinstance(license, str) else tuple(license or ())
    return Preset(base, params, system, tpl, source, tuple(adapters), tuple(msgs), licenses)


# -- Go templates ---------------------------------------------------------------------------------

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.DOTALL)


def is_go_template(text: str) -> bool:
    """Whether a template is written in Go's template language (Ollama's) rather than Jinja."""
    if "{%" in text:
        return False
    return bool(re.search(r"\{\{-?\s*(?:\.|\$|(?:if|range|end|else|with|template|define|block|break|continue)\b)", text))


def translate_template(text: str, line: int | None) -> tuple[str, str | None]:
    """(Jinja template, the Go source or None): a Jinja TEMPLATE is kept as it is (checked to
    compile); a Go one is translated."""
    if not is_go_template(text):
        _check_jinja(text, line)
        return text, None
    return go_template(text, line), text


def _check_jinja(text: str, line: int | None) -> None:
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        where = f"Modelfile line {line}: " if line else ""
        raise UsageError(f"{where}the TEMPLATE is not a valid Jinja template ({e.message}, its line {e.lineno})") from None


class _GoError(Exception):
    pass


# Go template functions localrun translates, with their arity check (None: at least 1)
_FUNCS = ("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "len", "slice", "index", "json", "printf")
_TOP_FIELDS = {"System": "System", "Prompt": "Prompt", "Response": "Response", "Messages": "Messages",
               "Tools": "Tools", "Think": "Think", "IsThinkSet": "IsThinkSet"}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class _Expr:
    """A Go template pipeline turned into a Jinja expression."""

    def __init__(self, text: str, dot: str | None, variables: set[str]) -> None:
        self.tokens = self._tokenize(text)
        self.pos = 0
        self.dot = dot  # the Jinja name `.` stands for; None: the top level
        self.variables = variables

    @staticmethod
    def _tokenize(text: str) -> list[str]:
        tokens: list[str] = []
        i = 0
        while i < len(text):
            c = text[i]
            if c.isspace():
                i += 1
            elif c in "()":
                tokens.append(c)
                i += 1
            elif c == '"':
                j = i + 1
                while j < len(text) and text[j] != '"':
                    j += 2 if text[j] == "\\" else 1
                if j >= len(text):
                    raise _GoError("an unterminated string")
                tokens.append(text[i:j + 1])
                i = j + 1
            elif c == "`":
                j = text.find("`", i + 1)
                if j < 0:
                    raise _GoError("an unterminated raw string")
                tokens.append(text[i:j + 1])
                i = j + 1
            elif c == "|":
                raise _GoError("pipes ('|') are not translated")
            else:
                j = i
                while j < len(text) and not text[j].isspace() and text[j] not in '()"`|':
                    j += 1
                tokens.append(text[i:j])
                i = j
        return tokens

    def parse(self) -> str:
        expr = self._command()
        if self.pos != len(self.tokens):
            raise _GoError(f"unexpected '{self.tokens[self.pos]}'")
        return expr

    def _command(self) -> str:
        """A function call with its arguments, or one operand."""
        if self.pos >= len(self.tokens):
            raise _GoError("an empty expression")
        head = self.tokens[self.pos]
        if head in _FUNCS:
            self.pos += 1
            args = []
            while self.pos < len(self.tokens) and self.tokens[self.pos] != ")":
                args.append(self._operand())
            return self._call(head, args)
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", head) and head not in ("true", "false", "nil"):
            raise _GoError(f"the function '{head}' is not translated (translated: {', '.join(_FUNCS)})")
        value = self._operand()
        if self.pos < len(self.tokens) and self.tokens[self.pos] != ")":
            raise _GoError(f"unexpected '{self.tokens[self.pos]}'")
        return value

    def _operand(self) -> str:
        tok = self.tokens[self.pos]
        self.pos += 1
        if tok == "(":
            inner = self._command()
            if self.pos >= len(self.tokens) or self.tokens[self.pos] != ")":
                raise _GoError("a '(' is not closed")
            self.pos += 1
            out = f"({inner})"
            if self.pos < len(self.tokens) and re.fullmatch(r"(\.[A-Za-z_]\w*)+", self.tokens[self.pos]):
                out += "".join(f".{_snake(p)}" for p in self.tokens[self.pos][1:].split("."))  # (x).Field
                self.pos += 1
            return out
        if tok.startswith('"'):
            import json

            return repr(json.loads(tok))
        if tok.startswith("`"):
            return repr(tok[1:-1])
        if re.fullmatch(r"-?\d+(\.\d+)?", tok):
            return tok
        if tok in ("true", "false"):
            return tok
        if tok == "nil":
            return "none"
        if tok.startswith("$") or tok.startswith("."):
            return self._field(tok)
        raise _GoError(f"'{tok}' is not translated")

    def _field(self, tok: str) -> str:
        if tok == ".":
            if self.dot is None:
                raise _GoError("'.' at the top level is not translated")
            return self.dot
        if tok.startswith("$"):
            head, _, rest = tok[1:].partition(".")
            if head == "":  # $.Field: the top level
                parts = rest.split(".")
                return self._path(None, parts)
            if head not in self.variables:
                raise _GoError(f"the variable ${head} is not defined")
            return self._path(f"gv.{head}", rest.split(".") if rest else [])
        return self._path(self.dot, tok[1:].split("."))

    @staticmethod
    def _path(base: str | None, parts: list[str]) -> str:
        if base is None:
            first, parts = parts[0], parts[1:]
            if first not in _TOP_FIELDS:
                raise _GoError(f"the field .{first} is not translated (translated: {', '.join(_TOP_FIELDS)})")
            base = _TOP_FIELDS[first]
        for p in parts:
            base += f".{_snake(p)}"
        return base

    @staticmethod
    def _call(fn: str, args: list[str]) -> str:
        need = {"not": 1, "len": 1, "json": 1, "index": 2}
        if fn in need and len(args) != need[fn]:
            raise _GoError(f"{fn} takes {need[fn]} argument(s)")
        if fn in ("eq", "ne", "lt", "le", "gt", "ge") and len(args) < 2:
            raise _GoError(f"{fn} takes two arguments")
        if fn in ("and", "or") and not args:
            raise _GoError(f"{fn} takes arguments")
        if fn == "eq":
            return "(" + " or ".join(f"{args[0]} == {a}" for a in args[1:]) + ")"
        if fn in ("ne", "lt", "le", "gt", "ge"):
            op = {"ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}[fn]
            return f"({args[0]} {op} {args[1]})"
        if fn in ("and", "or"):
            return "(" + f" {fn} ".join(args) + ")"
        if fn == "not":
            return f"(not {args[0]})"
        if fn == "len":
            return f"({args[0]}|length)"
        if fn == "json":
            return f"({args[0]}|tojson)"
        if fn == "index":
            return f"{args[0]}[{args[1]}]"
        if fn == "printf":  # %s, %d and %v, as Python's % formatting reads them
            if not args:
                raise _GoError("printf takes a format")
            return f"({args[0].replace('%v', '%s')}|format({', '.join(args[1:])}))"
        if fn == "slice":
            if not 1 <= len(args) <= 3:
                raise _GoError("slice takes one to three arguments")
            return f"{args[0]}[{args[1] if len(args) > 1 else ''}:{args[2] if len(args) > 2 else ''}]"
        raise _GoError(f"the function '{fn}' is not translated")


def _go_actions(text: str) -> Iterator[tuple[str, str | None, bool, bool, int]]:
    """(text, action or None, trim before, trim after, line) pieces of a Go template."""
    pos = 0
    for m in _ACTION.finditer(text):
        if m.start() > pos:
            yield text[pos:m.start()], None, False, False, text.count("\n", 0, pos)
        body = m.group(2).strip()
        if body.startswith("/*"):
            body = "/*"
        yield "", body, bool(m.group(1)), bool(m.group(3)), text.count("\n", 0, m.start())
        pos = m.end()
    if pos < len(text):
        yield text[pos:], None, False, False, text.count("\n", 0, pos)


def _translate_body(text: str, first_line: int | None, cut_at_response: bool) -> tuple[str, set[str]]:
    """The Jinja of a Go template's body; with cut_at_response, everything after the first action
    that reads .Response is dropped (Ollama renders a conversation's last turn so), open blocks closed.
    Also returns the top-level fields it reads."""
    out: list[str] = []
    blocks: list[str] = []  # "if", "for"
    dots: list[str | None] = [None]
    variables: set[str] = set()
    fields: set[str] = set()
    n_loops = 0

    def tag(body: str, before: bool, after: bool) -> str:
        return "{%" + ("-" if before else "+") + " " + body + " " + ("-" if after else "+") + "%}"

    for piece, action, trim_before, trim_after, offset in _go_actions(text):
        where = (first_line + offset) if first_line else None
        if action is None:
            out.append(piece.replace("{#", "{{ '{#' }}"))
            continue
        try:
            fields.update(re.findall(r"(?<![A-Za-z0-9_])\$?\.([A-Z][A-Za-z]*)", action))
            if action == "/*":
                out.append(tag("if false", trim_before, trim_after) + tag("endif", False, False))
                continue
            words = action.split(None, 1)
            kw, rest = words[0], (words[1] if len(words) > 1 else "")
            if kw == "if":
                blocks.append("if")
                out.append(tag("if " + _Expr(rest, dots[-1], variables).parse(), trim_before, trim_after))
            elif kw == "else":
                if not blocks:
                    raise _GoError("an else outside a block")
                if rest.startswith("if "):
                    if blocks[-1] != "if":
                        raise _GoError("else if inside a range is not translated")
                    out.append(tag("elif " + _Expr(rest[3:], dots[-1], variables).parse(), trim_before, trim_after))
                elif rest:
                    raise _GoError(f"'else {rest}' is not translated")
                else:
                    out.append(tag("else", trim_before, trim_after))
            elif kw == "end":
                if not blocks:
                    raise _GoError("an end without a block")
                kind = blocks.pop()
                if kind == "for":
                    dots.pop()
                out.append(tag("endif" if kind == "if" else "endfor", trim_before, trim_after))
            elif kw == "range":
                m = re.fullmatch(r"(?:\$(\w+)\s*(?:,\s*\$(\w+))?\s*:=\s*)?(.+)", rest, re.DOTALL)
                if not m:
                    raise _GoError("a range without a list")
                n_loops += 1
                item, seq = f"item{n_loops}", f"seq{n_loops}"
                over = _Expr(m.group(3), dots[-1], variables).parse()
                first, second = m.group(1), m.group(2)
                # Go ranges over a map's keys in order (dot: the value), over a list's items
                out.append(tag(f"set {seq} = {over}", trim_before, False)
                           + tag(f"for {item} in ({seq}|dictsort if {seq} is mapping else {seq})", False, trim_after))
                value = f"({item}[1] if {seq} is mapping else {item})"
                out.append(tag(f"set dot{n_loops} = {value}", False, False))
                if first and second:  # $i, $v := list (or $k, $v := map)
                    variables.update((first, second))
                    out.append(tag(f"set gv.{first} = ({item}[0] if {seq} is mapping else loop.index0)", False, False)
                               + tag(f"set gv.{second} = dot{n_loops}", False, False))
                elif first:  # $v := list
                    variables.add(first)
                    out.append(tag(f"set gv.{first} = dot{n_loops}", False, False))
                blocks.append("for")
                dots.append(f"dot{n_loops}")
            elif kw in ("break", "continue") and not rest:
                if "for" not in blocks:
                    raise _GoError(f"{kw} outside a range")
                out.append(tag(kw, trim_before, trim_after))
            elif kw in ("with", "define", "template", "block"):
                raise _GoError(f"'{kw}' is not translated")
            elif re.match(r"\$\w+\s*:?=", action):
                m = re.match(r"\$(\w+)\s*:?=\s*(.+)", action, re.DOTALL)
                assert m is not None
                value = _Expr(m.group(2), dots[-1], variables).parse()
                variables.add(m.group(1))
                out.append(tag(f"set gv.{m.group(1)} = {value}", trim_before, trim_after))
            else:
                expr = _Expr(action, dots[-1], variables).parse()
                out.append(("{{-" if trim_before else "{{") + " " + expr + " " + ("-}}" if trim_after else "}}"))
                if cut_at_response and "Response" in re.findall(r"\.([A-Z]\w*)", action):
                    break
            if cut_at_response and kw in ("if", "else") and "Response" in re.findall(r"\.([A-Z]\w*)", action):
                break
        except _GoError as e:
            line = f"Modelfile line {where}: " if where else ""
            raise UsageError(f"{line}the TEMPLATE's {{{{ {action} }}}} cannot be translated from Go to Jinja: {e}",
                             "write the TEMPLATE in Jinja (the chat template language of Hugging Face models)") from None
    if blocks and not cut_at_response:
        raise UsageError(f"the TEMPLATE{f' at Modelfile line {first_line}' if first_line else ''} has a block without its {{{{ end }}}}")
    for kind in reversed(blocks):
        out.append("{% " + ("endif" if kind == "if" else "endfor") + " %}")
    return "".join(out), fields


# Ollama's collate(): system messages are gathered into .System; consecutive messages of one role
# (but tool) are merged with a blank line; message fields keep their Jinja names (role, content, ...).
_PRELUDE = (
    "{%- set gv = namespace() -%}"
    "{%- set ns = namespace(system=[], msgs=[]) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{%- set ns.system = ns.system + [m.content] -%}{%- endif -%}"
    "{%- if ns.msgs and ns.msgs[-1].role == m.role and m.role != 'tool' -%}"
    "{%- set last = ns.msgs[-1] -%}"
    "{%- set ns.msgs = ns.msgs[:-1] + [{'role': last.role, 'content': last.content ~ '\\n\\n' ~ m.content,"
    " 'tool_calls': last.tool_calls, 'thinking': last.thinking, 'tool_name': last.tool_name}] -%}"
    "{%- else -%}"
    "{%- set ns.msgs = ns.msgs + [{'role': m.role, 'content': m.content, 'tool_calls': m.tool_calls,"
    " 'thinking': m.thinking or m.reasoning_content, 'tool_name': m.name}] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set Think = enable_thinking is defined and enable_thinking -%}"
    "{%- set IsThinkSet = enable_thinking is defined -%}"
    "{%- set Tools = tools or [] -%}"
)


def go_template(text: str, line: int | None = None) -> str:
    """A Jinja template that renders as Ollama renders this Go template.

    A template that reads .Messages gets the whole (collated) conversation at once; an older one
    (.System, .Prompt, .Response) is rendered once per turn, and for the last turn only up to
    .Response, as Ollama's template.Execute does. Refused, naming the line, where it uses
    something else (with, define, pipes, functions but eq/ne/lt/le/gt/ge/and/or/not/len/slice/index/json).
    """
    full, fields = _translate_body(text, line, cut_at_response=False)
    if "Messages" in fields:
        return _PRELUDE + "{%- set System = ns.system|join('\\n\\n') -%}{%- set Messages = ns.msgs -%}" \
            "{%- set Response = '' -%}{%- set Prompt = '' +%}" + full + "{{ '' }}"  # Jinja drops a final newline
    last, _ = _translate_body(text, line, cut_at_response=True)
    return (
        "{%- macro turn(System, Prompt, Response, Think, IsThinkSet, Tools) %}{%- set gv = namespace() +%}" + full + "{% endmacro -%}"
        "{%- macro last_turn(System, Prompt, Response, Think, IsThinkSet, Tools) %}{%- set gv = namespace() +%}" + last + "{% endmacro -%}"
        + _PRELUDE +
        "{%- set t = namespace(system='', prompt='', response='') -%}"
        "{%- for m in ns.msgs -%}"
        "{%- if m.role == 'system' -%}"
        "{%- if t.prompt or t.response %}{{ turn(t.system, t.prompt, t.response, Think, IsThinkSet, Tools) }}"
        "{%- set t.system = '' %}{% set t.prompt = '' %}{% set t.response = '' %}{% endif -%}"
        "{%- set t.system = m.content -%}"
        "{%- elif m.role == 'user' -%}"
        "{%- if t.response %}{{ turn(t.system, t.prompt, t.response, Think, IsThinkSet, Tools) }}"
        "{%- set t.system = '' %}{% set t.prompt = '' %}{% set t.response = '' %}{% endif -%}"
        "{%- set t.prompt = m.content -%}"
        "{%- elif m.role == 'assistant' -%}{%- set t.response = m.content -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{{ last_turn(t.system, t.prompt, t.response, Think, IsThinkSet, Tools) }}"
    )
