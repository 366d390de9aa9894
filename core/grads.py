"""The gradients' norm and clipping for replicated (DDP) and sharded (DTensor) gradients, and the two mixed."""

from __future__ import annotations

import torch


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip the gradients' total norm to max_norm (0: only measure it), any layout; returns the norm, on every rank."""
    kinds: dict = {}  # by the gradient's DeviceMesh (None: plain tensors): torch's norm takes one kind at a time
    for p in parameters:
        if p.grad is not None:
            kinds.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    parts = []
    for kind in kinds.values():  # each mesh its own norm, a DTensor's reduced over its shards by full_tensor()
        norm = torch.nn.utils.get_total_norm([p.grad for p in kind])
        parts.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    # sqrt(sum of squares) of the meshes' norms
    norm = torch.zeros(()) if not parts else parts[0] if len(parts) == 1 else torch.nn.utils.get_total_norm(parts)
    if max_norm > 0:
        for kind in kinds.values():  # fsdp_tp: the TP layers' mesh is 2-D
            torch.nn.utils.clip_grads_with_norm_(kind, max_norm, norm)
    return norm
