"""Attributes of a package loaded on first use (PEP 562), for steptrace and
steptrace.analysis: their __init__ stays cheap to import."""

from __future__ import annotations

from typing import Any, Callable


def lazy_attributes(package: str, table: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``table`` maps a name to the module that
    defines it; the value is imported on first access and kept in ``namespace``."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
