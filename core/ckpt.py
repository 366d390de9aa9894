"""safetensors files written by rank 0, atomically: a kill at any moment leaves the last good file whole."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from core.models import unwrap


def atomic_write(path: str | os.PathLike, write) -> Path:
    """Call `write(tmp_path)`, fsync, then rename over `path`: readers see the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself survive a power cut
    finally:
        os.close(dir_fd)
    return path


def savable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two entries sharing storage (safetensors refuses tied weights)."""
    out, seen = {}, set()
    for key, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = (tensor.untyped_storage().data_ptr(), tensor.device) if tensor.numel() else None
        out[key] = tensor.clone() if storage in seen else tensor
        if storage is not None:
            seen.add(storage)
    return out


def save_weights(model: nn.Module, path: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> Path:
    """The plain model's state dict (no wrapper prefixes), loadable with safetensors.torch.load_file."""
    tensors = savable(unwrap(model).state_dict())
    return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
