"""The engine registry: every engine declares its name, formats, install hint and abilities on its
class, and everything above backends/ (the CLI's --engine choices and checks, engine selection and
its messages, adapter routing, doctor) reads those declarations. A third engine is its own module
plus one registry line: shown here with a stand-in engine module written by the test (a fake
backend tests the CLI's and the facade's own logic; it claims nothing about running a model)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from localrun import api, settings
from localrun.backends import base
from localrun.backends.base import Abilities, abilities, backend_class, backend_names, engines_with
from localrun.errors import BackendUnavailableError, UsageError
from localrun.settings import LoadOptions
from localrun.store import ModelInfo

THIRD = '''
from localrun.backends.base import Abilities


class ThirdBackend:
    """A stand-in engine for ONNX folders."""

    name = "third"
    title = "Third"
    formats = ("onnx",)
    install_hint = "pip install third-engine"
    packages = ("third-engine",)
    abilities = Abilities(load_adapters=True, embeddings=True)
    copies_from = ("gguf",)
    copy_hint = "make a Third copy with 'third-convert {path}'"

    def available(self):
        return True

    def warm(self):
        pass

    def load(self, model, options):
        raise NotImplementedError

    def system_info(self):
        return {"third": "1.0"}

    @staticmethod
    def describe(facts):
        return [("version", f"third {facts['third']}")]
'''


@pytest.fixture
def third(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A third engine: its module, and one line in the registry."""
    (tmp_path / "third_engine.py").write_text(textwrap.dedent(THIRD))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(base.ENGINES, "third", "third_engine:ThirdBackend")
    yield "third"
    sys.modules.pop("third_engine", None)


def model(fmt: str, name: str = "m:1") -> ModelInfo:
    return ModelInfo(name, f"/models/{name}", fmt, "path", 0)


def test_every_engine_declares_what_it_is_and_can_do() -> None:
    assert backend_names() == ["llama.cpp", "mlx"]
    for name in backend_names():
        cls = backend_class(name)
        assert cls.name == name and cls.title and cls.formats and cls.install_hint and cls.packages
        assert isinstance(cls.abilities, Abilities) and "{path}" in cls.copy_hint
    assert abilities("llama.cpp").request_adapters and abilities("llama.cpp").expert_offload
    assert abilities("mlx").load_adapters and not abilities("mlx").request_adapters
    assert engines_with("expert_offload") == ["llama.cpp"]
    assert abilities("mlx").names() == ["load adapters", "images", "drafting", "structured output"]
    assert engines_with("drafting") == ["llama.cpp", "mlx"]


def test_the_cli_takes_its_engine_choices_from_the_registry(third: str) -> None:
    from localrun.cli import build_parser

    args = build_parser().parse_args(["run", "m", "--engine", third])
    assert args.engine == third
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "m", "--engine", "fourth"])


def test_selection_and_its_messages_come_from_the_declarations(third: str) -> None:
    assert api.choose_engine(model("onnx")) == third
    with pytest.raises(BackendUnavailableError) as e:
        api.choose_engine(model("gguf"), third)
    assert e.value.message.startswith(f"the {third} engine cannot run 'm:1': it is a GGUF file, which runs on llama.cpp")
    assert e.value.hint == "drop --engine to run it on llama.cpp, or make a Third copy with 'third-convert /models/m:1'"
    with pytest.raises(BackendUnavailableError, match="the llama.cpp engine cannot run 'm:1': it is a model in onnx format"):
        api.choose_engine(model("onnx"), "llama.cpp")


def test_an_engine_that_is_not_installed_names_its_install_hint(third: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_class(third), "available", lambda self: False)
    with pytest.raises(BackendUnavailableError) as e:
        api.choose_engine(model("onnx"))
    assert e.value.message == "'m:1' is a model in onnx format and Third is not installed"
    assert e.value.hint == "pip install third-engine"
    with pytest.raises(BackendUnavailableError, match="no engine can run 'm:1' \\(tflite format\\)"):
        api.choose_engine(model("tflite"))


def test_adapters_and_expert_offload_follow_the_abilities(third: str) -> None:
    from localrun.adapters import Target
    from localrun.cli import build_parser
    from localrun.cli.options import load_options_from_args

    adapter = ModelInfo("a:lora", "/peft/a", "peft", "path", 0, kind="adapter", details={"adapter": {"peft": "/peft/a"}})
    target = Target(model("onnx"), ((adapter, 0.5),))
    # An engine that applies adapters when it loads gets them in its load options, not per request.
    assert target.load_options(LoadOptions(), third).lora == (("/peft/a", 0.5),)
    assert settings.resolve({}, target, third).lora == ()
    # One with per-request adapters gets them with each request and loads the bare base.
    assert settings.resolve({}, target, "llama.cpp").lora == (("/peft/a", 0.5),)
    assert target.load_options(LoadOptions(), "llama.cpp").lora == ()
    args = build_parser().parse_args(["run", "m", "--engine", third, "--cpu-moe", "2"])
    with pytest.raises(UsageError, match="--cpu-moe works only with the llama.cpp engine, and third cannot") as e:
        load_options_from_args(args)
    assert e.value.hint == "drop --cpu-moe, or run a GGUF copy of the model on llama.cpp"


def test_doctor_reports_every_registered_engine_with_its_abilities(third: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from localrun import doctor

    # The probe runs in a child process, which has no stand-in: ask the registered class in here.
    monkeypatch.setattr(doctor, "_probe", lambda name: backend_class(name)().system_info())
    report = doctor.report()
    got: dict[str, Any] = report.to_dict()["engines"]
    assert list(got) == ["llama.cpp", "mlx", third]
    assert got[third] == {"third": "1.0", "available": True, "abilities": ["load adapters", "embeddings"]}
    assert next(e for e in report.engines if e.name == third).lines == (("version", "third 1.0"),)
    assert report.packages["third-engine"] is None  # its package, declared on its class


def test_doctor_reports_a_failing_probe_and_keeps_going(third: str) -> None:
    from localrun import doctor

    # The probe's child has no stand-in registered: its error crosses the pipe and is reported.
    got = doctor.report().to_dict()["engines"]
    assert got[third]["available"] is False and got[third]["error"].startswith("unknown engine 'third'")
    assert got[third]["abilities"] == ["load adapters", "embeddings"]
    assert got["llama.cpp"]["available"] is True and "AVX" in got["llama.cpp"]["system_info"]
