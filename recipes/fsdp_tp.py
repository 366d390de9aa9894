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

import dataclasses
import itertools
import os
import warnings
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from core import (
    amp,
    data,
    dcp,
    dist,
    exact_loss,
    folder,
    meter,
    models,
    parallel,
    stream,
    tp_plan,
    trackers,
    weights,
)
from core.amp import Accumulation
from core.config import Checkpointing, Training, cli_main, with_default
from core.kernel.loader import seed_all, set_epoch
from core.kernel.options import RecipeError, at_least, option
from core.kernel.pg import cleanup_pg
from core.loss import make_loss
from core.loss_options import choose_loss
from core.parallel import ShardedPrecision
from core.plugins import model_plans  # noqa: F401 - a transformers model's own plan
from core.plugins.hf import HFExport, write_hf_folder
from core.plugins.init_from import InitFrom, load_weights
from core.plugins.replicas import replicas_report


@dataclass(frozen=True)
class Config(Training, Checkpointing, ShardedPrecision, Accumulation, trackers.Tracking, InitFrom, HFExport):
    """fsdp's options without --offload, and the tensor-parallel group size; the tiny GPT on the text by default."""

    title = "2-D parallelism"

    model: str = with_default(Training, "model", "gpt")
    data: str = with_default(Training, "data", "text")
    epochs: int = with_default(Training, "epochs", 1)
    lr: float = with_default(Training, "lr", 3e-3)
    tp: int = option(2, "tensor-parallel group size (ranks per group); dp = world size / tp", **at_least(1))
    blocks: str = option("", "the nn.ModuleList of blocks to shard one by one, e.g. transformer.h (default: found)")


