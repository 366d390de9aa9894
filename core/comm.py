"""How DDP moves gradients: comm hooks (fp16, bf16, PowerSGD) and bucket options.

    ddp = parallel.wrap_ddp(model, device=topo.device, comm_hook=cfg.comm_hook, **comm.ddp_options(cfg))

`none` keeps DDP's own C++ reducer (it fuses the copy into the bucket with the division by the world
size; a Python hook doing the same costs an extra pass over the gradients, ~2% of a CPU step here).
What the others do to the numbers: `fp16`/`bf16` round each bucket to 16 bits before the all-reduce
(half the bytes, ~1e-3 relative error per step); `powersgd` sends a rank-r approximation of each
weight-gradient matrix with error feedback (far fewer bytes, approximate; its state is not
checkpointed, so a resumed run is close to, not bitwise equal to, an uninterrupted one).
"""
from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from core.config import RecipeError

HOOKS = ("none", "fp16", "bf16", "powersgd")


def ddp_options(cfg) -> dict:
    """TrainConfig -> DistributedDataParallel keyword arguments (bucket size, views, static graph)."""
    return {"bucket_cap_mb": cfg.bucket_mb, "gradient_as_bucket_view": cfg.grad_as_bucket_view,
            "static_graph": cfg.static_graph}


def make_hook(name: str, *, backend: str, powersgd_rank: int = 2, powersgd_start: int = 10) -> tuple | None:
    """(state, hook) for DDP.register_comm_hook, or None for `none`; bf16 off NCCL is a one-line error."""
    if name not in HOOKS:
        raise RecipeError(f"--comm-hook {name}: choose one of {', '.join(HOOKS)}")
    if name == "bf16" and backend != "nccl":  # gloo's all-reduce has no bfloat16 kernels
        raise RecipeError(f"--comm-hook bf16 needs the nccl backend (this job uses {backend}); "
                          f"use --comm-hook fp16 or powersgd")
    if name == "powersgd":  # the first powersgd_start steps are plain all-reduces, as PowerSGD's paper advises
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=powersgd_start)
        return state, powerSGD_hook.powerSGD_hook
    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    return (None, hooks[name]) if name in hooks else None  # state None: the default process group


def register(ddp: DDP, name: str = "none", *, backend: str, **options) -> DDP:
    """Install hook `name` on a DDP module, once, before its first backward; returns the module."""
    if (hook := make_hook(name, backend=backend, **options)) is not None:
        ddp.register_comm_hook(*hook)
    return ddp
