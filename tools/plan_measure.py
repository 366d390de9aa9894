"""The plan's check: a recipe's real training steps on this rank (the plan's layout on real tensors, wrapped as
the recipe wraps it), measured by torch's MemTracker."""

from __future__ import annotations

import functools

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from core import accum, schedules
from core.kernel.step import step_plain
from core.kernel.train import Topology, to_device
from core.mesh import build_mesh
from tools.options import parse_args
from tools.plan import first_batch, recipe_loss
from tools.plan_layout import EXACT_LOSS, REPLICAS, build_layout, held_bytes, mesh_dims
from tools.plan_step import quiet, tensors
from tools.registry import RECIPES


def measure(topo: Topology, name: str, args: list[str]) -> dict[str, int]:
    """Two real training steps of recipe `name` with `args` on this rank: the peak of live tensor bytes, and what
    its parameters, gradients and optimizer state hold after them."""
    cfg = parse_args(RECIPES[name].load().Config, list(args))[0]
    torch.manual_seed(cfg.seed)
    if topo.device.type == "cuda":  # the allocator's own peak, from here: bench/gpu_check.sh compares it too
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(topo.device)
    dims = mesh_dims(name, cfg, topo.world_size)
    mesh = build_mesh(topo, dims) if dims else None
    batch = to_device(first_batch(cfg), topo.device)
    micro_batches = [batch] * getattr(cfg, "accum", 1)
    with quiet():
        layout = build_layout(name, cfg, device_mesh=mesh, device=topo.device)
        if name == "pipeline":
            optimizer, peak = _measure_pipeline(cfg, layout, micro_batches, mesh=mesh, device=topo.device)
            return _held(layout, optimizer, peak)
        tracker = track([*layout.modules, *tensors(micro_batches)])
        with tracker:
            model = _wrapped(name, layout.model, cfg)  # inside: the tracker sees DDP's buckets made
            optimizer = torch.optim.AdamW(layout.params, lr=cfg.lr)
            loss_fn = recipe_loss(name, cfg, layout.model)
            if name in EXACT_LOSS:
                dp_group = mesh["dp"].get_group() if mesh is not None else None
                how = {"precision": layout.autocast, "sync": layout.sync, "dp_group": dp_group}
                step = functools.partial(accum.step_amp, model, micro_batches, **how)
            else:
                step = functools.partial(step_plain, model, micro_batches[0])
            for _ in range(2):
                step(optimizer=optimizer, loss_fn=loss_fn)
        return _held(layout, optimizer, peak_of(tracker))


def _held(layout, optimizer, peak: int) -> dict[str, int]:
    params = [p for m in layout.modules for p in m.parameters()]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    device = params[0].device
    cuda = {}
    if device.type == "cuda":  # what the allocator saw: its peak, and what it reserved from the driver for it
        cuda = {
            "cuda_peak_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    return cuda | {
        "peak_bytes": peak,
        "params_bytes": held_bytes(params),
        "grads_bytes": held_bytes([p.grad for p in params if p.grad is not None]),
        "optimizer_bytes": held_bytes(state),
    }


def _wrapped(name: str, model, cfg):
    """The recipe's wrapper with its options: DDP as ddp, ddp_amp and ddp_monitored make it; DataParallel."""
    if name in REPLICAS:
        device = next(model.parameters()).device
        options = {"find_unused_parameters": cfg.find_unused_parameters, "static_graph": cfg.static_graph}
        if name == "ddp_monitored":
            options |= {"bucket_cap_mb": cfg.bucket_mb, "gradient_as_bucket_view": cfg.grad_as_bucket_view}
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None, **options)
    return torch.nn.DataParallel(model) if name == "dp" else model


def _measure_pipeline(cfg, layout, micro_batches: list, *, mesh, device) -> tuple:
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    runners = [PipelineStage(m, i, layout.num_stages, device, group=pp_group) for i, m in layout.stages]
    loss_fn = schedules.TokenLoss()
    micro = cfg.microbatches * cfg.accum
    schedule = schedules.build_schedule(cfg.schedule, runners, microbatches=micro, loss_fn=loss_fn)
    holds_last = layout.stages[-1][0] == layout.num_stages - 1
    how = dict(holds_last=holds_last, precision=cfg.precision, clip=cfg.clip, dp_group=dp_group, pp_group=pp_group)
    tracker = track([*layout.modules, *tensors(micro_batches)])
    with tracker:
        optimizer = torch.optim.AdamW(layout.params, lr=cfg.lr)
        for _ in range(2):
            batch = tuple(torch.cat(parts) for parts in zip(*micro_batches))  # --accum batches as one
            schedules.step_pipeline(schedule, batch, loss_fn=loss_fn, optimizer=optimizer, **how)
    return optimizer, peak_of(tracker)


class StepTracker(MemTracker):
    """torch's MemTracker without its per-module hooks, which a module run many times in one step (accumulation,
    micro-batches) or pipelining's autograd.grad would trip over."""

    def __init__(self, modules) -> None:
        super().__init__()
        self._modules = list(modules)

    def __enter__(self) -> StepTracker:
        self._fake_mode_on_entry = active_fake_mode()
        self._register_global_optimizer_hook()
        for module in self._modules:  # gradients counted as gradients, as the module hooks would install
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
        self._track_resize()
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args) -> None:
        self._deregister_param_and_optimizer_hooks()
        self._restore_resize()
        TorchDispatchMode.__exit__(self, *args)


def track(tensors) -> StepTracker:
    """A StepTracker that counts these tensors (modules, optimizers, the batch) made before it starts."""
    tracker = StepTracker(t for t in tensors if isinstance(t, torch.nn.Module))
    tracker.track_external(*tensors)
    return tracker


def peak_of(tracker: MemTracker) -> int:
    """The tracker's peak over every device."""
    return sum(snapshot.get("Total", 0) for snapshot in tracker.get_tracker_snapshot("peak").values())
