"""The memory plan's layouts: what one rank of a recipe holds, built call for call as the recipe builds it, on
whatever tensors are current (fake ones for a plan, real ones for tools/plan_measure.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from core import amp, schedules
from core.kernel.job import RecipeError
from tools.precheck import check_model
from tools.registry import RECIPES

REPLICAS = ("ddp", "ddp_amp", "ddp_monitored")  # a whole replica on each rank, and DDP's buckets
EXACT_LOSS = ("ddp_amp", "fsdp", "tensor_parallel", "fsdp_tp")  # core.exact_loss's step (accum.step_amp)


@dataclass
class Layout:
    """One rank's part of a recipe: the module its step calls, the parameters its optimizer holds."""

    model: nn.Module
    params: list[nn.Parameter]
    sync: object = amp.grad_sync  # how the first K-1 micro-batches hold the gradient reduction back
    autocast: str = "fp32"  # the step's autocast precision (fully_shard's policy casts instead)
    bucket_bytes: int = 0  # DDP's gradient buckets: allocated by the reducer, one copy of the gradients
    stages: list = field(default_factory=list)  # pipeline: this rank's stages, with their stage indices
    num_stages: int = 0
    recv: dict = field(default_factory=dict)  # pipeline: stage -> a receive buffer per micro-batch (inputs)
    grad_recv: dict = field(default_factory=dict)  # pipeline: stage -> a receive buffer per micro-batch (gradients)

    @property
    def modules(self) -> list[nn.Module]:
        """What this rank holds: its stages, or the model."""
        return [m for _, m in self.stages] or [self.model]


def mesh_dims(name: str, cfg, world_size: int) -> dict[str, int]:
    """The device mesh the recipe builds (its own `mesh` where it has one); {} for DDP and one process."""
    if name in ("fsdp", "tensor_parallel", "fsdp_tp", "pipeline"):
        return RECIPES[name].load().mesh(cfg, world_size)
    return {}


def unplannable(name: str, cfg) -> str | None:
    """An option whose memory a plan cannot follow, named in one line (never a low number instead)."""
    if getattr(cfg, "compile", False):
        return (
            "--compile: torch.compile fuses kernels and chooses what to keep for backward only when it runs, so "
            "the plan cannot follow it; plan without --compile (compile usually keeps less, not always)"
        )
    if getattr(cfg, "balance", "params") == "time":
        return "--balance time: the stages' cut depends on measured times; plan with --balance params"
    if getattr(cfg, "offload", False):
        return "--offload: the shards live in CPU memory; the plan counts device memory without offload"
    return None


def held_bytes(params) -> int:
    """Bytes of the distinct storages these tensors' local parts hold (a DDP bucket once for its gradient views)."""
    seen, total = set(), 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        storage = local.untyped_storage()
        key = id(storage) if isinstance(local, FakeTensor) else storage.data_ptr()
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def build_layout(name: str, cfg, *, device_mesh, build=check_model, device=None) -> Layout:
    """Rank `rank`'s layout of recipe `name`, built on the current tensors (`device`: where a measured run puts it)."""
    model = build(cfg.model)
    if device is not None and name != "pipeline":  # the pipeline moves its stages after the split, as below
        model = model.to(device)
    if name in REPLICAS or name == "dp":
        if getattr(cfg, "channels_last", False) and not isinstance(next(model.parameters(), None), FakeTensor):
            from core.plugins.tuning import to_channels_last  # the recipe's plug-in (ddp_monitored), attached already

            model = to_channels_last(model)  # the same bytes in another order: fake weights cannot be swapped
        if getattr(cfg, "activation_checkpointing", False):
            from core.plugins.tuning import checkpoint_blocks

            checkpoint_blocks(model)
        params = [p for p in model.parameters() if p.requires_grad]
        # DDP's buckets: one copy of the gradients at any world size (backward makes each gradient, views or not)
        buckets = held_bytes(params) if name in REPLICAS else 0
        return Layout(model, params, autocast=getattr(cfg, "precision", "fp32"), bucket_bytes=buckets)
    from core import shard, sp_plan, tp_plan  # here: DTensor and fully_shard load for the layouts that use them

    if name == "fsdp":
        _fully_shard(model, device_mesh["dp"], shard.fsdp_policy(cfg.precision), cfg)
        return Layout(model, list(model.parameters()), sync=shard.fsdp_sync)
    if name in ("tensor_parallel", "fsdp_tp"):
        from torch.distributed.tensor.parallel import parallelize_module

        tp_mesh = device_mesh["tp"]
        sp = getattr(cfg, "sequence_parallel", False)
        plan = sp_plan.sp_plan(model, tp_plan.plan_of(model, tp=tp_mesh.size()), enabled=sp)
        parallelize_module(model, tp_mesh, plan)
        if name == "tensor_parallel":
            return Layout(model, list(model.parameters()), autocast=cfg.precision)
        _fully_shard(model, device_mesh["dp"], shard.fsdp_policy(cfg.precision), cfg)
        return Layout(model, list(model.parameters()), sync=shard.fsdp_sync)
    if name == "pipeline":
        pp, pp_rank = device_mesh["pp"].size(), device_mesh["pp"].get_local_rank()
        return _pipeline_layout(model, cfg, pp=pp, pp_rank=pp_rank, device=device)
    if name == "pipeline_naive":  # one process; on CPU (or one GPU) every block on the one device
        return Layout(model, list(model.parameters()))
    raise RecipeError(f"plan: no memory plan for the recipe {name!r} (a plugin); plan one of the built-in recipes")


