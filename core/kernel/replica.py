"""A whole replica on every rank: its evaluation, and its checkpoint (the train state in one RUN/ckpt/step-N file)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from core.kernel.job import RunFolder
from core.kernel.loss import Loss, forward
from core.kernel.store import FORMAT, START, from_rank0, read_checkpoint, resumed, write_tensors
from core.kernel.train import Tally, summarize, to_device


def save_checkpoint(run: RunFolder, *, model: nn.Module, optimizer, scheduler, progress: dict, keep: int) -> Path:
    """RUN/ckpt/step-N.safetensors: the train state, every rank's generators too (a collective); `keep` newest stay."""
    optim, tensors = optimizer.state_dict(), {f"model/{k}": v for k, v in model.state_dict().items()}
    tensors |= {f"optim/{i}/{name}": v for i, state in optim["state"].items() for name, v in state.items()}  # AdamW's
    mine = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    dist.all_gather_object(rng := [None] * dist.get_world_size(), mine)  # each rank's own generators: bitwise resume
    tensors |= {f"rng/{rank}/{kind}": state for rank, states in enumerate(rng) for kind, state in states.items()}
    meta = {"format": FORMAT, "recipe": run.recipe, "torch": torch.__version__, "config": run.config}
    groups = {"param_groups": optim["param_groups"], "scalars": {}}  # scalars: AdamW's state is all tensors
    meta |= {"global_batch": run.config["global_batch"], "world_size": len(rng), "optimizer": groups}
    meta |= {"progress": progress, "scheduler": scheduler.state_dict()}  # this order: ckpt_async writes the same bytes
    path = run.path / "ckpt" / f"step-{progress['step']:06d}.safetensors"
    if run.writer:  # a full disk raises OSError here, and the checkpoints before stay whole
        path.parent.mkdir(exist_ok=True)
        write_tensors(path, tensors, meta)
        for old in sorted(path.parent.glob("step-*.safetensors"), key=lambda p: (len(p.name), p.name))[:-keep]:
            old.unlink()  # only once the new one is in place
    dist.barrier()  # the others wait for it: a kill after this finds the checkpoint
    return path


def load_checkpoint(run: RunFolder, *, model: nn.Module, optimizer, scheduler) -> dict:
    """The checkpoint's train state on every rank (rank 0 reads and sends it); its progress, or START for a new run."""
    if run.resume_from is None:
        return dict(START)
    tensors, meta = from_rank0(run.writer, lambda: read_checkpoint(run.resume_from, model))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model/")})
    saved, state = json.loads(meta["optimizer"]), {}
    flat = {k[6:]: v for k, v in tensors.items() if k.startswith("optim/")} | saved.get("scalars", {})  # older files
    for key, value in flat.items():
        state.setdefault(int(key.split("/")[0]), {})[key.split("/", 1)[1]] = value
    groups = [{k: tuple(v) if k == "betas" else v for k, v in group.items()} for group in saved["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})  # JSON made AdamW's betas a list
    return resumed(run, meta, tensors, optimizer=optimizer, scheduler=scheduler)


@torch.no_grad()
def evaluate(model: nn.Module, loader, *, loss_fn: Loss, device: torch.device) -> dict[str, float]:
    """val_loss and val_acc over every rank's share of the validation set ({} without one)."""
    if loader is None:
        return {}
    was_training, tally = model.training, Tally(device)
    model.eval()
    for batch in loader:
        tally.add(forward(model, to_device(batch, device), loss_fn)[1])
    model.train(was_training)
    return summarize(tally.reduce(), prefix="val_")
