"""The one facade that the CLI, the TUI and the server call.

Everything here returns typed values (frozen dataclasses, and the batch's JSONL records) and
raises LocalrunError subclasses; engines run in worker processes so that their crashes become errors.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localrun.backends import selection
from localrun.backends.base import Cancel, Ranked, Session, abilities
from localrun.errors import (
    BadModelFileError,
    ConversionError,
    LocalrunError,
    ModelNotFoundError,
    UsageError,
)
from localrun.generation import Chunk, Request
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import ModelInfo, Store
from localrun.system import disk_full

if TYPE_CHECKING:
    import asyncio

    import convert
    from localrun.adapters import Target
    from localrun.batch import BatchRow, Record
    from localrun.batch import Progress as BatchProgress
    from localrun.cluster import Summary
    from localrun.constraint import Constraint
    from localrun.doctor import Report
    from localrun.download import Progress as DownloadProgress
    from localrun.fit import ContextChoice, FitEstimate
    from localrun.hub import PullResult, RepoListing, RepoSummary
    from localrun.imports import ImportResult
    from localrun.pool import Pool
    from localrun.presets import Preset
    from localrun.reasoning import ReasoningFormat
    from localrun.tool_loop import Ask, Reply, ToolLoop, ToolUse
    from localrun.tool_servers import ServerTool, ToolServers
    from localrun.tools import ToolPlan


def store() -> Store:
    """The model store under LOCALRUN_HOME (or the user data directory)."""
    return Store()


def list_models() -> list[ModelInfo]:
    """Every installed model with its metadata.

    Returns:
        ModelInfo for each model, registered ones first, then discovered ones (starter model,
        Hugging Face cache).
    """
    return store().list()


def get_model(name_or_path: str) -> ModelInfo:
    """Resolve a model name or a path.

    Raises:
        ModelNotFoundError: no such model; the message suggests near matches.
        BadModelFileError: the file is missing, truncated or malformed.
    """
    return store().get(name_or_path)


def add_model(path: str | os.PathLike[str], name: str | None = None, replace: bool = False,
              converted_from: str | os.PathLike[str] | None = None,
              mmproj: str | os.PathLike[str] | None = None) -> ModelInfo:
    """Register an existing model file or folder in place (no copy).

    Args:
        path: a .gguf file, or an MLX / Hugging Face model folder.
        name: the short name (`family:tag`); derived from the file name when omitted.
        replace: allow replacing an existing registration of the same name.
        converted_from: the checkpoint folder it was converted from (adapters of that
            checkpoint then find it as their base).
        mmproj: a vision model's projector (an mmproj GGUF), kept with the model.

    Raises:
        BadModelFileError: the file is not a valid model, or mmproj is not a projector.
        UsageError: the name is invalid or taken.
    """
    extra: dict[str, Any] = {"converted_from": os.path.abspath(converted_from)} if converted_from else {}
    if mmproj is not None:
        extra["mmproj"] = check_projector(mmproj)
    return store().add(path, name=name, replace=replace, extra=extra or None)


def check_projector(path: str | os.PathLike[str]) -> str:
    """The absolute path of a vision projector file, checked to be one (a GGUF of architecture clip)."""
    from localrun.gguf_header import read_gguf

    p = Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"projector '{path}': no such file", "give the path of an mmproj GGUF file")
    meta = read_gguf(p, whole_model=False)  # a projector has tensors and metadata, no vocabulary
    if meta.architecture != "clip" or not meta.metadata.get("clip.has_vision_encoder", True):
        raise BadModelFileError(f"'{p.name}' is not a vision projector (its architecture is {meta.architecture})",
                                "a projector is the mmproj-*.gguf file published beside a vision model")
    return str(p.resolve())


def import_models(source: str, path: str | os.PathLike[str] | None = None, dry_run: bool = False) -> ImportResult:
    """Register every model another tool downloaded, in place (nothing is copied).

    Args:
        source: "ollama" (its manifests and blobs: each model with its template, system prompt,
            parameters, messages, licence and adapters as a preset NAME FROM `ollama/NAME`),
            "lmstudio" (its models folder) or "hf" (GGUF files in the Hugging Face cache).
        path: the folder to read (default: where that tool keeps its models).
        dry_run: report what would be registered and write nothing.

    Returns:
        imports.ImportResult: what was registered (name, file, the tool's name, notes), what was
        skipped and why, and names imported earlier whose files are gone.

    Raises:
        UsageError: an unknown source, or no such folder.
    """
    from localrun.imports import import_models as run_import

    return run_import(source, path, dry_run=dry_run, store=store())


def resolve_target(name: str, lora: Sequence[str] = ()) -> Target:
    """The base model and LoRA adapters to run for a model name and --lora values.

    Args:
        name: a model; an adapter (its base runs with it applied); or `base+adapter[:scale]+...`.
        lora: more adapters, each `NAME[:SCALE]` (a store name, a GGUF adapter, or a PEFT folder).

    Returns:
        adapters.Target: .model (load it), .adapters, .load_options(options, engine) and
        .params(params, engine) put the adapters where that engine applies them.

    Raises:
        ModelNotFoundError, UsageError (not an adapter, an adapter for another architecture).
    """
    from localrun import adapters

    return adapters.resolve(store(), name, lora)


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    """Whether path is a PEFT adapter folder (adapter_config.json)."""
    return Path(path, "adapter_config.json").is_file()


def convert_adapter(adapter_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
                    base: str | None = None, outtype: str = "auto", name: str | None = None, force: bool = False,
                    dry_run: bool = False, register: bool = True) -> tuple[convert.AdapterResult, ModelInfo | None]:
    """Convert a PEFT LoRA folder to a GGUF adapter and register it linked to its base model.

    Args:
        adapter_dir: the folder with adapter_config.json and adapter_model.safetensors.
        out: the output .gguf (default: inside the adapter folder).
        base: the base model (a store name, a GGUF file or a Hugging Face folder); default: the
            adapter's base_model_name_or_path, looked up in the store, on disk and in the HF cache.
        outtype: auto (the adapter's own precision), f32, f16 or bf16.
        name: the store name (default: `<folder>:lora`).

    Returns:
        (convert.AdapterResult, the registered ModelInfo or None when not registered).

    Raises:
        ConversionError (unsupported adapter, shape mismatch), ModelNotFoundError (no base), UsageError.
    """
    from localrun import adapters

    result, info, _ = adapters.convert_and_register(store(), adapter_dir, out, base=base, outtype=outtype, name=name,
                                                    force=force, dry_run=dry_run, register=register)
    return result, info


def remove_model(name: str) -> ModelInfo:
    """Remove a model from the store; files it owns are deleted, files added in place are kept.

    Raises:
        ModelNotFoundError: no such model.
    """
    return store().remove(name)


def create_preset(name: str, modelfile: str | None = None, *, preset: Preset | None = None,
                  base_dir: str | os.PathLike[str] | None = None,
                  progress: Callable[[convert.Progress], None] | None = None) -> ModelInfo:
    """Create (or replace) a preset from a Modelfile's text or a Preset: a store entry that points at
    its base, with its own parameters, system prompt, template, adapters and starting conversation.

    Args:
        modelfile: Ollama's Modelfile format (FROM, PARAMETER, SYSTEM, TEMPLATE, ADAPTER, MESSAGE, LICENSE).
        preset: the settings already read (Ollama's /api/create fields).
        base_dir: the folder relative paths in the Modelfile are read from (default: the current one).
        progress: conversion progress, when FROM names a Hugging Face checkpoint folder (converted to
            GGUF and registered once; a later create from the same folder reuses it).

    Raises:
        UsageError: a Modelfile error naming its line; a name held by a model; a FROM chain that loops.
        ModelNotFoundError: FROM names no installed model. ConversionError: FROM's folder fails to convert.
    """
    from localrun.presets import read_modelfile

    root = Path(base_dir or os.getcwd())
    if preset is None:
        if modelfile is None:
            raise UsageError("a preset needs a Modelfile or its settings")

        def resolve(path: str) -> str:
            return os.path.abspath(root / Path(path).expanduser())

        preset = read_modelfile(modelfile, resolve)
    st = store()
    base = Path(preset.base).expanduser()
    if base.is_dir() and (base / "config.json").is_file() and not is_adapter_dir(base):
        done = st.converted_from(base)
        model = st.get(done[0]) if done else convert_model(base, progress=progress)
        preset = dataclasses.replace(preset, base=model.name)
    for adapter in preset.adapters:
        if not is_adapter_dir(adapter):
            st.get(adapter)  # a missing adapter is an error now, not at run time
    if preset.draft_model:
        draft_file(preset.draft_model)  # so is a missing draft model
    return st.add_preset(name, preset)


def draft_file(name: str) -> str:
    """The file (GGUF, for llama.cpp) or folder (MLX) of a draft model for speculative decoding
    (`--draft MODEL`); the engine checks at load that it can draft for the model it runs.

    Raises:
        ModelNotFoundError: no such model.
    """
    try:
        return get_model(name).path
    except (ModelNotFoundError, BadModelFileError) as e:
        raise type(e)(f"draft model: {e.message}", e.hint) from None


def modelfile(name: str) -> str:
    """A Modelfile that `create` turns back into this model: a preset's own settings, or FROM the model."""
    from localrun.presets import Preset

    info = get_model(name)
    if info.is_preset:
        return Preset.from_dict(info.details["preset"]).modelfile(f"Modelfile of {info.name}, written by localrun")
    return Preset(info.name).modelfile(f"Modelfile of {info.name}, written by localrun")


def copy_model(source: str, destination: str) -> ModelInfo:
    """Another name for a model (the same file, nothing copied) or a preset (the same settings)."""
    return store().copy(source, destination)


def choose_engine(model: ModelInfo, engine: str | None = None) -> str:
    """The engine that will run a model: the forced one if it can, else the first available.

    Raises:
        BackendUnavailableError: the forced engine cannot run this format or is not installed, or
            no installed engine can run it; the hint says how to make a copy another engine runs,
            or how to install one.
    """
    return selection.choose_engine(model, engine)


@contextmanager
def engine_started_early(model: str, engine: str | None = None) -> Iterator[None]:
    """Start an engine process now, for the first load() in the block (one not used is closed at
    its end): a one-shot command's engine then starts (the interpreter and the engine's own
    libraries, about 0.15 s) while the command finds its model and reads its input, not after.
    `model` and `engine` are the command's own arguments; they only guess which engine to warm."""
    from localrun.backends.selection import likely_engine
    from localrun.backends.session import early_worker

    def guess() -> str | None:
        try:
            return likely_engine(store().format_of(model), engine)
        except LocalrunError:
            return None

    with early_worker(guess):
        yield


def load(model: str | ModelInfo, options: LoadOptions | None = None, engine: str | None = None,
         event_loop: asyncio.AbstractEventLoop | None = None) -> Session:
    """Load a model into an isolated engine process running its engine loop.

    Args:
        model: a name, a path or a ModelInfo.
        options: context size per sequence, parallel sequences, threads, GPU layers.
        engine: force an engine (a name from backends.base.backend_names()).
        event_loop: an asyncio loop to read the engine's messages on (a server), instead of a thread.

    Returns:
        A Session (stream, generate_many, tokenize, embed, info, close); safe to share between
        threads, whose requests then run as parallel sequences.

    Raises:
        ModelNotFoundError, BadModelFileError, BackendUnavailableError, EngineError.
    """
    from localrun.backends.session import WorkerSession

    info = model if isinstance(model, ModelInfo) else get_model(model)
    return WorkerSession(choose_engine(info, engine), info, options or LoadOptions(), event_loop)


def model_pool(options: LoadOptions | None = None, engine: str | None = None, *, max_loaded: int = 0,
               keep_alive: float = 300.0, on_load: Callable[[ModelInfo, Session], None] | None = None) -> Pool:
    """A pool of loaded models for a front end that serves many requests (the TUI, the server).

    Args:
        options: how each model is loaded (n_parallel sequences, max_queue waiting requests, ...).
        engine: force an engine (a name from backends.base.backend_names()).
        max_loaded: models loaded at once at most (0: as many as the memory holds); loading
            another unloads the ones idle longest, or waits for those in use.
        keep_alive: default seconds a model stays loaded after its last use (negative: forever).
        on_load: called with (model, session) after each load that succeeds (what the engine says
            of the model is in session.info(), e.g. its "warning").

    Returns:
        localrun.pool.Pool: use(model, keep_alive) yields a Session; loaded(), unload(), close().
    """
    from localrun.pool import Pool

    return Pool(load, get_model, options, engine, max_loaded=max_loaded, keep_alive=keep_alive, on_load=on_load)


@contextmanager
def use_target(pool: Pool, target: Target, keep_alive: float | None = None,
               options: LoadOptions | None = None) -> Iterator[tuple[Session, str]]:
    """A pooled session for a model with adapters, and its engine (settings.resolve gives a request
    the adapters' files where the engine applies them per request).

    An engine with per-request adapters (llama.cpp) keeps one base model loaded and applies each
    request's adapters; one that applies them when it loads (MLX) loads a model with adapters
    apart from the bare base. `options`: a client's load options over the pool's (n_ctx: the
    least context it needs; kv_type), as Pool.use takes them.
    """
    engine = choose_engine(target.model, pool.engine)
    base = options or pool.options
    if not abilities(engine).request_adapters and target.adapters:
        info = dataclasses.replace(target.model, name=target.name)
        with pool.use(info, keep_alive, options=target.load_options(base, engine)) as session:
            yield session, engine
    else:
        options = target.load_options(base, engine)
        with pool.use(target.model, keep_alive, options=None if options == pool.options else options) as session:
            yield session, engine


def stream(
    session: Session, request: Request, params: GenerationParams | None = None, cancel: Cancel | None = None
) -> Generator[Chunk, None, None]:
    """Stream one reply from a loaded session: text chunks, then a final chunk with statistics.

    Raises:
        ContextOverflowError: the prompt does not fit.
        EngineCrashedError: the engine process died; the caller keeps running.
    """
    return session.stream(request, params or GenerationParams(), cancel)


def resolve_settings(given: Mapping[str, Any] | None = None, target: Target | None = None,
                     engine: str | None = None, *, defaults: Mapping[str, Any] | None = None,
                     constraint: Constraint | None = None, tools: ToolPlan | None = None) -> GenerationParams:
    """A request's settings, decided once: what it gives over its preset's, its model's and the defaults.

    Args:
        given: the settings the request sets, by settings.py's names (settings.read turns any
            front's names into them).
        target: the model (with its preset and adapters), from resolve_target.
        engine: the engine that runs it (from use_target or choose_engine).
        defaults: settings under all the others (a server's, an app's).
        constraint: the reply's structured output (from constraint()).
        tools: the request's ToolPlan.

    Raises:
        UsageError: a value out of range, or a response format together with tools.
    """
    from localrun import settings

    return settings.resolve(given, target, engine, defaults=defaults, constraint=constraint, tools=tools)


def mcp_servers(config: str | os.PathLike[str] | None = None) -> ToolServers:
    """The MCP servers an mcp.json names (default: localrun's own, possibly none), not started:
    they start on first use (`tools()`) and stop with `close()`.

    Raises:
        UsageError: the file is missing (when given), not JSON, or names a server wrongly.
    """
    from localrun.tool_servers import ToolServers, read_config

    return ToolServers(read_config(config))


def tool_loop(servers: ToolServers, allowed: Sequence[str] = (), ask: Ask | None = None, *,
              keep: Callable[[ServerTool], bool] | None = None, max_steps: int = 8,
              on_use: Callable[[ToolUse], None] | None = None,
              on_call: Callable[[ServerTool, dict[str, Any]], None] | None = None) -> ToolLoop:
    """A loop that runs a model's calls of the servers' tools (starting the servers): each call
    checked against its input schema, run only when `allowed` names it (a tool, SERVER/NAME, a
    server, or "all") or `ask` says so, its result fed back; `servers.failures` names the servers
    that did not start. `keep`: which tools the model is offered (default all; a call of another
    is an unknown tool, never run); `on_call` before a call runs, `on_use` after each."""
    from localrun.tool_loop import Approvals, ToolLoop

    tools = [t for t in servers.tools() if keep is None or keep(t)]
    return ToolLoop(servers, Approvals(allowed, ask), tools, max_steps=max_steps, on_use=on_use, on_call=on_call)


def tool_choice(value: str | None) -> Any:
    """A tool choice as a user names it (auto, required, none, or a tool's name) in the APIs' shape."""
    if value is None or value in ("auto", "required", "none"):
        return value
    return {"type": "function", "function": {"name": value}}


def tool_reply(plan: ToolPlan, text: str, final: Chunk | None = None, thinking: str = "",
               stopped: bool = False) -> Reply:
    """One step's reply, as a front end's generate() gives it back to a tool loop: the text the
    step generated read by its plan (`tool_step`) into the text without the calls and the calls
    (none under "none", nor in a reply that was stopped), with its last chunk and its thought."""
    from localrun.tool_loop import Reply

    return Reply.of(plan, text, final, thinking, stopped)


def tool_step(target: Target, engine: str, messages: list[dict[str, Any]], functions: list[dict[str, Any]],
              choice: Any = "auto", given: Mapping[str, Any] | None = None, *, think: bool | str | None = None,
              defaults: Mapping[str, Any] | None = None, constraint: Constraint | None = None
              ) -> tuple[Request, GenerationParams, ToolPlan]:
    """One step of a chat with tools: the request (messages in the chat API's shape, with calls and
    results) and its settings, the tools held to this step's choice, and the plan that reads the
    reply (`tool_reply`)."""
    from localrun.chat import parse_messages
    from localrun.tools import ToolPlan

    plan = ToolPlan.make(chat_template(target.model), functions, choice)
    if plan is None:
        raise UsageError("a tool step needs tools")
    request = dataclasses.replace(plan.request(parse_messages(messages)), think=think)
    params = resolve_settings(given, target, engine, defaults=defaults, constraint=constraint, tools=plan)
    return target.request(request), params, plan


def setting_value(name: str, text: str, label: str | None = None) -> Any:
    """One generation setting's value from text (a form's field), typed and checked by settings.py.

    Raises:
        UsageError: the text is not a valid value; the message names `label`.
    """
    from localrun import settings

    return settings.GENERATION[name].parse(text, label or name, "cli")


def constraint(spec: dict[str, object], where: str = "constraint") -> Constraint:
    """A structured-output constraint from {"format": "json"} / {"schema"} / {"grammar"} / {"choice"}.

    Raises UsageError naming what is wrong (an unsupported schema keyword, a broken grammar)."""
    from localrun.constraint import Constraint

    return Constraint.from_spec(spec, where)


def chat_template(model: ModelInfo) -> str | None:
    """The model's own chat template (GGUF metadata, or an MLX folder's tokenizer files), if any."""
    if model.format == "gguf":
        tpl = (model.details or {}).get("chat_template")
        return tpl if isinstance(tpl, str) and tpl.strip() else None
    folder = Path(model.path)
    jinja = folder / "chat_template.jinja"
    try:
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: the default one
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    return tpl if isinstance(tpl, str) and tpl.strip() else None


def reasoning_format(model: ModelInfo) -> ReasoningFormat | None:
    """How the model writes its thought apart from its answer (None: it cannot think), read from its
    chat template and vocabulary as the engines read them."""
    from localrun.capabilities import reasoning_format as read

    return read(model)


def capabilities(model: ModelInfo, engine: str | None = None) -> tuple[str, ...]:
    """What the model can do through localrun on the engine that would run it (Ollama's words:
    completion, tools, embedding, ...); without an installed engine, what needs none."""
    from localrun.capabilities import capabilities as derive
    from localrun.errors import BackendUnavailableError

    try:
        name = choose_engine(model, engine)
    except BackendUnavailableError:
        return derive(model, None)
    return derive(model, abilities(name))


def default_context(model: ModelInfo, options: LoadOptions | None = None) -> ContextChoice:
    """The context per sequence the model loads with under these options, and why: --ctx if
    set, else the trained context when memory holds it for options.n_parallel sequences."""
    from localrun.fit import context_for

    return context_for(model, options or LoadOptions())


def build_messages(prompt: str, system: str | None = None, history: list[dict[str, Any]] | None = None,
                   images: Sequence[bytes] = ()) -> Request:
    """A chat request from an optional system prompt, earlier turns and the new user prompt (with
    its images: image files' bytes, see localrun.images.read_file)."""
    if not prompt and not history and not images:
        raise UsageError("the prompt is empty", "pass a prompt, or '-' to read it from stdin")
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.extend(history or [])
    messages.append({"role": "user", "content": prompt, **({"images": list(images)} if images else {})})
    return Request.chat(messages)


def convert_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    outtype: str = "auto",
    imatrix: str | os.PathLike[str] | None = None,
    force: bool = False,
    dry_run: bool = False,
    progress: Callable[[convert.Progress], None] | None = None,
    lora: Sequence[tuple[str, float]] = (),
    before_write: Callable[[convert.Result], None] | None = None,
    mmproj_outtype: str = "auto",
) -> convert.Result:
    """Convert a Hugging Face checkpoint folder to GGUF without registering it.

    Args:
        src: folder with config.json, weights (safetensors or pytorch_model*.bin) and tokenizer files.
        out: output .gguf path (default: inside SRC, named after the folder and type).
        outtype: auto, f32, f16, bf16, q8_0 or any llama.cpp quantization type (q4_k_m, ...).
        imatrix: importance matrix file for llama.cpp quantization types.
        force: overwrite an existing output file.
        dry_run: only plan (the plan is in the result); nothing is written.
        progress: called after each tensor with a convert.Progress event.
        lora: PEFT LoRA folders and scales merged into the weights before conversion.
        before_write: called with the planned convert.Result before anything is written.
        mmproj_outtype: a vision-language checkpoint's projector type (auto: F16 when quantized).

    Returns:
        convert.Result: the output path, the plan and the time taken (.mmproj: the projector's).

    Raises:
        ConversionError: unsupported architecture, unreadable checkpoint, not enough disk space.
    """
    import convert

    planned: list[convert.Result] = []

    def checked(result: convert.Result) -> None:
        planned.append(result)
        if before_write is not None:
            before_write(result)

    try:
        return convert.convert(src, out, outtype=outtype, imatrix=imatrix, force=force, dry_run=dry_run,
                               progress=progress, lora=list(lora) or None, before_write=checked,
                               mmproj_outtype=mmproj_outtype)
    except convert.ConvertError as e:
        raise ConversionError(e.message, e.hint) from e
    except OSError as e:
        target = planned[0].path if planned else Path(out if out is not None else src)
        if (full := disk_full(e, target.parent)) is None:
            raise
        disk, state = full
        raise ConversionError(
            f"cannot write the converted model to '{target}': the disk at {disk} is {state};"
            " the partial file was removed and nothing was registered",
            f"free some space on {disk}, or write the model to another disk",
        ) from e


def convert_model(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    outtype: str = "auto",
    imatrix: str | os.PathLike[str] | None = None,
    name: str | None = None,
    force: bool = False,
    progress: Callable[[convert.Progress], None] | None = None,
) -> ModelInfo:
    """Convert a checkpoint folder to GGUF (see convert_checkpoint) and register the result.

    Args:
        name: short name in the store (default: see conversion_name); the other arguments are
            convert_checkpoint's.

    Returns:
        The registered model.

    Raises:
        ConversionError: the conversion failed.
        UsageError: the name asked for is taken (and force is not set); raised before any work.
    """
    chosen: list[str] = []

    def choose(planned: convert.Result) -> None:
        chosen.append(conversion_name(planned.path, src, planned.plan.outtype, name=name, replace=force))

    result = convert_checkpoint(src, out, outtype=outtype, imatrix=imatrix, force=force, progress=progress,
                                before_write=choose)
    return add_model(result.path, name=chosen[0], replace=force and name is not None, converted_from=src,
                     mmproj=result.mmproj.path if result.mmproj else None)


def conversion_name(out: str | os.PathLike[str], src: str | os.PathLike[str], outtype: str,
                    name: str | None = None, replace: bool = False) -> str:
    """The store name for a conversion's output, chosen and checked before the conversion runs.

    Args:
        out: the output file.
        src: the checkpoint folder (a Hugging Face cache snapshot is named after its repository).
        outtype: the planned output type (the plan's, e.g. f16 for auto on an F16 checkpoint).
        name: the name asked for (--name); it must be free unless replace is set.
        replace: a name asked for may replace another model's registration.

    Returns:
        name itself; else the name of the output file (`model-f32.gguf` -> `model:f32`), or, where
        another model holds that, the checkpoint's (`smollm2-135m-instruct:f32`), with -2, -3, ...
        until it is free.

    Raises:
        UsageError: the name asked for is invalid, or held by another model and replace is not set.
    """
    from localrun.store import name_from_filename, normalize_name

    st = store()
    if name is not None:
        wanted = normalize_name(name)
        if not replace and _held_by_other(st, wanted, out):
            raise UsageError(f"a model named '{wanted}' is already installed",
                             "choose another name with --name, or remove it first with 'localrun rm'")
        return wanted
    candidate = name_from_filename(out)
    if not _held_by_other(st, candidate, out):
        return candidate
    family, _, tag = name_from_filename(f"{_checkpoint_name(src)}-{outtype}.gguf").partition(":")
    for i in range(1, 1000):
        candidate = f"{family}{'' if i == 1 else f'-{i}'}:{tag}"
        if not _held_by_other(st, candidate, out):
            return candidate
    raise UsageError(f"every name like '{family}:{tag}' is taken", "choose a name with --name")


def _checkpoint_name(src: str | os.PathLike[str]) -> str:
    """A checkpoint folder's model name: its own, or its repository's for a Hugging Face snapshot."""
    folder = Path(os.path.abspath(src))
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.split("--", 2)[-1]  # models--ORG--NAME (NAME may hold "--")
    return folder.name


def _held_by_other(st: Store, name: str, path: str | os.PathLike[str]) -> bool:
    """Whether the store has a model of this name at another path than `path`."""
    from localrun.errors import LocalrunError

    if name not in st.names():
        return False
    try:
        held = st.get(name).path
    except LocalrunError:  # registered, but its file is gone or broken: still taken
        return True
    return os.path.realpath(held) != os.path.realpath(path)


def doctor() -> Report:
    """Versions, each engine's build and abilities, GPUs, memory.

    Returns:
        doctor.Report (to_dict() is `localrun doctor --json`); an engine that fails its probe is
        reported unavailable with the reason, never raised.
    """
    from localrun import doctor as checkup

    return checkup.report()


# -- Hub


def search_models(query: str, format: str | None = None, sort: str = "downloads",
                  limit: int = 20) -> list[RepoSummary]:
    """Search Hugging Face Hub repositories.

    Args:
        query: words in the repository name ("" for all).
        format: only "gguf", "mlx" or "safetensors" repositories.
        sort: "downloads", "likes" or "updated".
        limit: at most this many results.

    Returns:
        localrun.hub.RepoSummary for each repository (id, downloads, likes, last_modified, formats).

    Raises:
        UsageError: an unknown format or sort.
        HubError: the Hub cannot be reached, or HF_HUB_OFFLINE is set.
    """
    from localrun import hub

    return hub.search(query, format, sort, limit)


def list_repo_files(repo: str, revision: str | None = None) -> RepoListing:
    """A repository's files with sizes, sha256 and, for GGUF files, their quantization.

    Args:
        repo: `ORG/NAME` (a `:QUANT` suffix is ignored).
        revision: a branch, tag or commit (default main).

    Returns:
        localrun.hub.RepoListing: commit, files, and the files a plain pull would fetch.

    Raises:
        HubError: unknown or inaccessible repository, Hub unreachable, or offline without a cached copy.
    """
    from localrun import hub

    return hub.listing(repo, revision)


def estimate_fit(spec: str, revision: str | None = None, context: int | None = None,
                 cpu_moe: int | str = 0) -> FitEstimate:
    """Estimate the memory a Hub model needs before downloading it (GGUF header read remotely).

    Args:
        spec: `ORG/NAME[:QUANT|:FILE]`.
        revision: a branch, tag or commit.
        context: context size in tokens (default: the engines' default for this model).
        cpu_moe: a mixture-of-experts model's layers whose expert weights stay in host memory
            (--cpu-moe N, or "all"): they count toward RAM, not the GPU.

    Returns:
        localrun.fit.FitEstimate: weights, KV cache, buffers, and verdict "gpu", "ram" or "none".

    Raises:
        HubError: the repository, quantization or file cannot be found or accessed.
        BadModelFileError: the remote GGUF header is malformed.
    """
    from localrun import hub

    return hub.estimate_fit(hub.plan(spec, revision), context, cpu_moe)


def pull(
    spec: str,
    revision: str | None = None,
    name: str | None = None,
    progress: Callable[[DownloadProgress], None] | None = None,
    cancel: Cancel | None = None,
    notice: Callable[[str], None] | None = None,
    context: int | None = None,
) -> PullResult:
    """Download a model into the Hugging Face cache (resuming, verifying sha256) and install it.

    Args:
        spec: `ORG/NAME[:QUANT|:FILE]`; GGUF repositories default to Q4_K_M, else the closest >= 4-bit.
        revision: a branch, tag or commit (default main).
        name: the store name (default `family:quant` from the repository and quantization).
        progress: called with localrun.download.Progress events (file, bytes done/total, speed, ETA).
        cancel: checked between chunks; when set the pull stops, keeping the partial file for resume.
        notice: called with warning text (will not fit, Hub unreachable and the cache used instead).
        context: context size for the fit warning.

    Returns:
        localrun.hub.PullResult: the installed ModelInfo, the plan, bytes downloaded, already_installed.

    Raises:
        HubError: not found, gated (401/403), disk full, corrupted download, network failure after retries.
        CancelledError: cancel was set.
        UsageError: a malformed spec or a name taken by another model.
    """
    from localrun import hub

    return hub.pull(spec, revision, name, progress=progress, cancel=cancel, notice=notice, context=context)


# -- Batch


def batch(
    session: Session,
    rows: Sequence[BatchRow | dict[str, object]],
    params: GenerationParams | None = None,
    system: str | None = None,
    cancel: Cancel | None = None,
    progress: Callable[[BatchProgress], None] | None = None,
) -> Generator[Record, None, None]:
    """Generate many rows concurrently in one loaded session, yielding each result as it finishes.

    Args:
        session: from load(); load with LoadOptions(n_parallel=N) to run N rows at once.
        rows: localrun.batch.BatchRow values, or dicts as in a batch JSONL file
            ({"id", "prompt" | "messages", generation settings...}).
        params: settings for the rows that do not set their own.
        system: the system prompt of dict rows that have none.
        cancel: when set the engine stops; rows finished before were already yielded.
        progress: called with localrun.batch.Progress (rows done, tokens, tokens/s).

    Returns:
        batch.Record values {"id", "text", "finish_reason", "prompt_tokens", "completion_tokens"}, or
        {"id", "error"} for a row that cannot run (bad settings, prompt longer than the context),
        in the order rows finish.

    Raises:
        EngineCrashedError: the engine process died; records yielded so far are valid.
        EngineError: the engine failed.
    """
    from localrun import batch as batching

    params = params or GenerationParams()
    settle = batching.settle_over(params)
    parsed = [r if isinstance(r, batching.BatchRow) else batching.parse_row(dict(r), i, settle, system)
              for i, r in enumerate(rows, 1)]
    return batching.run_rows(session, parsed, params, cancel, progress)


def require_ray() -> None:
    """Check that Ray can be imported, before any work of `batch --ray`.

    Raises:
        UsageError: Ray is not installed (the hint says how to install it).
    """
    from localrun import cluster

    cluster.require_ray()


def cluster_summary() -> Summary:
    """An empty localrun.cluster.Summary for batch_on_cluster to fill (per-actor rows and speed)."""
    from localrun.cluster import Summary

    return Summary()


def batch_on_cluster(model: ModelInfo, rows: list[BatchRow], params: GenerationParams, options: LoadOptions,
                     engine: str | None = None, *, address: str | None = None, actors: int | None = None,
                     cpus_per_actor: float | None = None, gpus_per_actor: float = 0.0, retries: int = 2,
                     model_path: str | None = None, cancel: Cancel | None = None,
                     progress: Callable[[BatchProgress], None] | None = None,
                     notice: Callable[[str], None] | None = None,
                     summary: Summary | None = None) -> Generator[Record, None, None]:
    """Run batch rows on a Ray cluster: a pool of actors, each with the model loaded.

    Args:
        model, rows, params, options, engine: as for a local batch (rows from batch.read_input).
        address: "auto", HOST:PORT or ray://...; None starts a local cluster.
        actors, cpus_per_actor, gpus_per_actor: the actor pool (default: one per GPU or per node).
        retries: attempts beyond the first for a block whose actor died.
        model_path: the model at this path on every node, instead of each node's own copy.
        summary: a cluster_summary() that gets each actor's rows, tokens and speed.

    Yields:
        One record per row as it finishes ({"id", "text", ...} or {"id", "error"}), each id once.

    Raises:
        UsageError: Ray is not installed. BackendUnavailableError: no cluster at that address.
    """
    from localrun import cluster

    opts = cluster.RayOptions(address=address, actors=actors, gpus_per_actor=gpus_per_actor,
                              cpus_per_actor=cpus_per_actor, model_path=model_path, retries=retries)
    return cluster.run(model, rows, params, options, engine, opts, cancel=cancel, progress=progress, notice=notice,
                       summary=summary)


# -- the workbench: bench, eval, imatrix, the quantization ladder (localrun/workbench/) ---------------
if TYPE_CHECKING:
    from localrun.workbench.bench import BenchChoices, BenchRecord, BenchSpec
    from localrun.workbench.bench import Progress as BenchProgress
    from localrun.workbench.imatrix import ImatrixSummary
    from localrun.workbench.imatrix import ProgressCallback as ImatrixProgress
    from localrun.workbench.ladder import Ladder
    from localrun.workbench.ladder import Progress as LadderProgress
    from localrun.workbench.perplexity import EvalResult
    from localrun.workbench.perplexity import Progress as EvalProgress


def _gguf_model(name_or_path: str, command: str) -> ModelInfo:
    """The installed GGUF model (or file) that a workbench command measures."""
    model = get_model(name_or_path)
    if model.format != "gguf":
        raise UsageError(f"model '{model.name}' is {model.format}; {command} runs GGUF models on llama.cpp",
                         f"pick a GGUF model (see 'localrun list'), or convert it with 'localrun convert {model.path}'")
    return model


def bench_choices() -> BenchChoices:
    """The values llama-bench accepts for the KV cache types and load modes."""
    from localrun.workbench.bench import BenchChoices

    return BenchChoices()


def bench_spec(models: Sequence[str], **settings: Any) -> BenchSpec:
    """The benchmark of these models (names or .gguf paths) with llama-bench's settings.

    Args:
        models: installed model names or GGUF paths.
        settings: BenchSpec's fields (n_prompt, n_gen, n_threads, ... as tuples; repetitions, warmup).

    Raises:
        ModelNotFoundError: a model is not installed. UsageError: a model is not GGUF, or a setting
        llama-bench would reject.
    """
    from localrun.workbench.bench import BenchSpec

    resolved = [_gguf_model(m, "bench") for m in models]
    return BenchSpec(models=tuple(m.path for m in resolved), names=tuple(m.name for m in resolved), **settings)


def benchmark(spec: BenchSpec, progress: BenchProgress | None = None) -> Iterator[BenchRecord]:
    """Measure every test of spec as llama-bench does, in a child process; yields each record as
    its test ends.

    Args:
        spec: from bench_spec.
        progress: called with a line on each step ("bench 2/4 (tg128, 'x', 2 threads): run 3/5").

    Raises:
        BadModelFileError: llama.cpp cannot load a model. EngineError: a context or decode failed.
        EngineCrashedError: llama.cpp crashed; the caller keeps running.
    """
    from localrun.workbench.bench import iter_bench_isolated

    return iter_bench_isolated(spec, progress)


def rerank(model: str, query: str, documents: Sequence[str], options: LoadOptions | None = None) -> Ranked:
    """A reranker's score of each document for the query, in the documents' order (the model's
    raw output, as llama-server reports it: higher is more relevant). Runs in a child process.

    Raises:
        UsageError: a model that is not a reranker (its GGUF declares no rank pooling), no documents.
        ModelNotFoundError, BadModelFileError, EngineError.
    """
    if not documents:
        raise UsageError("no documents to rank", "give at least one document")
    session = load(model, options or LoadOptions())
    try:
        return session.rerank(query, list(documents))
    finally:
        session.close()


def evaluate(model: str, text: str | os.PathLike[str], reference: str | None = None, *, n_ctx: int = 512,
             chunks: int | None = None, n_batch: int = 2048, threads: int | None = None, use_cache: bool = True,
             progress: EvalProgress | None = None, kv_type: str = "f16") -> EvalResult:
    """Perplexity of a model on a text as llama-perplexity scores it; with a reference (the same
    tokenizer), also the KL divergence and top-token agreement. Runs in a child process.

    Args:
        model, reference: installed model names or GGUF paths.
        text: the text file to score.
        n_ctx, chunks, n_batch, threads: llama-perplexity's -c, --chunks, -b, -t.
        use_cache: reuse the reference's logits from an earlier run.
        progress: called as chunks are scored.
        kv_type: the model's KV-cache type (f16, q8_0, q4_0); the reference's stays f16.

    Returns:
        EvalResult whose model (and divergence.reference) are the store names, with their files.

    Raises:
        UsageError: bad settings, a text too short, a model that is not GGUF.
        BadModelFileError: a file llama.cpp cannot load, or vocabularies that differ.
        EngineCrashedError: llama.cpp crashed; the caller keeps running.
    """
    from localrun.workbench.perplexity import EvalWorker

    with EvalWorker() as worker:  # it loads llama.cpp while the models are looked up
        m = _gguf_model(model, "eval")
        ref = _gguf_model(reference, "eval") if reference is not None else None
        result = worker.run(m.path, text, ref.path if ref else None, n_ctx=n_ctx, chunks=chunks, n_batch=n_batch,
                            threads=threads, use_cache=use_cache, progress=progress, kv_type=kv_type)
    d = result.divergence
    if d is not None and ref is not None:
        d = dataclasses.replace(d, reference=ref.name, reference_path=ref.path)
    return dataclasses.replace(result, model=m.name, model_path=m.path, divergence=d)


def compute_imatrix(model: str, calibration: str | os.PathLike[str] | None, out: str | os.PathLike[str], *,
                    n_ctx: int = 512, chunks: int | None = None, threads: int | None = None,
                    progress: ImatrixProgress | None = None,
                    dataset: str | None = None) -> ImatrixSummary:
    """Compute a model's importance matrix on calibration text (llama-imatrix's file), in a child process.

    Args:
        model: an installed model name or a GGUF path.
        calibration: a text file, or None for localrun's default set.
        out: the .gguf to write (under a temporary name, renamed when complete).
        n_ctx, chunks, threads: tokens per chunk, at most this many chunks, CPU threads.
        progress: called as chunks finish.
        dataset: the name recorded in the file (default: the calibration's description).

    Raises:
        UsageError: too little text, bad settings, a model that is not GGUF.
        BadModelFileError: llama.cpp cannot load the model. EngineCrashedError: llama.cpp crashed.
    """
    from localrun.workbench import imatrix

    m = _gguf_model(model, "imatrix")
    cal = Path(calibration) if calibration is not None else None
    return imatrix.compute_imatrix(m.path, cal, out, n_ctx=n_ctx, chunks=chunks, threads=threads,
                                   progress=progress, dataset=dataset)


def quantize_ladder(
    source: str | os.PathLike[str],
    types: list[str],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    imatrix: str | None = "auto",
    calibration: str | os.PathLike[str] | None = None,
    text: str | os.PathLike[str] | None = None,
    budget: float | None = None,
    name: str | None = None,
    n_ctx: int = 512,
    chunks: int | None = None,
    bench: tuple[int, int, int] = (512, 128, 3),
    threads: int | None = None,
    progress: LadderProgress | None = None,
) -> Ladder:
    """Quantize SOURCE to every type in `types`, measure each rung and register it.

    Args:
        source: a Hugging Face checkpoint folder (converted to F16 once) or a 16/32-bit GGUF.
        types: llama.cpp types, e.g. ["q8_0", "q6_k", "q4_k_m", "iq4_xs"].
        out_dir: where the rungs, the reference, the imatrix and the report go (default: beside
            the source, `<name>-ladder/`).
        imatrix: "auto" (computed once from `calibration`, or localrun's default set), a file, or None.
        text: the evaluation text (default: localrun's held-out set, see workbench.texts.default_text).
        budget: the mean KLD the recommended rung may lose (default ladder.DEFAULT_BUDGET).
        name: the store family of the rungs (`name:q4_k_m`; default from the source).
        bench: (prompt tokens, generated tokens, repetitions) of each rung's speed test.
        progress: called with a ladder Step at each step (str() of it is a line of text).

    Returns:
        The Ladder, whose report is written to out_dir as report.md and report.json.
    """
    from localrun.store import name_from_filename
    from localrun.workbench import ladder as lad

    src = Path(source).expanduser().resolve()
    if not src.exists():
        raise UsageError(f"{src} does not exist", "pass a Hugging Face checkpoint folder or an F16/BF16 GGUF")
    family = (name or name_from_filename(src).split(":")[0]).split(":")[0]
    out = Path(out_dir) if out_dir is not None else src.parent / f"{src.stem if src.is_file() else src.name}-ladder"
    out.mkdir(parents=True, exist_ok=True)
    text_path = lad.evaluation_text(out, text, progress)
    steps = lad.measuring_steps(
        convert=lambda s, ref: Path(convert_checkpoint(s, ref, outtype="f16").path),
        register=lambda rung, t: add_model(rung, name=f"{family}:{t}", replace=True).name,
        n_ctx=n_ctx, chunks=chunks, bench=bench, threads=threads)
    result = lad.run(src, [t.strip().lower() for t in types if t.strip()], out, text_path, steps, imatrix=imatrix,
                     calibration=Path(calibration) if calibration is not None else None,
                     budget=lad.DEFAULT_BUDGET if budget is None else budget, progress=progress)
    lad.write_report(result, out)
    return result


def ladder_report(ladder: Ladder) -> str:
    """A ladder's report as Markdown: the table of rungs and the recommendation."""
    from localrun.workbench.ladder import markdown

    return markdown(ladder)
