"""The GPT recipes' built-ins: the GPT on the text unless --model or --data names another, one epoch at 3e-3."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import field, make_dataclass

from torch import nn

from core.gpt import gpt, text
from core.kernel.seams import FACTORIES

GPT_DEFAULTS = {"model": "gpt", "data": "text", "epochs": 1, "lr": 3e-3}  # the GPT on text, one epoch at 3e-3


def gpt_defaults(groups: list[type]) -> Iterator[type]:
    """The option groups of a Config, with GPT_DEFAULTS for the options they have, each option's help and check kept."""
    for group in groups:
        own = group.__dataclass_fields__
        new = [(k, type(v), field(default=v, metadata=own[k].metadata)) for k, v in GPT_DEFAULTS.items() if k in own]
        yield make_dataclass(group.__name__, new, bases=(group,), frozen=True) if new else group


def build_gpt(cfg) -> nn.Module:
    """The GPT, or the --model a user named (the factories plug-in; without it, the GPT)."""
    return FACTORIES["model"](cfg) if "model" in FACTORIES and cfg.model != "gpt" else gpt()  # your model


def build_text(cfg) -> tuple:
    """(train, val, collate_fn or None): the text's windows, or the --data a user named (the factories plug-in)."""
    found = FACTORIES["data"](cfg) if "data" in FACTORIES and cfg.data != "text" else text()  # your data
    return (*found, None)[:3]
