"""Writing checkpoints (core.ckpt has the format, the reading and the resume checks).

The state is taken on every rank (the RNG gather is a collective) and written by rank 0, in
the caller's thread or, with CheckpointSaver(background=True), in a thread of its own once it
is copied to host memory.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from core.ckpt_io import FORMAT, atomic_write, list_checkpoints, write_safetensors
from core.dist import barrier, is_rank0
from core.models import unwrap


def savable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two entries sharing storage (safetensors refuses tied weights)."""
    out, seen = {}, set()
    for key, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        out[key] = tensor.clone() if storage in seen else tensor
        if storage is not None:
            seen.add(storage)
    return out


def save_weights(state: dict, path: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> Path:
    """The plain model's state dict (no wrapper prefixes), loadable with safetensors.torch.load_file."""
    tensors = savable(state)
    return atomic_write(path, lambda f: write_safetensors(f, tensors, metadata))


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state_dict -> tensors by name, plus the JSON-able rest (param groups, scalars)."""
    tensors, scalars = {}, {}
    for index, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{index}/{name}"] = value
            else:
                scalars[f"{index}/{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _rng_states() -> list[dict[str, torch.Tensor]]:
    """Every rank's generator states, gathered (a collective: all ranks call it)."""
    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        mine["cuda"] = torch.cuda.get_rng_state()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def staged(tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `tensors` in host buffers kept from the previous save (pinned for a GPU's tensors):
    training may change the originals while the copy is written. Reusing the buffers matters: the
    page faults of fresh memory cost as much as the copy itself."""
    for key in buffers.keys() - tensors.keys():
        del buffers[key]
    for key, tensor in tensors.items():
        buffer = buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies are complete before training changes the originals
    return {key: buffers[key] for key in tensors}  # in the order of the tensors: the same file as in-line


def _snapshot(rng: list, *, model, optimizer, progress: dict, scheduler, scaler, metadata, buffers):
    """The tensors and header of a checkpoint; with `buffers` (a dict), copied into host memory of our own."""
    optim_tensors, optim_rest = _flatten_optimizer(optimizer.state_dict())
    tensors = {f"model/{k}": v for k, v in unwrap(model).state_dict().items()} | optim_tensors
    tensors |= {f"rng/{rank}/{kind}": state for rank, states in enumerate(rng) for kind, state in states.items()}
    header = {
        **(metadata or {}),
        "format": FORMAT,
        "world_size": str(len(rng)),
        "torch": torch.__version__,
        "optimizer": json.dumps(optim_rest),
        "progress": json.dumps(progress),
        "scheduler": json.dumps(scheduler.state_dict() if scheduler else None),
        "scaler": json.dumps(scaler.state_dict() if scaler and scaler.is_enabled() else None),
    }
    if progress.get("global_batch"):
        header["global_batch"] = str(progress["global_batch"])
    return (savable(tensors) if buffers is None else staged(tensors, buffers)), header


class CheckpointSaver:
    """Writes ckpt_dir/step-N.safetensors on rank 0 and keeps the newest `keep`.

        saver = CheckpointSaver(run_dir / "ckpt", keep=2, background=cfg.ckpt_async)
        saver.save(model=model, optimizer=optimizer, progress=progress)   # every rank: a collective
        saver.close()                                                      # at the end: the last write lands

    background=False: save() returns when the file is in place (every rank waits for it).
    background=True: save() returns once the state is copied to host memory; a thread writes the
    file (atomically, as always) and the next save() or close() waits for it first.
    """

    def __init__(self, ckpt_dir: str | os.PathLike, *, keep: int = 2, background: bool = False):
        self.ckpt_dir, self.keep, self.background = Path(ckpt_dir), keep, background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # background: the host copy, reused save after save
        self.path: Path | None = None  # the checkpoint written last (or being written): what an error is about

    def save(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        progress: dict,
        scheduler=None,
        scaler=None,
        metadata: dict[str, str] | None = None,
    ) -> Path:
        self.wait()
        rng = _rng_states()  # the collective part stays in the caller's thread
        path = self.path = self.ckpt_dir / f"step-{progress['step']:06d}.safetensors"
        if is_rank0():
            tensors, header = _snapshot(
                rng,
                model=model,
                optimizer=optimizer,
                progress=progress,
                scheduler=scheduler,
                scaler=scaler,
                metadata=metadata,
                buffers=self._buffers if self.background else None,
            )
            if self.background:
                self._thread = threading.Thread(target=self._write, args=(path, tensors, header), daemon=True)
                self._thread.start()
            else:
                self._write(path, tensors, header)
                self.wait()
        if not self.background:
            barrier()  # nobody runs ahead while rank 0 writes: a kill after this finds the checkpoint
        return path

    def _write(self, path: Path, tensors: dict, header: dict) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda f: write_safetensors(f, tensors, header))
            for old in list_checkpoints(path.parent)[: -self.keep]:  # only after the new one is safely in place
                old.unlink(missing_ok=True)
        except BaseException as err:  # raised in the training thread, at the next save or close
            self._error = err

    def wait(self) -> None:
        """Until the write in flight (if any) is done; raises what it failed with."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err  # an OSError (a full disk) as it is: the caller says it in one line with its numbers

    def close(self) -> None:
        self.wait()


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: dict,
    scheduler=None,
    scaler=None,
    keep: int = 2,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write ckpt_dir/step-N.safetensors on rank 0 and keep the newest `keep`; returns when it is in
    place. A collective. `progress` is {"epoch", "samples" (of the epoch's global order), "step", ...}."""
    return CheckpointSaver(ckpt_dir, keep=keep).save(
        model=model, optimizer=optimizer, progress=progress, scheduler=scheduler, scaler=scaler, metadata=metadata
    )
