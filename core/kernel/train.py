"""Training: the process group, the loader that resumes part-way, metrics summed over every rank, the log lines."""

from __future__ import annotations

import contextlib
import os
import sys
from collections import namedtuple
from collections.abc import Iterator, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Subset

from core.kernel.job import RecipeError, RunFolder, say, write_record
from core.kernel.seams import SEAMS

Topology = namedtuple("Topology", "rank world_size device")  # rank 0 decides, writes and prints; device: cuda or cpu


IGNORE = -100  # the target value that counts nowhere, as in cross_entropy and transformers


def init_pg(*, timeout_s: float) -> Topology:
    """Join torchrun's process group (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); alone, a world of one."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # tools/ checks them
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")  # not RANK
    if cuda:
        torch.cuda.set_device(device)
    store = dist.HashStore() if "MASTER_PORT" not in os.environ and world_size == 1 else None  # no launcher: no port
    try:
        if not dist.is_initialized():  # the package's runner may have joined already
            backend, timeout = "nccl" if cuda else "gloo", timedelta(seconds=timeout_s)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except (RuntimeError, OSError, ValueError):  # DistNetworkError is a RuntimeError, TimeoutError an OSError
        at = f"MASTER_ADDR:MASTER_PORT {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise RecipeError(f"rank {rank} could not reach {at} within {timeout_s:g}s; is node 0 up?") from None
    return Topology(rank, world_size, device)


def cleanup_pg() -> None:
    """Leave the process group; after a run that ended well, a bounded barrier first: no rank exits mid-talk."""
    if dist.is_initialized() and dist.get_world_size() > 1 and sys.exc_info()[1] is None:
        with contextlib.suppress(Exception):  # a peer that died or hung: leave anyway, the run's outcome stands
            dist.barrier(async_op=True).wait(timeout=timedelta(seconds=60))
    if dist.is_initialized():
        dist.destroy_process_group()


def to_device(batch, device: torch.device):
    """A batch's tensors (in dicts, lists and tuples, nested) on `device`."""
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple | list):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)  # a namedtuple takes *args
    return batch.to(device, non_blocking=True) if isinstance(batch, torch.Tensor) else batch


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way through, for a mid-epoch resume."""

    skip = 0

    def set_epoch(self, epoch: int, *, consumed: int = 0) -> None:
        """Every epoch's start; `consumed` samples of the epoch's global order were trained already (a resume)."""
        super().set_epoch(epoch)  # the same shuffle on every rank
        self.skip = consumed // self.num_replicas  # this rank's share of them

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.skip :])

    def __len__(self) -> int:
        return self.num_samples - self.skip


def make_loader(dataset, topo, *, batch_size: int, collate_fn, seed: int = 0, train: bool = True):
    """This rank's share (None for None): shuffled apart from the global RNG (exact resume), or each sample once."""
    if dataset is None:
        return None
    on_gpu = topo.device.type == "cuda"
    options = dict(num_workers=2 if on_gpu else 0, pin_memory=on_gpu, persistent_workers=on_gpu, collate_fn=collate_fn)
    if not train:
        return DataLoader(Subset(dataset, range(topo.rank, len(dataset), topo.world_size)), batch_size, **options)
    sampler = ResumableSampler(dataset, num_replicas=topo.world_size, rank=topo.rank, seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size, sampler=sampler, generator=torch.Generator().manual_seed(seed), **options)


def metrics(logits, targets, mean: torch.Tensor, *, samples: int, shift: bool) -> dict[str, torch.Tensor]:
    """loss_sum, count (counted targets, else samples), samples, and correct where the logits score the targets."""
    n = torch.tensor(float(samples), dtype=torch.float64, device=mean.device)
    if shift and targets is not None:  # scored as the loss compared them: logits[t] with targets[t + 1]
        logits, targets = logits if logits is None else logits[..., :-1, :], targets[..., 1:]
    classes = targets is not None and not targets.is_floating_point()  # class indices, IGNORE counting nowhere
    count = targets.ne(IGNORE).sum().double() if classes else n
    sums = {"loss_sum": torch.where(count > 0, mean.detach().double() * count, 0.0), "count": count, "samples": n}
    if classes and logits is not None and logits.shape[:-1] == targets.shape:
        right = logits.detach().argmax(-1).eq(targets) & targets.ne(IGNORE)
        sums |= {"correct": right.sum().double(), "scored": count}
    return sums


