"""fsdp_tp: fsdp across groups, tensor parallel inside each group of --tp ranks (a dp x tp mesh).

    NPROC_PER_NODE=4 ./launch_single_node.sh fsdp_tp --tp 2 --max-steps 100
    torchrun --standalone --nproc-per-node 4 -m recipes run fsdp_tp --tp 2 --accum 2 --clip 1.0
    ./launch_single_node.sh fsdp_tp --tp 2        # 2 processes: tp=2, dp=1 (tensor parallel only)

Ranks form a dp x tp mesh (rank = dp_index * tp + tp_index, so a tensor-parallel group is
neighbouring ranks, the ones on one node's fast link). Within a group, the Linear layers are split
column/row-wise as in tensor_parallel (the model's own plan, or the built-in GPT's) and all its ranks
see the same batch; across groups, fully_shard shards those DTensor slices again and averages
gradients as in fsdp, each group taking its own share of the data. Global batch: --batch-size x dp x
--accum. The world size must be a multiple of --tp. --clip takes the norm over both meshes;
checkpoints are sharded and resume at another dp. Rank 0 gathers the full weights into one file.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import parallel

import core.attach  # noqa: F401 - the package runs it with its plug-ins; a standalone copy joins those --with names
from core.accum import Accumulation, check_step, make_loaders, micro_batch_groups, step_amp
from core.exact_loss import make_exact_loss
from core.gpt_builtin import build_gpt, build_text, gpt_defaults
from core.kernel.job import Checkpointing, Options, RecipeError, Training, cli_main, option
from core.kernel.loss import make_loss
from core.kernel.seams import SEAMS, fire
from core.kernel.store import finished, open_run
from core.kernel.train import Tally, Topology, cleanup_pg, init_pg, log_eval, log_summary, log_train, not_training
from core.mesh import ShardedPrecision, build_mesh, evaluate_sharded, whole_model
from core.plugins import blocks, loss_counts, model_plans, stream, trackers  # noqa: F401 - its own plug-ins
from core.shard import fsdp_policy, fsdp_sync, shard_blocks
from core.shard_ckpt import load_sharded, save_sharded
from core.tp_plan import plan_of


def mesh(cfg: Config, world_size: int) -> dict[str, int]:
    """The device mesh: dp groups of tp neighbouring ranks."""
    return {"dp": max(world_size // cfg.tp, 1), "tp": cfg.tp}


def check(cfg: Config) -> None:
    """What is refused before any process starts (the pre-check calls it too): a bad world size or --tp."""
    if (world := int(os.environ.get("WORLD_SIZE", "1"))) % cfg.tp:
        raise RecipeError(f"--tp {cfg.tp}: the world size {world} is not a multiple of it; use a divisor of {world}")
    with torch.device("meta"):  # shapes only: no memory
        model = build_gpt(cfg)
    plan_of(model, tp=cfg.tp)  # the plan splits every layer into whole shards, else one line


def main(cfg: Config) -> dict:
    check(cfg)
    topo = init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: Topology) -> dict:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # logits are views, never edited in place
    if done := finished(cfg, topo, recipe="fsdp_tp"):  # resumed, finished: nothing is touched
        return done

    # Build: slice within each tp group first, then shard those slices across the dp groups.
    torch.manual_seed(cfg.seed)  # the same weights and data on every rank (--data's factory: its own seeds)
    train_set, val_set, collate = build_text(cfg)
    model = build_gpt(cfg).to(topo.device)
    fire("after_build", cfg, model)  # the whole weights into the plain model (--init-from): each rank keeps its part
    device_mesh = build_mesh(topo, mesh(cfg, topo.world_size))
    dp_mesh, tp_mesh = device_mesh["dp"], device_mesh["tp"]
    plan = plan_of(model, tp=tp_mesh.size())  # which Linear layers split by column, which by row
    parallel.parallelize_module(model, tp_mesh, plan)
    # bf16 compute, fp32 gradient reduction; the repeated blocks (or --blocks NAME's), each gathered while it runs
    for block in [*shard_blocks(cfg, model), model]:  # the root last: it holds what no block does
        fully_shard(block, mesh=dp_mesh, **fsdp_policy(cfg.precision))
    my_group = Topology(dp_mesh.get_local_rank(), dp_mesh.size(), topo.device)  # a tp group shares its data
    torch.manual_seed(cfg.seed + my_group.rank)  # each dp group its own dropout; a tp group one stream (DTensor)
    # A stream (an IterableDataset) is read in order and dealt out by position; map-style data by a seeded sampler.
    train_loader, val_loader, total = make_loaders(cfg, my_group, train_set, val_set, collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # built after sharding: it holds this rank's shards
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    # The model's own loss, else cross-entropy; every counted target of the global batch weighs the same, across
    # ranks and micro-batches.
    loss_fn = make_exact_loss(make_loss(cfg, model), model=model)

    # The run folder, new or resumed (refused before it is touched when the checkpoint cannot continue), and the
    # checkpoint's state: every rank reads its own shards, resharded to this job's dp.
    global_batch = cfg.batch_size * my_group.world_size * cfg.accum  # x dp, not x world: a tp group shares one batch
    run = open_run(cfg, topo, recipe="fsdp_tp", global_batch=global_batch)
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler)  # what a checkpoint holds, with the generators
    start = load_sharded(run, **state)
    totals = Tally(topo.device, start["window"])  # each log window's loss and accuracy (and the checkpoint's open one)

    # Train. K micro-batches a step; the gradients are reduce-scattered over dp in the last one's backward only.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    options = dict(optimizer=optimizer, loss_fn=loss_fn, clip=cfg.clip, sync=fsdp_sync, dp_group=dp_mesh.get_group())
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        train_loader.sampler.set_epoch(epoch, consumed=consumed)
        # K batches a step, an incomplete tail dropped; at most total - step of them (--max-steps)
        for _, group in zip(range(total - step), micro_batch_groups(train_loader, cfg.accum, device=topo.device)):
            metrics, stats = step_amp(model, group, **options)  # bf16: in fully_shard's policy, no autocast
            step, consumed = step + 1, consumed + global_batch
            skipped += check_step(stats, step=step, on_nonfinite=cfg.on_nonfinite)
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            # one rank per tp group counts the group's batch
            totals.add(metrics if tp_mesh.get_local_rank() == 0 else {k: v * 0 for k, v in metrics.items()})
            fire("on_step", metrics)  # the training clock
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                lr, norm = scheduler.get_last_lr()[0], stats.grad_norm
                log_train(run, totals, step=step, total=total, epoch=epoch, lr=lr, grad_norm=norm, skipped=skipped)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                with not_training():  # every rank writes its own shard
                    progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=totals.reduce())
                    save_sharded(run, **state, progress=progress, keep=cfg.keep)
        with not_training():  # a tp group's ranks count alike, each forward a collective: the means are right
            evaluation = evaluate_sharded(model, val_loader, loss_fn=loss_fn, device=topo.device)
        log_eval(run, evaluation, step=step, epoch=epoch)

    # Every rank gathers the whole weights (its own buffers: the summary says whether they agree); rank 0 writes them.
    whole, saved = whole_model(model, lambda: build_gpt(cfg), run)
    numbers = dict(steps=step, skipped_steps=skipped, weights=saved, tp=tp_mesh.size(), dp=my_group.world_size)
    return log_summary(cfg, run, whole, totals, evaluation, **numbers)


# Options and start: in a standalone copy these come last, after everything they use.
@dataclass(frozen=True)
class Mesh(Options):
    """2-D parallelism"""

    tp: int = option(2, "tensor-parallel group size (ranks per group); dp = world size / tp", low=1)


@dataclass(frozen=True)
class Config(*gpt_defaults([Training, Checkpointing, Mesh, ShardedPrecision, Accumulation, *SEAMS["option_groups"]])):
    """fsdp_tp's options (the GPT on text by default), and those of the plug-ins it was joined with."""


if __name__ == "__main__":
    cli_main(main, Config)
