"""The options every recipe shares, as one frozen value checked when it is built.

A wrong value fails here, before any process group exists, with a message that names the
option, the value and the fix. The CLI is derived from the fields below (help text included).
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class RecipeError(Exception):
    """A problem the user can fix; the CLI prints it as one line and exits non-zero."""


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = _opt(5, "passes over the training set")
    max_steps: int = _opt(0, "stop after this many optimizer steps (0: no limit)")
    batch_size: int = _opt(32, "samples per rank per micro-batch (global batch = this x world size x accum)")
    lr: float = _opt(1e-3, "peak learning rate (AdamW, cosine decay to zero)")
    seed: int = _opt(0, "seed for weights, shuffling and dropout")
    model: str = _opt("mlp", "built-in model name or module:function returning an nn.Module")
    data: str = _opt("digits", "built-in data name or module:function returning (train, val)")
    precision: str = _opt("fp32", "compute precision", choices=("fp32", "bf16", "fp16"))
    accum: int = _opt(1, "micro-batches per optimizer step (gradient accumulation)")
    clip: float = _opt(0.0, "clip the global gradient norm to this (0: no clipping)")
    ckpt_every: int = _opt(0, "write a checkpoint every N optimizer steps (0: none)")
    keep: int = _opt(2, "how many newest checkpoints to keep")
    resume: str = _opt("", "'auto' (newest checkpoint of the newest run) or a checkpoint path")
    out: str = _opt("runs", "folder that gets one sub-folder per run")
    name: str = _opt("", "run folder name prefix (default: the recipe name)")
    log_every: int = _opt(10, "log a train record every N optimizer steps")
    timeout_s: float = _opt(300.0, "seconds a collective or the rendezvous may wait before failing")
    # Communication (DDP; see core/comm.py and docs/monitoring.md).
    comm_hook: str = _opt("none", "gradient all-reduce: plain, compressed to fp16/bf16, or PowerSGD low-rank",
                          choices=("none", "fp16", "bf16", "powersgd"))
    bucket_mb: float = _opt(25.0, "DDP gradient bucket size in MB (one all-reduce per bucket)")
    grad_as_bucket_view: bool = _opt(False, "gradients are views into DDP's buckets (saves a copy and memory)")
    static_graph: bool = _opt(False, "tell DDP the graph is the same every step (safe for the built-in models)")
    # Computation (see core/tuning.py).
    compile: bool = _opt(False, "torch.compile the model (after the parallel wrapper)")
    activation_checkpointing: bool = _opt(False, "recompute each block's activations in backward (less memory)")
    channels_last: bool = _opt(False, "channels-last memory format for conv models (GPU)")
    # Debugging (see core/watchdog.py).
    hang_factor: float = _opt(20.0, "watchdog: dump every rank's stack when a step takes this many times "
                                    "the median step (0: off)")
    hang_min_s: float = _opt(60.0, "watchdog: never call a step shorter than this many seconds a hang")
    debug: bool = _opt(False, "TORCH_DISTRIBUTED_DEBUG=DETAIL, and the NCCL flight recorder on GPU")
    profile: bool = _opt(False, "write a torch.profiler trace of a few steps, one file per rank")

    def __post_init__(self):
        checks = [
            (self.epochs >= 0, "--epochs", self.epochs, "use 0 or more"),
            (self.max_steps >= 0, "--max-steps", self.max_steps, "use 0 (no limit) or more"),
            (self.batch_size >= 1, "--batch-size", self.batch_size, "use 1 or more (it is per rank)"),
            (self.lr > 0, "--lr", self.lr, "use a positive learning rate"),
            (self.accum >= 1, "--accum", self.accum, "use 1 or more"),
            (self.clip >= 0, "--clip", self.clip, "use 0 (off) or a positive max norm"),
            (self.ckpt_every >= 0, "--ckpt-every", self.ckpt_every, "use 0 or more steps"),
            (self.keep >= 1, "--keep", self.keep, "keep at least 1 checkpoint"),
            (self.log_every >= 1, "--log-every", self.log_every, "use 1 or more"),
            (self.timeout_s > 0, "--timeout-s", self.timeout_s, "use a positive number of seconds"),
            (self.bucket_mb > 0, "--bucket-mb", self.bucket_mb, "use a positive size in MB (DDP's default is 25)"),
            (self.hang_factor == 0 or self.hang_factor > 1, "--hang-factor", self.hang_factor,
             "use 0 (off) or a multiple above 1 of the median step"),
            (self.hang_min_s > 0, "--hang-min-s", self.hang_min_s, "use a positive number of seconds"),
        ]
        for ok, option, value, fix in checks:
            if not ok:
                raise RecipeError(f"{option} {value}: {fix}")
        for name in ("precision", "comm_hook"):
            choices, value = self.__dataclass_fields__[name].metadata["choices"], getattr(self, name)
            if value not in choices:
                raise RecipeError(f"--{name.replace('_', '-')} {value}: choose one of {', '.join(choices)}")
        if self.precision == "fp16" and not torch.cuda.is_available():
            raise RecipeError("--precision fp16 needs a CUDA GPU; on CPU use --precision bf16")
        if self.comm_hook == "bf16" and not torch.cuda.is_available():  # gloo has no bf16 all-reduce
            raise RecipeError("--comm-hook bf16 needs NCCL (a CUDA GPU); on gloo use --comm-hook fp16 or powersgd")

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def resolve_factory(spec: str, builtins: dict[str, Callable], *, option: str) -> Callable:
    """`mlp` -> the built-in factory; `mypkg.models:build` -> that function, imported."""
    if spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        raise RecipeError(
            f"{option} {spec}: not a built-in ({', '.join(sorted(builtins))}) "
            f"and not a module:function factory"
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


def check_writable(folder: str) -> None:
    """Fail now, not after an hour of training, when the output folder can't be written."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        raise RecipeError(
            f"--out {folder}: cannot write there ({err.strerror or err}); pick a writable folder"
        ) from None