TALLY_KEYS = ("loss_sum", "count", "samples", "correct", "scored")  # every rank joins one all-reduce of this shape


class Tally:
    """Running sums of step metrics on the device; `reduce` sums them over all ranks (one all-reduce)."""

    def __init__(self, device: torch.device, carried: dict[str, float] | None = None):
        self.sums = {key: torch.zeros((), dtype=torch.float64, device=device) for key in TALLY_KEYS}
        self.add(carried or {})  # a checkpoint's open window, reduced (rank 0's alone): as never stopping had it
        self.last = {}  # the last window's loss (and accuracy), read again by a window that counted nothing

    def add(self, metrics: dict) -> None:
        self.sums |= {key: self.sums[key] + value for key, value in metrics.items()}

    def reduce(self) -> dict[str, float]:
        dist.all_reduce(total := torch.stack([self.sums[k] for k in TALLY_KEYS]))
        return dict(zip(TALLY_KEYS, total.tolist()))


def summarize(sums: dict[str, float], *, prefix: str = "") -> dict[str, float]:
    """The mean loss over counted targets, and the accuracy where one was measured (never a made-up 0)."""
    record = {f"{prefix}loss": sums["loss_sum"] / max(sums["count"], 1.0)}
    if sums["scored"] > 0:
        record[f"{prefix}acc"] = sums["correct"] / sums["scored"]
    return record


def not_training() -> contextlib.ExitStack:
    """Evaluation and checkpoints: time the clock plug-in leaves out of training's."""
    stack = contextlib.ExitStack()  # the pauses entered here, left when the `with` block ends
    for pause in SEAMS["pauses"]:
        stack.enter_context(pause())
    return stack


def log_train(run: RunFolder, window: Tally, *, step: int, total: int, epoch: int, **numbers) -> None:
    """A `train` record and line of the job's numbers since the last one (a collective)."""
    sums = window.reduce()
    window.sums = {key: torch.zeros_like(value) for key, value in window.sums.items()}
    more = {k: v for hook in SEAMS["log_fields"] for k, v in hook().items()}  # the clock's rates (a collective too)
    if sums["count"] > 0:  # else the last window's numbers stand
        window.last = summarize(sums) | more
    write_record(run, {"kind": "train", "step": step, "epoch": epoch, **numbers, **window.last})
    shown = [f"{key} {window.last[key]:.4f}" for key in ("loss", "acc") if key in window.last]
    shown += [f"{window.last[k]:.0f} {k.removesuffix('_per_s')}/s" for k in window.last if k.endswith("_per_s")]
    say(run, " ".join([f"step {step}/{total} epoch {epoch}", *shown]))


def log_eval(run: RunFolder, evaluation: dict, *, step: int, epoch: int) -> None:
    """An `eval` record and line after each epoch's evaluation (none without a validation set)."""
    if evaluation:
        write_record(run, {"kind": "eval", "step": step, "epoch": epoch, **evaluation})
        say(run, f"epoch {epoch} " + " ".join(f"{k} {v:.4f}" for k, v in evaluation.items()))


def log_summary(cfg, run: RunFolder, model, window: Tally, evaluation: dict, **numbers) -> dict:
    """The closing `summary` record and line, with the plug-ins' fields; every rank returns it."""
    summary = {**evaluation, "train_loss": window.last.get("loss"), **numbers}
    summary |= {key: run.config[key] for key in ("world_size", "global_batch")}
    for hook in SEAMS["after_job"]:
        summary |= hook(cfg, run, model) or {}
    write_record(run, {"kind": "summary", **summary})
    shown = {k: (f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}") if isinstance(v, float) else v for k, v in summary.items()}
    say(run, "summary " + " ".join(f"{k}={v}" for k, v in shown.items()))  # 51690 tokens/s, not 5.169e+04
    return summary
