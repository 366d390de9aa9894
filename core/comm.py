"""How DDP moves gradients: comm hooks (fp16, bf16, PowerSGD) and bucket options.

    ddp = DistributedDataParallel(model, ..., bucket_cap_mb=cfg.bucket_mb, gradient_as_bucket_view=...)
    comm.register(ddp, cfg.comm_hook, backend=topo.backend)   # once, before the first backward

`none` keeps DDP's own C++ reducer (it fuses the copy into the bucket with the division by the world
size; a Python hook doing the same costs an extra pass over the gradients, ~2% of a CPU step here).
What the others do to the numbers: `fp16`/`bf16` round each bucket to 16 bits before the all-reduce
(half the bytes, ~1e-3 relative error per step); `powersgd` sends a rank-r approximation of each
weight-gradient matrix with error feedback (far fewer bytes, approximate; its state is not
checkpointed, so a resumed run is close to, not bitwise equal to, an uninterrupted one).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from core.kernel.options import Options, RecipeError, option

HOOKS = ("none", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class CommOptions(Options):
    title = "gradient communication"
    comm_hook: str = option(
        "none", "gradient all-reduce: plain, compressed to fp16/bf16, or PowerSGD low-rank", choices=HOOKS
    )
    bucket_mb: float = option(
        25.0,
        "DDP gradient bucket size in MB (one all-reduce per bucket)",
        check=lambda v: 0 < v <= 1e5,
        fix="use a size in MB from above 0 to 100000 (25: DDP's)",
    )
    grad_as_bucket_view: bool = option(False, "gradients are views into DDP's buckets (saves a copy and memory)")


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


def check_hook(name: str, *, backend: str) -> None:
    """One RecipeError line for a hook that does not exist, or that `backend` cannot run."""
    if name not in HOOKS:
        raise RecipeError(f"--comm-hook {name}: choose one of {', '.join(HOOKS)}")
    if name == "bf16" and backend != "nccl":  # gloo's all-reduce has no bfloat16 kernels
        raise RecipeError(
            f"--comm-hook bf16 needs the nccl backend (this job uses {backend}); use --comm-hook fp16 or powersgd"
        )


def register(ddp: DDP, name: str, *, backend: str) -> DDP:
    """Install hook `name` on a DDP module, once, before its first backward (`none`: DDP's own reducer, no hook)."""
    check_hook(name, backend=backend)
    if name == "powersgd":  # rank-2 approximations; the first 10 steps plain all-reduces, as PowerSGD's paper advises
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    compress = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    if name in compress:
        ddp.register_comm_hook(None, compress[name])  # state None: the default process group
    return ddp
