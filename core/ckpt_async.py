"""Asynchronous checkpoints (--ckpt-async): the step waits only while the train state is copied to host memory;
a thread of rank 0 writes the kernel's checkpoint file while training goes on.

    saver = CheckpointSaver(background=cfg.ckpt_async)   # background=False: the kernel's save_checkpoint, as is
    saver.save(run, model=model, optimizer=optimizer, scheduler=scheduler, progress=progress, keep=cfg.keep)
    saver.close()   # the end of the run: the last write lands, or its failure is one line

The file is the kernel's (snapshot, then write_tensors: atomic, checksummed), byte for byte the one a
synchronous save writes. One write is in flight at a time: the next save, and the end of the run, wait for
it first, and a write that failed is named by its own step. The host copy is kept from save to save (pinned
memory for a GPU's tensors): fresh memory's page faults cost as much as the copy itself. What it costs: a kill
during a write loses that checkpoint (the one before stays whole), and rank 0 holds a second copy of the state.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from core.kernel.job import Options, RecipeError, RunFolder, option
from core.kernel.store import FORMAT, save_checkpoint, write_tensors


@dataclass(frozen=True)
class AsyncCheckpoints(Options):
    title = "checkpoints"
    ckpt_async: bool = option(
        False, "write checkpoints in a background thread: the step waits only for the copy to host memory"
    )


def stage(tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `tensors` in host `buffers`, so training may change the originals while the copy is written.

    The buffers are kept and reused from the previous save (pinned for a GPU's tensors). Returns the copy, in the
    tensors' order."""
    for key in buffers.keys() - tensors.keys():
        del buffers[key]
    for key, tensor in tensors.items():
        buffer = buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()  # the copies are complete before training changes the originals
    return {key: buffers[key] for key in tensors}  # separate buffers: tied weights are two tensors, as savable makes


def snapshot(run: RunFolder, *, model, optimizer, scheduler, progress: dict) -> tuple[dict, dict]:
    """(tensors, metadata) of the kernel's save_checkpoint, every rank's generators too (a collective)."""
    mine = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, mine)  # each rank its own generators: bitwise resume
    optim = optimizer.state_dict()  # its state by parameter index: tensors to the file, other values to JSON
    flat = {f"{index}/{name}": value for index, state in optim["state"].items() for name, value in state.items()}
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    tensors |= {f"optim/{key}": value for key, value in flat.items() if torch.is_tensor(value)}
    tensors |= {f"rng/{rank}/{kind}": state for rank, states in enumerate(rng) for kind, state in states.items()}
    scalars = {key: value for key, value in flat.items() if not torch.is_tensor(value)}
    metadata = {"format": FORMAT, "recipe": run.recipe, "torch": torch.__version__}
    rest = {"config": run.config, "global_batch": run.config["global_batch"], "world_size": len(rng)}
    rest |= {"optimizer": {"param_groups": optim["param_groups"], "scalars": scalars}, "progress": progress}
    rest["scheduler"] = scheduler.state_dict()
    return tensors, metadata | {key: json.dumps(value) for key, value in rest.items()}


class CheckpointSaver:
    """The kernel's save_checkpoint, or (background=True) the same file written by a thread of rank 0."""

    def __init__(self, *, background: bool):
        self.background = background
        self.buffers: dict[str, torch.Tensor] = {}  # the host copy, reused save after save
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.writing: tuple[Path, int] | None = None  # the file in flight and its step: what an error names

    def save(self, run: RunFolder, *, model, optimizer, scheduler, progress: dict, keep: int) -> Path:
        """Every --ckpt-every steps, on every rank (the RNG gather is a collective): RUN/ckpt/step-N.safetensors.
        Waits for the previous write first."""
        state = dict(model=model, optimizer=optimizer, scheduler=scheduler, progress=progress)
        if not self.background:
            return save_checkpoint(run, **state, keep=keep)
        self.wait()
        tensors, metadata = snapshot(run, **state)
        path = run.path / "ckpt" / f"step-{progress['step']:06d}.safetensors"  # the kernel's save_checkpoint's name
        if run.writer:
            copy = stage(tensors, self.buffers)
            self.writing = path, progress["step"]
            self.thread = threading.Thread(target=self._write, args=(path, copy, metadata, keep), daemon=True)
            self.thread.start()
        return path

    def _write(self, path: Path, tensors: dict, metadata: dict, keep: int) -> None:
        try:
            path.parent.mkdir(exist_ok=True)
            write_tensors(path, tensors, metadata)
            for old in sorted(path.parent.glob("step-*.safetensors"), key=lambda p: (len(p.name), p.name))[
                :-keep
            ]:  # only once the new one is in place
                old.unlink(missing_ok=True)
        except BaseException as err:  # said in the training thread, at the next save or close
            self.error = err

    def wait(self) -> None:
        """Until the write in flight (if any) has landed; a failed one is one RecipeError line on every rank.

        A collective, so that no rank trains on while rank 0 stops."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        err, self.error = self.error, None
        failed = None
        if err is not None:
            path, step = self.writing
            why = err.strerror if isinstance(err, OSError) and err.strerror else f"{type(err).__name__}: {err}"
            failed = (
                f"{path}: writing the checkpoint of step {step} in the background failed ({why}); the checkpoints "
                f"before it are whole: free space or point --out at another disk, then --resume auto"
            )
        if self.background:
            dist.broadcast_object_list(box := [failed], src=0)
            failed = box[0]
        if failed and err is not None and not isinstance(err, OSError):
            raise err  # a bug, not the disk: its traceback (the other ranks get the line)
        if failed:
            raise RecipeError(failed)

    def close(self) -> None:
        """The end of the run: the last write lands before the final weights and the summary."""
        self.wait()
