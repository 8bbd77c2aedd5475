"""A user's code named ``package.module:factory``: imported, with one-line errors naming what went wrong."""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from rcnn.rules import ValueNotAllowed


def import_factory(spec: str, key: str) -> Callable[..., Any]:
    """The callable ``spec`` names; ValueNotAllowed keyed ``key`` when it cannot be imported."""
    module_name, _, attribute = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except ImportError as err:
        raise ValueNotAllowed(key, f"cannot import {module_name} ({err}); allowed: an importable "
                                   "package.module:factory (run from the folder that holds the package, or install "
                                   "it)") from None
    except AttributeError:
        raise ValueNotAllowed(key, f"{module_name} has no {attribute!r}; allowed: package.module:factory naming a "
                                   "function there") from None
    if not callable(factory):
        raise ValueNotAllowed(key, f"{spec} is a {type(factory).__name__}, not a function; allowed: "
                                   "package.module:factory naming a function")
    return factory


def call_factory(spec: str, key: str, *args: Any, **kwargs: Any) -> Any:
    """``import_factory(spec)(*args, **kwargs)``; what it raises becomes one line keyed ``key``."""
    factory = import_factory(spec, key)
    try:
        return factory(*args, **kwargs)
    except Exception as err:
        raise ValueNotAllowed(key, f"{spec}() raised {type(err).__name__}: "
                                   f"{str(err).splitlines()[0] if str(err) else ''}") from None


def source_of(spec: str, key: str) -> str:
    """The source of the module that defines ``spec``'s factory: what a measurement of it depends on.
    ValueNotAllowed keyed ``key`` when it cannot be imported."""
    import_factory(spec, key)
    return inspect.getsource(importlib.import_module(spec.partition(":")[0]))