def mesh(cfg: Config, world_size: int) -> dict[str, int]:
    """The device mesh: dp groups of tp neighbouring ranks."""
    return {"dp": max(world_size // cfg.tp, 1), "tp": cfg.tp}


def check(cfg: Config) -> None:
    """Everything refusable, before any process starts: the mesh, the model's plan and blocks (meta device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % cfg.tp:
        raise RecipeError(
            f"--tp {cfg.tp}: the world size {world} is not a multiple of it, so no dp x tp mesh "
            f"can be built; launch a multiple of {cfg.tp} processes or use --tp {world}"
        )
    with torch.device("meta"):  # shapes only: the plan splits into tp whole shards, and the blocks are found
        model = models.build_model(cfg.model)
    tp_plan.check_tp_plan(model, tp=cfg.tp)  # the plan splits every layer into whole shards, else one line
    if cfg.blocks:  # --blocks NAME must name a container of the model
        parallel.named_blocks(model, cfg.blocks)


def main(cfg: Config) -> dict:
    check(cfg)  # a copy has no pre-check: the same refusals here
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: dist.Topology) -> dict:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # logits are views, never edited in place
    totals = meter.Meter(topo.device)  # the loss and accuracy of each log window, summed over the ranks
    # resumed and finished, with the lengths it finished with: nothing is touched (larger ones: it trains longer)
    if done := folder.finished(cfg, topo, recipe="fsdp_tp", header=dcp.read_metadata):
        return done
    plan_dims = mesh(cfg, topo.world_size)
    global_batch = cfg.batch_size * plan_dims["dp"] * cfg.accum  # a tp group shares one batch

    # Build: slice within each tp group first, then shard those slices across the dp groups.
    seed_all(cfg.seed)  # torch's, Python's and numpy's generators: the same weights and data on every rank
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    if cfg.init_from:  # the whole weights into the plain model: each rank then keeps its part of them
        load_weights(model, cfg.init_from)
    device_mesh = parallel.build_mesh(topo, plan_dims)
    dp_mesh, tp_mesh = device_mesh["dp"], device_mesh["tp"]
    plan = tp_plan.plan_of(model)  # which Linear layers split by column, which by row (the plan checked in check)
    with tp_plan.tp_kept(model, plan, tp=tp_mesh.size()):  # a tied lm_head stays tied
        parallelize_module(model, tp_mesh, plan)
    policy = parallel.fsdp_policy(cfg.precision)  # bf16 compute, fp32 gradient reduction
    if cfg.blocks:  # --blocks NAME: that nn.ModuleList's blocks
        found = parallel.named_blocks(model, cfg.blocks)
    else:  # the model's repeated blocks (GPT-2's transformer.h, Llama's model.layers, the GPT's blocks)
        found = parallel.find_blocks(model)
    for block in parallel.shard_units(model, found):
        fully_shard(block, mesh=dp_mesh, **policy)
    fully_shard(model, mesh=dp_mesh, **policy)
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    torch.manual_seed(cfg.seed + dp_rank)  # each dp group its own dropout; a tp group one stream, as DTensor needs
    my_group = dataclasses.replace(topo, rank=dp_rank, world_size=dp)  # a tp group shares its data
    if stream.is_stream(train_set):  # an IterableDataset: read in order and dealt out by position, no sampler
        train_loader = stream.make_loader(train_set, my_group, batch_size=cfg.batch_size, collate_fn=collate)
        val_loader = stream.make_loader(val_set, my_group, batch_size=cfg.batch_size, train=False, collate_fn=collate)
        total = stream.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps, accum=cfg.accum)
    else:
        options = {"batch_size": cfg.batch_size, "collate_fn": collate}
        train_loader = data.make_loader(train_set, my_group, seed=cfg.seed, **options)
        val_loader = data.make_loader(val_set, my_group, train=False, **options)
        total = data.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps, accum=cfg.accum)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # built after sharding: it holds this rank's shards
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = make_loss(model=model)  # the model's own loss, else cross-entropy on the logits (core.loss's table)
    loss_fn = choose_loss(cfg.loss, loss_fn, model=model)  # --loss ce, mse, model or module:function
    # Every counted target of the global batch weighs the same, across ranks and micro-batches.
    loss_fn = exact_loss.make_exact_loss(loss_fn, model=model)
    counts = tp_mesh.get_local_rank() == 0  # one rank per tp group counts the group's batch

    # The run folder, new or resumed, the checkpoint's state (every rank reads its shards), and the trackers.
    checkpoints = dict(newest=dcp.newest_good, header=dcp.read_metadata)  # how a resume finds and reads one
    run = folder.open_run(cfg, topo, recipe="fsdp_tp", global_batch=global_batch, dp=dp, **checkpoints)
    start = dcp.load_checkpoint(run, model=model, optimizer=optimizer, scheduler=scheduler)
    meter.carry_window(totals, start["window"], writer=run.writer)  # the log window open at the checkpoint
    run = trackers.attach(run, cfg, step=start["step"], header=dcp.read_metadata)

    # Train. K micro-batches a step; the gradients are reduce-scattered over dp in the last one's backward only.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    step_options = dict(
        optimizer=optimizer, loss_fn=loss_fn, clip=cfg.clip, sync=parallel.fsdp_sync, dp_group=dp_mesh.get_group()
    )
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        set_epoch(train_loader, epoch, consumed=consumed)
        groups = amp.micro_batch_groups(train_loader, cfg.accum, device=topo.device)  # an incomplete tail is dropped
        for micro_batches in itertools.islice(groups, total - step):
            # bf16 lives in fully_shard's MixedPrecisionPolicy: no autocast here
            metrics, stats = amp.step_amp(model, micro_batches, **step_options)
            step, consumed = step + 1, consumed + global_batch
            skipped += amp.check_step(stats, step=step, on_nonfinite=cfg.on_nonfinite)
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            totals.add(metrics if counts else {k: v * 0 for k, v in metrics.items()})
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                numbers = {"lr": scheduler.get_last_lr()[0], "grad_norm": stats.grad_norm, "skipped": skipped}
                meter.log_train(run, totals, step=step, total=total, epoch=epoch, **numbers)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                window = meter.open_window(totals)  # its sums so far: a resume goes on with them
                progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=window)
                with meter.paused(totals):  # every rank writes its own shard
                    state = {"optimizer": optimizer, "scheduler": scheduler}
                    dcp.save_checkpoint(run, model=model, **state, progress=progress, keep=cfg.keep)
        with meter.paused(totals):  # a tp group's ranks count alike, each forward a collective: the means are right
            evaluation = parallel.evaluate_sharded(
                model, val_loader, loss_fn=loss_fn, device=topo.device, forward=exact_loss.forward_sums
            )
        meter.log_eval(run, evaluation, step=step, epoch=epoch)

    # Every rank sends its shards; rank 0 writes the whole model. The buffers are not sharded: every rank
    # vouches that it holds the same ones.
    full = parallel.full_state_dict(model)
    saved = weights.write_weights(run, full)
    write_hf_folder(run, model, full, attr=cfg.hf_attr, max_shard_mb=cfg.hf_shard_mb)
    same = replicas_report(dict(model.named_buffers()))  # {"replicas_identical": ...}, in the summary
    shape = {"tp": tp_mesh.size(), "dp": dp}
    summary = meter.log_summary(run, totals, evaluation, steps=step, skipped=skipped, weights=saved, **shape, **same)
    trackers.close(run)
    return summary


if __name__ == "__main__":
    cli_main(main, Config)
