"""How DDP moves gradients: comm hooks (fp16, bf16, PowerSGD) and bucket options.

    ddp = parallel.wrap_ddp(model, device=topo.device, comm_hook=cfg.comm_hook, **comm.ddp_options(cfg))
    # or DistributedDataParallel(model, device_ids=..., **comm.ddp_kwargs(bucket_mb=..., fixed_buckets=...))

`none` keeps DDP's own C++ reducer (it fuses the copy into the bucket with the division by the world
size; a Python hook doing the same costs an extra pass over the gradients, ~2% of a CPU step here).
What the others do to the numbers: `fp16`/`bf16` round each bucket to 16 bits before the all-reduce
(half the bytes, ~1e-3 relative error per step); `powersgd` sends a rank-r approximation of each
weight-gradient matrix with error feedback (far fewer bytes, approximate; its state is not
checkpointed, so a resumed run is close to, not bitwise equal to, an uninterrupted one).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from core.config import RecipeError

HOOKS = ("none", "fp16", "bf16", "powersgd")


def ddp_kwargs(
    *,
    bucket_mb: float | None = None,
    grad_as_bucket_view: bool = False,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    fixed_buckets: bool = False,
) -> dict:
    """DistributedDataParallel keyword arguments (all but module and device_ids).

    fixed_buckets: keep the first step's bucket layout for the whole run, so a resumed run all-reduces
    each gradient element in the same order as the run that never stopped (bitwise at any world size).
    Why: after its first backward DDP rebuilds its buckets in gradient-ready order; a resumed process
    makes its first step with the initial layout, where the run that never stopped had the rebuilt
    one. An element's place in the bucket decides which ring chunk sums it, and so the order in
    which 3+ ranks' values are added (2 ranks: a + b == b + a, always bitwise). DDP skips the
    rebuild when it looks for unused parameters (one autograd-graph traversal a step, ~+20% on a
    tiny CPU model here; a static graph rebuilds, so the two don't go together)."""
    if fixed_buckets and static_graph:
        raise RecipeError(
            "--static-graph rebuilds DDP's buckets after the first step, so a resume on 3+ ranks "
            "is not bitwise; leave --static-graph off for an exact resume"
        )
    return {
        "bucket_cap_mb": bucket_mb,
        "gradient_as_bucket_view": grad_as_bucket_view,
        "static_graph": static_graph,
        "find_unused_parameters": find_unused_parameters or fixed_buckets,
    }


def ddp_options(cfg) -> dict:
    """TrainConfig -> ddp_kwargs(...) (bucket size, views, static graph, unused parameters when the config has it)."""
    return ddp_kwargs(
        bucket_mb=cfg.bucket_mb,
        grad_as_bucket_view=cfg.grad_as_bucket_view,
        static_graph=cfg.static_graph,
        find_unused_parameters=getattr(cfg, "find_unused_parameters", False),
    )


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Names of the BatchNorm layers: each rank normalises with its own batch's statistics and keeps its
    own running mean and variance, so DDP replicas' buffers differ (DDP copies rank 0's into the others
    at each forward, but the final ones differ after the last step)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def to_sync_batchnorm(model: nn.Module, *, device: torch.device) -> nn.Module:
    """BatchNorm layers -> SyncBatchNorm (statistics over the global batch); before DDP wraps the model.

    torch runs SyncBatchNorm on accelerators only: DDP refuses it on CPU ("SyncBatchNorm layers only
    work with GPU modules", torch 2.13), so CPU gets one RecipeError line instead."""
    if device.type == "cpu":
        raise RecipeError(
            "--sync-batchnorm: torch's SyncBatchNorm runs on GPUs only, this job is on CPU; "
            "leave --sync-batchnorm off (each rank then keeps its own BatchNorm statistics)"
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def make_hook(name: str, *, backend: str, powersgd_rank: int = 2, powersgd_start: int = 10) -> tuple | None:
    """(state, hook) for DDP.register_comm_hook, or None for `none`; bf16 off NCCL is a one-line error."""
    if name not in HOOKS:
        raise RecipeError(f"--comm-hook {name}: choose one of {', '.join(HOOKS)}")
    if name == "bf16" and backend != "nccl":  # gloo's all-reduce has no bfloat16 kernels
        raise RecipeError(
            f"--comm-hook bf16 needs the nccl backend (this job uses {backend}); use --comm-hook fp16 or powersgd"
        )
    if name == "powersgd":  # the first powersgd_start steps are plain all-reduces, as PowerSGD's paper advises
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=powersgd_start
        )
        return state, powerSGD_hook.powerSGD_hook
    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    return (None, hooks[name]) if name in hooks else None  # state None: the default process group


def register(ddp: DDP, name: str = "none", *, backend: str, **options) -> DDP:
    """Install hook `name` on a DDP module, once, before its first backward; returns the module."""
    if (hook := make_hook(name, backend=backend, **options)) is not None:
        ddp.register_comm_hook(*hook)
    return ddp


def prepare_batchnorm(model: nn.Module, *, sync: bool, warn: Callable[[str], object]) -> nn.Module:
    """Before DDP wraps the model: BatchNorm layers become SyncBatchNorm when `sync` (GPUs only: one
    RecipeError line on CPU); without it, `warn` gets one line naming them (the model is returned as it is)."""
    names = batchnorm_layers(model)
    if not names:
        return model
    if sync:
        device = next(model.parameters(), torch.empty(0)).device
        return to_sync_batchnorm(model, device=device)
    warn(
        f"warning: BatchNorm layers {', '.join(names)} normalise with each rank's own batch and keep per-rank "
        f"running statistics, so the replicas' buffers end up different; --sync-batchnorm (GPUs) shares them"
    )
    return model


def replicas_report(model: nn.Module) -> dict:
    """{"replicas_identical": bool} for the summary (a collective: every rank calls it), and, when they
    differ and the model has unsynchronised BatchNorm layers, "replicas_differ": why."""
    from core.dist import same_on_all_ranks  # here: core.comm is imported by the DDP recipes before init_pg
    from core.models import fingerprint

    report = {"replicas_identical": same_on_all_ranks(fingerprint(model))}
    unsynced = [n for n in batchnorm_layers(model) if not isinstance(model.get_submodule(n), nn.SyncBatchNorm)]
    if not report["replicas_identical"] and unsynced:
        report["replicas_differ"] = f"BatchNorm running statistics are per rank ({', '.join(unsynced)})"
    return report


def wrap_ddp(model: nn.Module, *, device: torch.device, comm_hook: str | None = None, **ddp_options) -> DDP:
    """DistributedDataParallel: params broadcast from rank 0 now, gradients averaged in backward().

    comm_hook: "fp16", "bf16" or "powersgd" installs that core.comm hook ("none" or None: DDP's own reducer);
    ddp_options: DDP's keyword arguments, e.g. core.comm.ddp_options(cfg) (bucket size, static graph)."""
    device_ids = [device.index] if device.type == "cuda" else None  # CPU modules take none
    ddp = DDP(model, device_ids=device_ids, **ddp_options)
    if comm_hook is not None:
        register(ddp, comm_hook, backend=torch.distributed.get_backend())
    return ddp
