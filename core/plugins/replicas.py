"""Plug-in `replicas`: whether the data-parallel replicas hold the same tensors at the end, and which differ (the
summary's replicas_identical; every rank compares)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.kernel.seams import SEAMS
from core.kernel.store import checksum


def replicas_report(tensors: dict[str, torch.Tensor]) -> dict:
    """{"replicas_identical": bool}, and when they differ "replicas_differ": which tensors (a collective)."""
    mine = {k: checksum(t) for k, t in tensors.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differ = [k for k in mine if any(other.get(k) != mine[k] for other in everyone)]
    if not differ:
        return {"replicas_identical": True}
    shown = ", ".join(differ[:3]) + (f" (+{len(differ) - 3} more)" if len(differ) > 3 else "")
    why = "BatchNorm statistics are per rank" if any("running_" in k for k in differ) else "set from each rank's data"
    return {"replicas_identical": False, "replicas_differ": f"{shown}: {why}"}


def report(cfg, run, model) -> dict:
    return replicas_report(model.state_dict())


SEAMS["after_job"].append(report)
