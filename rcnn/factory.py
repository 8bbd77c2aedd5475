"""A user's code named ``package.module:factory``: imported, with one-line errors naming what went wrong."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rcnn.rules import ValueNotAllowed, first_line


def import_factory(spec: str, key: str) -> Callable[..., Any]:
    """The callable ``spec`` names; ValueNotAllowed keyed ``key`` when it cannot be imported."""
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # not found, or the module itself fails: a SyntaxError, a NameError, ...
        raise ValueNotAllowed(
            key,
            f"cannot import {module_name!r} ({first_line(err)}); allowed: an importable "
            "package.module:factory (on PYTHONPATH, or installed)",
        ) from err
    factory = getattr(module, attribute, None)
    if factory is None:
        raise ValueNotAllowed(
            key,
            f"{module_name} has no {attribute!r}; allowed: package.module:factory naming a function there",
        )
    if not callable(factory):
        raise ValueNotAllowed(
            key,
            f"{spec} is a {type(factory).__name__}, not a function; allowed: "
            "package.module:factory naming a function",
        )
    return factory


def declared(factory: Callable[..., Any], offered: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``offered`` that ``factory``'s signature names (a ``**kwargs`` names none): a
    factory takes the sizes it declares (``def make(image_size): ...``) and is not handed the others."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C extension without a signature: it declares nothing
        return {}
    named = {
        name
        for name, p in parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {name: value for name, value in offered.items() if name in named}


def call_factory(
    spec: str, key: str, *args: Any, offered: Mapping[str, Any] | None = None, **kwargs: Any
) -> Any:
    """``import_factory(spec)(*args, **kwargs)``, plus those of ``offered`` that the factory declares
    (``declared``); what it raises becomes one line keyed ``key``."""
    factory = import_factory(spec, key)
    kwargs = {**declared(factory, offered or {}), **kwargs}
    try:
        return factory(*args, **kwargs)
    except Exception as err:
        raise ValueNotAllowed(key, f"{spec}() raised {first_line(err)}") from err


def source_of(spec: str, key: str) -> str:
    """What a measurement of ``spec`` depends on: the source of the module it names and of the module that
    defines the factory (where it re-exports one), or their files' bytes where there is no source.
    ValueNotAllowed keyed ``key`` when it cannot be imported."""
    factory = import_factory(spec, key)
    modules = {importlib.import_module(spec.partition(":")[0]), inspect.getmodule(factory)} - {None}
    texts = []
    for module in sorted(modules, key=lambda m: m.__name__):
        try:
            texts.append(inspect.getsource(module))
        except (OSError, TypeError):  # compiled, or built without a source file
            path = getattr(module, "__file__", None)
            texts.append(Path(path).read_bytes().hex() if path else module.__name__)
    return "".join(texts)