def _fully_shard(model: nn.Module, mesh, policy: dict, cfg) -> None:
    from torch.distributed.fsdp import fully_shard

    from core.shard import shard_blocks

    for block in shard_blocks(cfg, model):  # as the recipes shard: each block (--blocks NAME's), then the root
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)


def _pipeline_layout(model: nn.Module, cfg, *, pp: int, pp_rank: int, device=None) -> Layout:
    """This pipeline rank's stages (two for interleaved1f1b); the whole model kept for the shapes between them."""
    per_rank = 2 if cfg.schedule == "interleaved1f1b" else 1
    num_stages, stage_ids = pp * per_rank, [pp_rank + v * pp for v in range(per_rank)]
    stages = [schedules.split_pipeline(model, stage_index=i, num_stages=num_stages) for i in stage_ids]
    stages = [stage.to(device) for stage in stages] if device is not None else stages
    params = [p for m in stages for p in m.parameters()]
    return Layout(model, params, autocast=cfg.precision, stages=list(zip(stage_ids, stages)), num_stages=num_stages)


def schedule_order(cfg, layout: Layout, *, pp_rank: int, microbatches: int, group) -> list[tuple]:
    """This rank's forwards and backwards in the order torch's schedule runs them: [("F"|"B", stage, mb), ...]."""
    m = microbatches
    if cfg.schedule != "interleaved1f1b":
        stage = layout.stages[0][0]
        if cfg.schedule == "gpipe":  # every forward, then every backward
            return [("F", stage, i) for i in range(m)] + [("B", stage, i) for i in range(m)]
        warmup = min(m, layout.num_stages - stage)  # 1F1B: the first stage keeps num_stages forwards in flight
        order = [("F", stage, i) for i in range(warmup)]
        for i in range(m):
            order += [("B", stage, i)] + ([("F", stage, warmup + i)] if warmup + i < m else [])
        return order
    from torch.distributed.pipelining import PipelineStage

    cpu = torch.device("cpu")
    runners = [PipelineStage(module, i, layout.num_stages, cpu, group=group) for i, module in layout.stages]
    schedule = schedules.build_schedule(cfg.schedule, runners, microbatches=m, loss_fn=None)
    kinds = ("F", "B")  # torch's _ComputationType values: forward, full backward
    actions = [a for a in schedule.pipeline_order[pp_rank] if a is not None and a.computation_type.value in kinds]
    return [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in actions]


@torch.no_grad()
def pipeline_buffers(layout: Layout, micro_input: torch.Tensor, *, microbatches: int) -> None:
    """PipelineStage's receive buffers per micro-batch: inputs (but the first stage's), gradients (but the last's)."""
    starts = {stage.indices[0]: index for index, stage in layout.stages}
    x, entering = micro_input, {}
    for i, block in enumerate(layout.model.blocks):  # fake tensors: shapes only
        entering.update({starts[i]: x} if i in starts else {})
        x = block(x)
    for index, stage in layout.stages:
        if index > 0:  # torch's buffer takes the received activations and, in backward, their gradient
            layout.recv[index] = [torch.empty_like(entering[index]).requires_grad_() for _ in range(microbatches)]
        if index < layout.num_stages - 1:
            out = stage(entering[index])
            layout.grad_recv[index] = [torch.empty_like(out) for _ in range(microbatches)]


def gathered_bytes(model: nn.Module) -> int:
    """FSDP2: the bytes of the largest unit's parameters gathered whole (in the compute dtype); 0 without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    largest = 0
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is not None:
            sizes = [p._orig_size.numel() * (p.param_dtype or p.orig_dtype).itemsize for p in group.fsdp_params]
            largest = max(largest, sum(sizes))
    return largest


def in_flight(order: list[tuple]) -> int:
    """The most micro-batches whose forward has run and backward not yet, in this rank's schedule order."""
    return max(itertools.accumulate(1 if kind == "F" else -1 for kind, _, _ in order), default=0)
