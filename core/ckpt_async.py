"""--ckpt-async: the step waits only for the copy to host memory; a thread of rank 0 writes the kernel's file."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from core.kernel.job import Options, RecipeError, RunFolder, option
from core.kernel.replica import save_checkpoint
from core.kernel.store import FORMAT, write_tensors


@dataclass(frozen=True)
class AsyncCheckpoints(Options):
    """checkpoints"""

    ckpt_async: bool = option(False, "write checkpoints in a background thread: the step waits for the host copy only")


def stage(tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `tensors` in host `buffers`, kept from save to save (pinned for a GPU's tensors)."""
    for key, tensor in tensors.items():
        if key not in buffers or buffers[key].shape != tensor.shape or buffers[key].dtype != tensor.dtype:
            buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        buffers[key].copy_(tensor.detach(), non_blocking=tensor.is_cuda)
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()  # the copies are complete before training changes the originals
    return {key: buffers[key] for key in tensors}  # separate buffers: tied weights are two tensors, as savable makes


def snapshot(run: RunFolder, *, model, optimizer, scheduler, progress: dict) -> tuple[dict, dict]:
    """(tensors, metadata) of the kernel's save_checkpoint, every rank's generators too (a collective)."""
    mine = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    rng, optim = [None] * dist.get_world_size(), optimizer.state_dict()
    dist.all_gather_object(rng, mine)  # each rank's own generators: bitwise resume
    flat = {f"{index}/{name}": value for index, state in optim["state"].items() for name, value in state.items()}
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    tensors |= {f"optim/{k}": v for k, v in flat.items() if torch.is_tensor(v)}  # other values go to JSON
    tensors |= {f"rng/{rank}/{kind}": state for rank, states in enumerate(rng) for kind, state in states.items()}
    rest = {"param_groups": optim["param_groups"], "scalars": {k: v for k, v in flat.items() if not torch.is_tensor(v)}}
    meta = {"format": FORMAT, "recipe": run.recipe, "torch": torch.__version__, "config": run.config}
    meta |= {"global_batch": run.config["global_batch"], "world_size": len(rng), "optimizer": rest}
    meta |= {"progress": progress, "scheduler": scheduler.state_dict()}
    return tensors, {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}


class CheckpointSaver:
    """The kernel's save_checkpoint, or (background=True) the same file written by a thread of rank 0."""

    def __init__(self, *, background: bool):
        self.background, self.buffers, self.thread, self.error = background, {}, None, None  # buffers: reused

    def save(self, run: RunFolder, *, model, optimizer, scheduler, progress: dict, keep: int) -> Path:
        """RUN/ckpt/step-N.safetensors, the kernel's file, once the previous write has landed (a collective)."""
        state = dict(model=model, optimizer=optimizer, scheduler=scheduler, progress=progress)
        if not self.background:
            return save_checkpoint(run, **state, keep=keep)
        self.wait()
        tensors, metadata = snapshot(run, **state)
        path = run.path / "ckpt" / f"step-{progress['step']:06d}.safetensors"  # the kernel's save_checkpoint's name
        if run.writer:
            args = path, progress["step"], stage(tensors, self.buffers), metadata, keep
            self.thread = threading.Thread(target=self._write, args=args, daemon=True)
            self.thread.start()
        return path

    def _write(self, path: Path, step: int, tensors: dict, metadata: dict, keep: int) -> None:
        try:
            path.parent.mkdir(exist_ok=True)
            write_tensors(path, tensors, metadata)
            for old in sorted(path.parent.glob("step-*.safetensors"), key=lambda p: (len(p.name), p.name))[:-keep]:
                old.unlink(missing_ok=True)  # only once the new one is in place
        except BaseException as err:  # said in the training thread, at the next save or wait
            why = err.strerror if isinstance(err, OSError) and err.strerror else f"{type(err).__name__}: {err}"
            line = f"{path}: the background write of step {step} failed ({why}); the checkpoints before it are whole: "
            self.error = err, line + "free space or point --out at another disk, then --resume auto"

    def wait(self) -> None:
        """Until the write in flight has landed; a failed one is one line on every rank (a collective)."""
        if self.thread is not None:
            self.thread.join()
        (err, failed), self.error = self.error or (None, None), None
        if self.background:
            dist.broadcast_object_list(box := [failed], src=0)
            failed = box[0]
        if err is not None and not isinstance(err, OSError):
            raise err  # a bug, not the disk: its traceback (the other ranks get the line)
        if failed:
            raise RecipeError(failed)
