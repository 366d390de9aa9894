"""The gradients' norm and clipping for replicated (DDP) and sharded (DTensor) gradients, and the two mixed."""

from __future__ import annotations

import torch


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip the gradients' total norm to max_norm (0: only measure it), any layout; returns the norm, on every rank."""
    kinds: dict = {}  # by the gradient's DeviceMesh (None: plain tensors): torch's norm takes one kind at a time
    for p in [p for p in parameters if p.grad is not None]:
        kinds.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    # each mesh its own norm, a DTensor's reduced over its shards by full_tensor(); then sqrt(sum of their squares)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in kind]) for kind in kinds.values()]
    parts = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    norm = parts[0] if len(parts) == 1 else torch.nn.utils.get_total_norm(parts)  # none: 0
    if max_norm > 0:  # 0: measured only
        for kind in kinds.values():  # fsdp_tp: the TP layers' mesh is 2-D
            torch.nn.utils.clip_grads_with_norm_(kind, max_norm, norm)
    return norm
