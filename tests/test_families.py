"""Variant families: a family is one module with one registered class, found without being listed,
tried in its declared order; every tool-call family module registers its format."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from localrun import tools
from localrun.families import Families
from localrun.tools.base import FAMILIES, ToolFormat

FAMILY = '''
from families_probe import REGISTRY

@REGISTRY.register({order})
class {name}:
    @classmethod
    def matches(cls, template: str) -> bool:
        return {test}
'''


def defined_in(package: ModuleType, base: type) -> list[type]:
    """Every subclass of base that a module of the package defines itself (not one it imports)."""
    defined = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        defined += [obj for obj in vars(module).values() if isinstance(obj, type)
                    and issubclass(obj, base) and obj is not base and obj.__module__ == module.__name__]
    return defined


def test_every_tool_family_module_registers_its_format() -> None:
    registered = FAMILIES.all()
    defined = defined_in(tools, ToolFormat)
    assert sorted(c.__name__ for c in defined) == sorted(c.__name__ for c in registered)
    assert len(registered) == 7  # hermes, llama3, mistral, granite, deepseek_r1, harmony, generic
    assert registered[-1].__name__ == "Generic"  # it takes any template: tried last


def test_a_new_family_module_is_found_and_tried_in_its_order(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "families_probe"
    root.mkdir()
    (root / "__init__.py").write_text("from localrun.families import Families\n"
                                      "REGISTRY = Families('families_probe')\n")
    (root / "fallback.py").write_text(FAMILY.format(order=100, name="Fallback", test="True"))
    (root / "think.py").write_text(FAMILY.format(order=10, name="Think", test="'<think>' in template"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        registry: Families = importlib.import_module("families_probe").REGISTRY
        assert registry.find("a <think> b").__name__ == "Think"
        assert registry.find("plain").__name__ == "Fallback"
        assert [c.__name__ for c in registry.all()] == ["Think", "Fallback"]
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "families_probe"]:
            del sys.modules[name]


def test_a_template_no_family_takes_is_an_error() -> None:
    empty: Families[ToolFormat] = Families("localrun.tools")  # the modules register with FAMILIES, not with this one
    with pytest.raises(LookupError, match="no family of localrun.tools recognizes"):
        empty.find("<tool_call>")
