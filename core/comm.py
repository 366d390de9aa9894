"""DDP's keyword arguments for a bitwise resume at any world size (`fixed_buckets`); the comm hooks (fp16, bf16,
PowerSGD) and the bucket options a run takes are the comm_hook plug-in's (core/plugins/comm_hook.py)."""

from __future__ import annotations

from core.kernel.job import RecipeError


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
