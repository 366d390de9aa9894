"""The factory contract: `--model`, `--data` and `--loss` name a built-in or a user's `module:function`.

    resolve_factory("mlp", MODELS, option="--model")()                 # the built-in, called with no arguments
    resolve_factory("mypkg.models:build", MODELS, option="--model")()  # imported, then called with no arguments

The package's pre-check (tools/precheck.py) calls each factory once before any process starts and says in one
line what is wrong with it (arguments it needs, what it raised or returned).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from core.kernel.job import RecipeError


def resolve_factory(spec: str, builtins: dict[str, Callable | str], *, option: str) -> Callable:
    """`mlp` -> the built-in factory; `mypkg.models:build` -> that function, imported. A built-in may be given as
    "module:function" itself, imported only when asked for."""
    target = builtins.get(spec, spec)
    if callable(target):
        return target
    module_name, _, name = target.partition(":")
    if not name:
        raise RecipeError(f"{option} {spec}: not a built-in ({', '.join(builtins)}) and not a module:function factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # an ImportError, or any error raised while the module runs
        if interrupt := _interrupt(err):  # Ctrl-C (or SIGTERM) in the import, re-raised by a lazy import as another
            raise interrupt from None
        raise RecipeError(
            f"{option} {spec}: cannot import {module_name!r} ({type(err).__name__}: {err}); is it installed or on "
            f"PYTHONPATH?"
        ) from None
    if not callable(getattr(module, name, None)):
        raise RecipeError(f"{option} {spec}: module {module_name!r} has no function {name!r}")
    return getattr(module, name)


def _interrupt(err: BaseException | None) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt among the causes of `err`, if one is."""
    while err is not None and not isinstance(err, KeyboardInterrupt):
        err = err.__cause__ or err.__context__
    return err
