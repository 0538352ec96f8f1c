"""Package attributes imported on first use, so importing a package stays cheap (a vLLM worker or
an HTTP-only process never imports SQLAlchemy or the trainer's hooks it does not use)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_attributes(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``name`` from ``{package}.{where[name]}``."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{where[name]}"), name)

    return __getattr__
