"""The memory plan: what each rank of a recipe will hold, before anything is launched, in seconds on a CPU.

    python -m recipes plan fsdp --model mypkg:llama --batch-size 8 --nproc 8 --device-memory 80

Each rank's layout (plan_layout) takes a step (plan_step) on fake tensors in a fake process group; plan_fixed adds
what no tracker sees, plan_report prints the plan and what would fit (docs/memory-plan.md).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree

from core.exact_loss import make_exact_loss
from core.kernel.job import RecipeError
from core.kernel.train import Topology
from tools.plan_fixed import GIB
from tools.plan_layout import EXACT_LOSS, build_layout, mesh_dims, pipeline_buffers, schedule_order, unplannable
from tools.plan_step import planned_steps, quiet
from tools.precheck import check_data, check_model
from tools.probes import collated, first_samples, loss_of
from tools.registry import RECIPES


@dataclass(frozen=True)
class RankPlan:
    rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    peak_bytes: int
    buffers_bytes: int = 0  # DDP's gradient buckets (in the peak; not in the JSON's fixed keys)
    notes: tuple[str, ...] = ()  # what the layout holds at once: FSDP's gathered unit, a pipeline's micro-batches


@dataclass(frozen=True)
class Plan:
    recipe: str
    world_size: int
    ranks: list[RankPlan]

    @property
    def largest(self) -> RankPlan:
        return max(self.ranks, key=lambda r: (r.peak_bytes, -r.rank))

    def to_json(self) -> dict:
        keys = ("rank", "params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes")
        ranks = [{k: getattr(r, k) for k in keys} for r in self.ranks]
        return {"recipe": self.recipe, "world_size": self.world_size, "ranks": ranks}


def plan_recipe(name: str, cfg, *, world_size: int, gpu: bool | None = None) -> Plan:
    """The plan of recipe `name` with options `cfg` on `world_size` ranks; `gpu` (default: this machine's) plans
    AdamW's multi-tensor step and the caching allocator's 512-byte unit."""
    if reason := unplannable(name, cfg):
        raise RecipeError(f"plan: cannot plan {reason}")
    _recipe_check(name, cfg, world_size=world_size)
    if name in ("dp", "pipeline_naive") and world_size != 1:
        raise RecipeError(f"--nproc {world_size}: {name} runs one process; plan it with --nproc 1")
    if torch.distributed.is_initialized():
        raise RecipeError("plan: a process group already exists in this process; plan before any is made")
    gpu = torch.cuda.is_available() if gpu is None else gpu
    dims = mesh_dims(name, cfg, world_size)
    batch = first_batch(cfg)
    pp = dims.get("pp", 1)  # the pipeline's ranks differ by stage; every other layout's ranks hold alike
    planned = [_plan_rank(name, cfg, batch, rank=r, world_size=world_size, dims=dims, gpu=gpu) for r in range(pp)]
    ranks = [dataclasses.replace(planned[r % pp], rank=r) for r in range(world_size)]
    return Plan(name, world_size, ranks)


def _recipe_check(name: str, cfg, *, world_size: int) -> None:
    """The recipe's own checks (mesh sizes, heads, stages) at this WORLD_SIZE: what it would refuse is not planned."""
    module = RECIPES[name].load()
    if hasattr(module, "check"):
        with mock.patch.dict(os.environ, WORLD_SIZE=str(world_size)):
            module.check(cfg)


def first_batch(cfg):
    """One rank's first batch, as the recipe's loader collates it: the shapes the plan runs on."""
    found = check_data(cfg.data, streams=True, recipe="plan")  # the pre-check's one-line refusals of a factory
    train, collate = found["train"], found["collate"]
    samples = first_samples(train, cfg.batch_size, spec=cfg.data)
    if len(samples) < cfg.batch_size:
        raise RecipeError(f"--batch-size {cfg.batch_size}: the training set holds {len(samples)} samples; use fewer")
    return collated(samples, collate, spec=cfg.data)


def _plan_rank(name: str, cfg, batch, *, rank: int, world_size: int, dims: dict, gpu: bool) -> RankPlan:
    from tools.plan_layout import held_bytes

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        topo = Topology(rank, world_size, torch.device("cpu"))
        mesh = None
        if dims:  # before fake mode: init_device_mesh reads the ranks' values
            from core.mesh import build_mesh

            mesh = build_mesh(topo, dims)
        with quiet(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
            with _mesh_math_on_real_tensors():
                layout = _built(name, cfg, mesh=mesh, build=check_model)
            fake = pytree.tree_map_only(torch.Tensor, mode.from_tensor, batch)
            micro_batches = [fake] * getattr(cfg, "accum", 1)
            order = None
            if name == "pipeline":
                count = cfg.microbatches * cfg.accum
                if isinstance(fake, dict):  # as core.schedules.step_pipeline: the schedule takes (input, target)
                    raise RecipeError(f"--data {cfg.data}: pipeline trains on (input, target) pairs, not dicts")
                pipeline_buffers(layout, fake[0].chunk(cfg.microbatches)[0], microbatches=count)
                order = schedule_order(cfg, layout, pp_rank=rank, microbatches=count, group=mesh["pp"].get_group())
            loss_fn = recipe_loss(name, cfg, layout.model)
            step = functools.partial(
                planned_steps, name, layout, micro_batches, cfg=cfg, loss_fn=loss_fn, gpu=gpu, order=order
            )
            terms = _traced(step, layout.modules)  # the step's peak, and its grads, optimizer and activations bytes
            params = held_bytes([p for m in layout.modules for p in m.parameters()])  # exact, from shapes and dtypes
            return RankPlan(rank, params, **terms, buffers_bytes=layout.bucket_bytes, notes=_notes(name, layout, order))
    finally:
        torch.distributed.destroy_process_group()


def _built(name: str, cfg, *, mesh, build):
    """The layout on fake tensors, or one line naming the step of the build that fake tensors could not take."""
    try:
        return build_layout(name, cfg, device_mesh=mesh, build=build)
    except RecipeError:
        raise
    except Exception as err:
        what = f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
        raise RecipeError(
            f"plan: cannot build {name}'s layout of --model {cfg.model} on fake tensors ({what}); "
            f"plan another layout of it, or measure a real step"
        ) from None


def _mesh_math_on_real_tensors():
    """A DeviceMesh that fully_shard joins finds its coordinates with nonzero(): on the real, small mesh tensor."""
    original = DeviceMesh._compute_coordinate_on_dim

    def on_real_tensors(self):
        with unset_fake_temporarily():
            return original(self)

    return mock.patch.object(DeviceMesh, "_compute_coordinate_on_dim", on_real_tensors)


def _notes(name: str, layout, order) -> tuple[str, ...]:
    from tools.plan_layout import gathered_bytes, in_flight

    if name in ("fsdp", "fsdp_tp"):
        return (f"the largest unit gathered at once: {gathered_bytes(layout.model) / GIB:.3g} GiB",)
    if name == "pipeline":
        count = max(mb for _, _, mb in order) + 1
        return (f"micro-batches in flight: {in_flight(order)} of {count}",)
    return ()


def recipe_loss(name: str, cfg, model):
    """The recipe's loss, taken as the recipe takes it."""
    if name == "pipeline":
        return None
    loss = loss_of(cfg.loss, model)
    return make_exact_loss(loss, model=model) if name in EXACT_LOSS else loss


def _traced(run, modules: list):
    """The plan's step, or one line naming the innermost module (or the backward) that fake tensors could not follow."""
    names = {m: f"{n or 'the model'} ({type(m).__name__})" for root in modules for n, m in root.named_modules()}
    running: list[str] = []

    def enter(module, args) -> None:
        running.append(names.get(module, type(module).__name__))

    def leave(module, args, out) -> None:  # returns None: a forward hook's value would replace the output
        del running[-1:]

    pre, post = register_module_forward_pre_hook(enter), register_module_forward_hook(leave)
    try:
        return run()
    except RecipeError:
        raise
    except Exception as err:  # the user's model on fake tensors
        part = f"the forward of {running[-1]}" if running else "the loss or the backward"
        what = f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
        raise RecipeError(
            f"plan: cannot plan {part}: on fake tensors it failed ({what}); data-dependent shapes, values read "
            f"in Python and custom kernels cannot be planned without running them: measure a real step instead"
        ) from None
    finally:
        pre.remove()
        post.remove()
