"""Variant families recognized in a chat template: one module per family in a package, each class
registered with the place it takes in the search, the first whose `matches` accepts a template wins.

Tool-call syntaxes (`localrun.tools`) and reasoning formats (`localrun.reasoning`, whose `detect`
also asks the vocabulary) use it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Recognizer(Protocol):
    """A family class: it says whether a chat template is one of its own."""

    @classmethod
    def matches(cls, template: str) -> bool: ...


F = TypeVar("F", bound=Recognizer)


class Families(Generic[F]):
    """The family classes of one package; every module in it is imported on first lookup."""

    def __init__(self, package: str) -> None:
        self.package = package
        self._order: dict[type[F], int] = {}
        self._loaded = False

    def register(self, order: int) -> Callable[[type[F]], type[F]]:
        """A class decorator: the family is tried after every family of a lower order."""

        def deco(cls: type[F]) -> type[F]:
            self._order[cls] = order
            return cls

        return deco

    def all(self) -> list[type[F]]:
        """Every registered family, in the order they are tried."""
        if not self._loaded:
            path = importlib.import_module(self.package).__path__
            for info in pkgutil.iter_modules(path):
                importlib.import_module(f"{self.package}.{info.name}")
            self._loaded = True
        return sorted(self._order, key=self._order.__getitem__)

    def find(self, template: str) -> type[F]:
        """The first family that recognizes the template (a package registers a catch-all last)."""
        for cls in self.all():
            if cls.matches(template):
                return cls
        raise LookupError(f"no family of {self.package} recognizes the template")
