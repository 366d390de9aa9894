"""The factory contract: `--model`, `--data` and `--loss` name a built-in or a user's `module:function`.

    resolve_factory("mlp", MODELS, option="--model")              # the built-in
    call_factory("mypkg.models:build", MODELS, option="--model")  # imported, called with no arguments

Checked once before any process starts (the CLI's pre-check) and again in every rank; whatever goes
wrong (no such module, no such function, arguments it needs, an exception it raises) is one line.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

from core.config import RecipeError


def resolve_factory(spec: str, builtins: dict[str, Callable | str], *, option: str) -> Callable:
    """`mlp` -> the built-in factory; `mypkg.models:build` -> that function, imported.
    A built-in given as "module:function" is imported only when asked for."""
    if spec in builtins and callable(builtins[spec]):
        return builtins[spec]
    if spec in builtins:
        spec = builtins[spec]
    elif ":" not in spec:
        raise RecipeError(
            f"{option} {spec}: not a built-in ({', '.join(sorted(builtins))}) and not a module:function factory"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # an ImportError, or any error raised while the module runs
        raise RecipeError(
            f"{option} {spec}: cannot import {module_name!r} ({type(err).__name__}: {err}); "
            f"is it installed or on PYTHONPATH?"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise RecipeError(f"{option} {spec}: module {module_name!r} has no function {attr!r}")
    return factory


def call_factory(spec: str, builtins: dict[str, Callable], *, option: str):
    """Resolve `spec` and call it with no arguments; a factory that needs some, or raises, is one RecipeError."""
    factory = resolve_factory(spec, builtins, option=option)
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # some builtins and C functions have no signature to read
        params = []
    needed = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if needed:
        raise RecipeError(
            f"{option} {spec}: the factory needs arguments ({', '.join(needed)}); it is called with "
            f"none: give them defaults or wrap it in a function that takes none"
        )
    try:
        return factory()
    except RecipeError:
        raise
    except Exception as err:  # the user's code: name it and what it raised, in one line
        message = " ".join(str(err).split())[:300]
        raise RecipeError(f"{option} {spec}: the factory raised {type(err).__name__}: {message}") from None
