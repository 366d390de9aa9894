"""fsdp: ddp_amp with the model fully sharded (FSDP2, fully_shard), one block at a time, and sharded checkpoints.

    ./launch_single_node.sh fsdp --max-steps 100
    ./launch_single_node.sh fsdp --precision bf16 --accum 4 --clip 1.0
    torchrun --standalone --nproc-per-node 2 -m recipes run fsdp --ckpt-every 50
    python -m recipes run fsdp --max-steps 50     # one process: nothing to shard, the same arithmetic

DDP keeps a whole copy of the weights, gradients and AdamW state on every rank. fully_shard on
each repeated block (GPT-2's transformer.h, Llama's model.layers, or --blocks NAME), then on the
root, keeps 1/N of each on a rank: a block's weights are all-gathered just before its forward
(and again before its backward) and freed after; its gradients are reduce-scattered, averaged,
so each rank steps AdamW on its own shard only. The step equals one process's on the global
batch (batch size x world size x accum). --accum K holds the reduce-scatter back for the first
K-1 micro-batches (set_requires_gradient_sync); --clip takes the norm over all shards;
--precision bf16 computes in bf16 and reduces gradients in fp32 (MixedPrecisionPolicy);
--offload keeps the shards and the optimizer step in CPU memory (GPUs). Checkpoints are
sharded: every rank writes its own shard, and a run resumes at another world size. Rank 0
gathers the full weights at the end into one safetensors file.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

import core.attach  # noqa: F401 - the package runs fsdp with its plug-ins; a standalone copy joins those --with names
from core.accum import Accumulation, check_step, make_loaders, micro_batch_groups, step_amp
from core.exact_loss import make_exact_loss
from core.gpt_builtin import build_gpt, build_text, gpt_defaults
from core.kernel.job import Checkpointing, Options, RecipeError, Training, cli_main, option
from core.kernel.loss import make_loss
from core.kernel.seams import SEAMS, fire
from core.kernel.store import finished, open_run
from core.kernel.train import Tally, Topology, cleanup_pg, init_pg, log_eval, log_summary, log_train, not_training
from core.mesh import ShardedPrecision, build_mesh, evaluate_sharded, whole_model
from core.plugins import blocks, loss_counts, stream, trackers  # noqa: F401 - fsdp's own plug-ins (--with adds them)
from core.shard import fsdp_policy, fsdp_sync, shard_blocks
from core.shard_ckpt import load_sharded, save_sharded


def mesh(cfg: Config, world_size: int) -> dict[str, int]:
    """The device mesh: every rank holds a shard (data parallel over all of them)."""
    return {"dp": world_size}


def check(cfg: Config) -> None:
    """What is refused before any process starts (the pre-check calls it too): --offload with no GPU."""
    if cfg.offload and not torch.cuda.is_available():
        raise RecipeError("--offload: there is no GPU, so the shards are in CPU memory already; drop --offload")


def main(cfg: Config) -> dict:
    check(cfg)
    topo = init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: Topology) -> dict:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # logits are views, never edited in place
    if done := finished(cfg, topo, recipe="fsdp"):  # resumed, finished: nothing is touched
        return done
    global_batch = cfg.batch_size * topo.world_size * cfg.accum

    # Build. The same seed on every rank gives the same weights; fully_shard keeps each rank's slice of them.
    torch.manual_seed(cfg.seed)  # the same weights and data on every rank (--data's factory: its own seeds)
    train_set, val_set, collate = build_text(cfg)
    model = build_gpt(cfg).to(topo.device)
    fire("after_build", cfg, model)  # the whole weights into the plain model (--init-from): each rank keeps its shard
    dp_mesh = build_mesh(topo, mesh(cfg, topo.world_size))
    # bf16 compute, fp32 gradient reduction; the repeated blocks (or --blocks NAME's), each gathered while it runs
    offload = CPUOffloadPolicy() if cfg.offload else OffloadPolicy()  # --offload: shards and their step in CPU memory
    for block in [*shard_blocks(cfg, model), model]:  # the root last: it holds what no block does
        fully_shard(block, mesh=dp_mesh, offload_policy=offload, **fsdp_policy(cfg.precision))
    torch.manual_seed(cfg.seed + topo.rank)  # from here each rank draws its own dropout, as one process would
    # A stream (an IterableDataset) is read in order and dealt out by position; map-style data by a seeded sampler.
    train_loader, val_loader, total = make_loaders(cfg, topo, train_set, val_set, collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # built after sharding: it holds this rank's shards
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    # The model's own loss, else cross-entropy; every counted target of the global batch weighs the same, across
    # ranks and micro-batches.
    loss_fn = make_exact_loss(make_loss(cfg, model), model=model)

    # The run folder, new or resumed (refused before it is touched when the checkpoint cannot continue), and the
    # checkpoint's state: every rank reads its own shard, resharded to this world size.
    run = open_run(cfg, topo, recipe="fsdp", global_batch=global_batch)
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler)  # what a checkpoint holds, with the generators
    start = load_sharded(run, **state)
    totals = Tally(topo.device, start["window"])  # each log window's loss and accuracy (and the checkpoint's open one)

    # Train. K micro-batches a step; the gradients are reduce-scattered in the last one's backward only.
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
            totals.add(metrics)
            fire("on_step", metrics)  # the training clock
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                lr, norm = scheduler.get_last_lr()[0], stats.grad_norm
                log_train(run, totals, step=step, total=total, epoch=epoch, lr=lr, grad_norm=norm, skipped=skipped)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                with not_training():  # every rank writes its own shard
                    progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=totals.reduce())
                    save_sharded(run, **state, progress=progress, keep=cfg.keep)
        with not_training():  # every forward is a collective: a rank whose share ran out repeats its last, uncounted
            evaluation = evaluate_sharded(model, val_loader, loss_fn=loss_fn, device=topo.device)
        log_eval(run, evaluation, step=step, epoch=epoch)

    # Every rank gathers the whole weights (its own buffers: the summary says whether they agree); rank 0 writes them.
    whole, saved = whole_model(model, lambda: build_gpt(cfg), run)
    return log_summary(cfg, run, whole, totals, evaluation, steps=step, skipped_steps=skipped, weights=str(saved))


# Options and start: in a standalone copy these come last, after everything they use.
@dataclass(frozen=True)
class FSDPOptions(Options):
    """fully sharded data parallel"""

    offload: bool = option(False, "keep the parameter shards and the optimizer step in CPU memory (GPUs)")


@dataclass(frozen=True)
class Config(
    *gpt_defaults([Training, Checkpointing, FSDPOptions, ShardedPrecision, Accumulation, *SEAMS["option_groups"]])
):
    """fsdp's options (the GPT on text by default), and those of the plug-ins it was joined with."""


if __name__ == "__main__":
    cli_main(main, Config)
