"""Plug-in `factories`: --model and --data, a built-in name or a user's `module:function`, called with no arguments.

--model mypkg.models:build    a function returning an nn.Module
--data mypkg.data:build       a function returning (train, val) or (train, val, collate_fn); val may be None
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass

import numpy as np
from torch import nn
from torch.utils.data import IterableDataset

from core.kernel.builtin import MLP, digits
from core.kernel.job import Options, RecipeError, option
from core.kernel.seams import FACTORIES, SEAMS

MODELS: dict = {"mlp": MLP}  # name -> a factory, or "module:function", imported only when named
DATASETS: dict = {"digits": digits}


@dataclass(frozen=True)
class Factories(Options):
    """training"""

    model: str = option("mlp", "built-in model (mlp, cnn, gpt) or module:function returning an nn.Module")
    data: str = option("digits", "built-in data (digits, synthetic, text) or module:function returning (train, val)")


def resolve_factory(spec: str, builtins: dict, *, option: str):
    """`mlp` -> the built-in factory; `mypkg.models:build` -> that function, imported; else one RecipeError line."""
    target = builtins.get(spec, spec)
    if callable(target):
        return target
    module_name, _, name = target.partition(":")
    if not name:
        raise RecipeError(f"{option} {spec}: not a built-in ({', '.join(builtins)}) and not a module:function factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # an ImportError, or any error raised while the module runs
        cause = err
        while cause is not None and not isinstance(cause, KeyboardInterrupt):  # Ctrl-C in the import, re-raised
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        raise RecipeError(
            f"{option} {spec}: cannot import {module_name!r} ({type(err).__name__}: {err}); is it installed or on "
            f"PYTHONPATH?"
        ) from None
    if not callable(getattr(module, name, None)):
        raise RecipeError(f"{option} {spec}: module {module_name!r} has no function {name!r}")
    return getattr(module, name)


def model_from_spec(cfg) -> nn.Module:
    model = resolve_factory(cfg.model, MODELS, option="--model")()
    if not isinstance(model, nn.Module):
        raise RecipeError(f"--model {cfg.model}: the factory returned {type(model).__name__}, not an nn.Module")
    return model


def data_from_spec(cfg) -> tuple:
    random.seed(cfg.seed)  # a factory that shuffles with random or numpy: the same split on every rank
    np.random.seed(cfg.seed)
    found = resolve_factory(cfg.data, DATASETS, option="--data")()
    found = (*found, None)[:3] if isinstance(found, tuple | list) else (found, None, None)
    if (
        isinstance(found[0], IterableDataset) and not SEAMS["streams"]
    ):  # no length for a sampler; the stream plug-in reads it
        raise RecipeError(
            f"the data set is a stream ({type(found[0]).__name__}, an IterableDataset): give a map-style one "
            f"(__len__, __getitem__), or take ddp_amp, fsdp, fsdp_tp or tensor_parallel (a copy of one made "
            f"`--with stream`)"
        )
    return found


SEAMS["option_groups"].append(Factories)
FACTORIES.update(model=model_from_spec, data=data_from_spec)
