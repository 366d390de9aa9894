"""tensor_parallel: fsdp's loop with Megatron-style tensor parallelism instead (DTensor, parallelize_module).

    ./launch_single_node.sh tensor_parallel --max-steps 100
    ./launch_single_node.sh tensor_parallel --sequence-parallel --accum 2 --clip 1.0
    ./launch_single_node.sh tensor_parallel --model mypkg.models:llama   # a transformers model's own plan
    torchrun --standalone --nproc-per-node 2 -m recipes run tensor_parallel --ckpt-every 50
    python -m recipes run tensor_parallel --max-steps 50   # one process: a tp size of 1

Every rank holds a slice of every block: attention's q, k, v and the MLP's first layer are split
by output column (ColwiseParallel: each rank computes its own heads and hidden units), the layers
after them by input row (RowwiseParallel: partial sums, all-reduced). That is one all-reduce per
sub-layer forward and one backward, so tensor parallelism belongs inside a node on a fast link.
The plan is the model's own where it declares one (a transformers Llama, Qwen, Mistral:
config.base_model_tp_plan, the model_plans plug-in), else the built-in GPT's (core.tp_plan). All
ranks see the same batch: the global batch is --batch-size x --accum. --sequence-parallel (the
GPT's plan) keeps the residual stream split along the sequence between sub-layers (LayerNorm on a
shard), turning each all-reduce into a reduce-scatter and an all-gather. --clip takes the norm over
the shards and the layers the plan leaves whole; checkpoints are sharded (every rank writes its slices).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.distributed.tensor import parallel

import core.attach  # noqa: F401 - the package runs it with its plug-ins; a standalone copy joins those --with names
from core.accum import Accumulation, check_step, make_loaders, micro_batch_groups, step_amp
from core.exact_loss import make_exact_loss
from core.gpt_builtin import build_gpt, build_text, gpt_defaults
from core.kernel.job import Checkpointing, Options, Training, cli_main, option
from core.kernel.loss import make_loss
from core.kernel.seams import SEAMS, fire
from core.kernel.store import finished, open_run
from core.kernel.train import Tally, Topology, cleanup_pg, init_pg, log_eval, log_summary, log_train, not_training
from core.mesh import ShardedPrecision, build_mesh, evaluate_sharded, whole_model
from core.plugins import loss_counts, model_plans, stream, trackers  # noqa: F401 - its own plug-ins (--with)
from core.shard_ckpt import load_sharded, save_sharded
from core.sp_plan import sp_plan
from core.tp_plan import plan_of


def mesh(cfg: Config, world_size: int) -> dict[str, int]:
    """The device mesh: one tensor-parallel group of every rank, no data parallelism."""
    return {"dp": 1, "tp": world_size}


def check(cfg: Config) -> None:
    """What is refused before any process starts (the pre-check calls it too): a plan the world size cannot split."""
    with torch.device("meta"):  # shapes only: no memory
        model = build_gpt(cfg)
    # a plan that cannot split it, or --sequence-parallel with another plan than the GPT's: one line
    sp_plan(model, plan_of(model, tp=int(os.environ.get("WORLD_SIZE", "1"))), enabled=cfg.sequence_parallel)


def main(cfg: Config) -> dict:
    check(cfg)
    topo = init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: Topology) -> dict:
    if done := finished(cfg, topo, recipe="tensor_parallel"):  # resumed, finished: nothing is touched
        return done

    # Build. The same seed on every rank gives the same weights; parallelize_module keeps each rank's slices.
    torch.manual_seed(cfg.seed)  # the same weights and data on every rank (--data's factory: its own seeds)
    train_set, val_set, collate = build_text(cfg)
    model = build_gpt(cfg).to(topo.device)
    fire("after_build", cfg, model)  # the whole weights into the plain model (--init-from): each rank keeps its slices
    tp_mesh = build_mesh(topo, mesh(cfg, topo.world_size))["tp"]
    # which Linear layers split by column, which by row (--sequence-parallel: LayerNorm on shards of the sequence)
    plan = sp_plan(model, plan_of(model, tp=(tp := tp_mesh.size())), enabled=cfg.sequence_parallel)
    parallel.parallelize_module(model, tp_mesh, plan)
    torch.manual_seed(cfg.seed)  # one group, one stream of dropout: DTensor needs it the same on every rank
    # A stream (an IterableDataset) is read in order; map-style data by a seeded sampler, the same on every rank:
    # every rank loads the group's whole batch, as a world of one.
    train_loader, val_loader, total = make_loaders(cfg, Topology(0, 1, topo.device), train_set, val_set, collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # AdamW steps each slice on its own rank
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    # The model's own loss, else cross-entropy; every counted target of the global batch weighs the same, across
    # ranks and micro-batches.
    loss_fn = make_exact_loss(make_loss(cfg, model), model=model)

    # The run folder, new or resumed (refused before it is touched when the checkpoint cannot continue), and the
    # checkpoint's state: every rank reads its own slices.
    global_batch = cfg.batch_size * cfg.accum  # every rank holds the same batch
    run = open_run(cfg, topo, recipe="tensor_parallel", global_batch=global_batch)
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler)  # what a checkpoint holds, with the generators
    start = load_sharded(run, **state)
    totals = Tally(topo.device, start["window"])  # each log window's loss and accuracy (and the checkpoint's open one)

    # Train. Each Linear's forward and backward all-reduce inside the tp group; AdamW steps each rank's slices.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    # no dp group: every rank holds the same batch, nothing is averaged
    options = dict(optimizer=optimizer, loss_fn=loss_fn, precision=cfg.precision, clip=cfg.clip)
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        train_loader.sampler.set_epoch(epoch, consumed=consumed)
        # K batches a step, an incomplete tail dropped; at most total - step of them (--max-steps)
        for _, group in zip(range(total - step), micro_batch_groups(train_loader, cfg.accum, device=topo.device)):
            metrics, stats = step_amp(model, group, **options)
            step, consumed = step + 1, consumed + global_batch
            skipped += check_step(stats, step=step, on_nonfinite=cfg.on_nonfinite)
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            # the ranks hold one batch: one of them counts it
            totals.add(metrics if topo.rank == 0 else {k: v * 0 for k, v in metrics.items()})
            fire("on_step", metrics)  # the training clock
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                lr, norm = scheduler.get_last_lr()[0], stats.grad_norm
                log_train(run, totals, step=step, total=total, epoch=epoch, lr=lr, grad_norm=norm, skipped=skipped)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                with not_training():  # every rank writes its own slices
                    progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=totals.reduce())
                    save_sharded(run, **state, progress=progress, keep=cfg.keep)
        with not_training():  # every rank the same batches, each forward a collective: the means are right
            evaluation = evaluate_sharded(model, val_loader, loss_fn=loss_fn, device=topo.device)
        log_eval(run, evaluation, step=step, epoch=epoch)

    # Every rank gathers the whole weights (its own buffers: the summary says whether they agree); rank 0 writes them.
    whole, saved = whole_model(model, lambda: build_gpt(cfg), run)
    return log_summary(cfg, run, whole, totals, evaluation, steps=step, skipped_steps=skipped, weights=saved, tp=tp)


# Options and start: in a standalone copy these come last, after everything they use.
@dataclass(frozen=True)
class TP(Options):
    """tensor parallelism"""

    sequence_parallel: bool = option(False, "split LayerNorm and the residual stream along the sequence (the GPT)")


@dataclass(frozen=True)
class Config(*gpt_defaults([Training, Checkpointing, TP, ShardedPrecision, Accumulation, *SEAMS["option_groups"]])):
    """tensor_parallel's options (the GPT on text by default), and those of the plug-ins it was joined with."""


if __name__ == "__main__":
    cli_main(main, Config)
