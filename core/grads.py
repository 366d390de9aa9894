"""The gradients' norm and clipping for replicated (DDP) and sharded (DTensor) gradients, and the two mixed."""

from __future__ import annotations

import sys

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm


def _by_mesh(params: list) -> dict:
    """Parameters grouped by their gradient's DeviceMesh (None: plain tensors): torch's norm takes one kind."""
    module = sys.modules.get("torch.distributed.tensor")  # loaded by whoever made a DTensor: ddp never imports it
    dtensor = module.DTensor if module is not None else ()
    kinds: dict = {}
    for p in params:
        kinds.setdefault(p.grad.device_mesh if isinstance(p.grad, dtensor) else None, []).append(p)
    return kinds


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip the gradients' total norm to max_norm (0: only measure it), any layout; returns the norm, on every rank."""
    parameters = [p for p in parameters if p.grad is not None]
    kinds, parts = _by_mesh(parameters), []
    for kind in kinds.values():  # each mesh its own norm, a DTensor's reduced over its shards by full_tensor()
        norm = get_total_norm([p.grad for p in kind])
        parts.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    norm = torch.zeros(()) if not parts else parts[0] if len(parts) == 1 else get_total_norm(parts)  # sqrt(sum sq)
    if max_norm > 0:
        for kind in kinds.values():  # fsdp_tp: the TP layers' mesh is 2-D
            clip_grads_with_norm_(kind, max_norm, norm)
    return norm
