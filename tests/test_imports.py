"""`import localrun` must stay light: engines and UI load lazily."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("llama_cpp", "mlx", "mlx_lm", "torch", "transformers", "textual", "numpy", "gguf", "huggingface_hub",
         "fastapi", "uvicorn", "starlette")


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    return {name.split(".")[0] for name in out}


def test_import_localrun_loads_no_engine_or_ui() -> None:
    loaded = _loaded_after("import localrun, localrun.api, localrun.store, localrun.chat, localrun.generation")
    assert not loaded & set(HEAVY), f"heavy modules loaded: {sorted(loaded & set(HEAVY))}"


def test_cli_help_loads_no_engine() -> None:
    loaded = _loaded_after("from localrun.cli import build_parser\nbuild_parser().format_help()")
    assert not loaded & set(HEAVY), f"heavy modules loaded: {sorted(loaded & set(HEAVY))}"


def test_convert_does_not_import_localrun() -> None:
    loaded = _loaded_after("import convert")
    assert "localrun" not in loaded and "tui" not in loaded


def test_reading_a_models_header_loads_neither_gguf_nor_numpy() -> None:
    # `run` reads the model's header before its engine starts loading: gguf's package (numpy, its
    # reader and writer) would add 0.12 s there, and decoding the vocabulary's strings 0.2 s more
    # on a 152k-token model, so the header is read with gguf-py's constants alone and the
    # vocabulary is decoded when something asks for it.
    from localrun.store import starter_model_path

    starter = starter_model_path()
    assert starter is not None, "the starter model is not installed"
    loaded = _loaded_after(f"from localrun.gguf_header import read_gguf, quantization_name\n"
                           f"m = read_gguf({str(starter)!r})\nassert quantization_name(m)\n"
                           f"assert m.vocab_size == len(m.metadata['tokenizer.ggml.tokens']) == 49152")
    assert not loaded & {"gguf", "numpy"}, sorted(loaded & {"gguf", "numpy"})


def test_the_engine_process_imports_llama_cpps_bindings_alone_and_the_package_stays_whole() -> None:
    out = subprocess.run([sys.executable, "-c", """
import sys
from localrun.backends.llama_loader import library
ll = library()
print(sorted(m for m in ("numpy", "jinja2", "llama_cpp.llama") if m in sys.modules))
import llama_cpp
from llama_cpp import Llama
import llama_cpp.mtmd_cpp
print(llama_cpp.llama_cpp is ll, llama_cpp.Llama is Llama, llama_cpp.llama_decode is ll.llama_decode,
      llama_cpp.__version__ == __import__("importlib.metadata").metadata.version("llama-cpp-python"))
from localrun.backends.llama_loader import LOG, load_model, model_params
from localrun.store import starter_model_path
load_model(str(starter_model_path()), "starter", model_params(0))
print(len(LOG.tail) > 10)
"""], capture_output=True, text=True, check=True)
    lines = out.stdout.split("\n")
    assert lines[0] == "[]"  # the bindings only: no numpy, jinja2 or high-level Llama class
    assert lines[1] == "True True True True"  # and the whole package for whoever asks for it after
    # whose own __init__ sets a log callback of its own: llama.cpp's log still reaches localrun's sink
    assert lines[2] == "True" and "llama_model_loader" not in out.stderr and "print_info" not in out.stderr
