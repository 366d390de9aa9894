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
sharded (core.dcp): every rank writes its own shard, and a run resumes at another world size.
Rank 0 gathers the full weights at the end into one safetensors file.
"""

import itertools
import warnings
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import fully_shard

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
    trackers,
    weights,
)
from core.amp import Accumulation
from core.config import Checkpointing, Training, cli_main, with_default
from core.kernel.loader import seed_all, set_epoch
from core.kernel.options import RecipeError, option
from core.kernel.pg import cleanup_pg
from core.loss import make_loss
from core.loss_options import choose_loss
from core.parallel import ShardedPrecision
from core.plugins.hf import HFExport, write_hf_folder
from core.plugins.init_from import InitFrom, load_weights
from core.plugins.replicas import replicas_report


@dataclass(frozen=True)
class Config(Training, Checkpointing, ShardedPrecision, Accumulation, trackers.Tracking, InitFrom, HFExport):
    """ddp_amp's options without DDP's, and where the shards live; the tiny GPT on the embedded text by default."""

    title = "fully sharded data parallel"

    model: str = with_default(Training, "model", "gpt")
    data: str = with_default(Training, "data", "text")
    epochs: int = with_default(Training, "epochs", 1)
    lr: float = with_default(Training, "lr", 3e-3)
    offload: bool = option(False, "keep the parameter shards and the optimizer step in CPU memory (GPUs)")
    blocks: str = option("", "the nn.ModuleList of blocks to shard one by one, e.g. transformer.h (default: found)")


def mesh(cfg: Config, world_size: int) -> dict[str, int]:
    """The device mesh: every rank holds a shard (data parallel over all of them)."""
    return {"dp": world_size}


def check(cfg: Config) -> None:
    """Everything refusable, before any process starts: offload, the blocks on a meta-device model."""
    if cfg.offload and not torch.cuda.is_available():
        raise RecipeError("--offload: there is no GPU, so the shards are in CPU memory already; drop --offload")
    with torch.device("meta"):  # shapes only: no memory
        model = models.build_model(cfg.model)
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
    if done := folder.finished(cfg, topo, recipe="fsdp", header=dcp.read_metadata):
        return done
    global_batch = cfg.batch_size * topo.world_size * cfg.accum

    # Build. The same seed on every rank gives the same weights; fully_shard keeps each rank's slice of them.
    seed_all(cfg.seed)  # torch's, Python's and numpy's generators: the same weights and data on every rank
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    if cfg.init_from:  # the whole weights into the plain model: each rank then keeps its shard of them
        load_weights(model, cfg.init_from)
    dp_mesh = parallel.build_mesh(topo, mesh(cfg, topo.world_size))
    policy = parallel.fsdp_policy(cfg.precision, offload=cfg.offload)  # bf16 compute, fp32 gradient reduction
    if cfg.blocks:  # --blocks NAME: that nn.ModuleList's blocks
        found = parallel.named_blocks(model, cfg.blocks)
    else:  # the model's repeated blocks (GPT-2's transformer.h, Llama's model.layers, the GPT's blocks)
        found = parallel.find_blocks(model)
    for block in parallel.shard_units(model, found):  # each gathered only while it runs
        fully_shard(block, mesh=dp_mesh, **policy)
    fully_shard(model, mesh=dp_mesh, **policy)
    torch.manual_seed(cfg.seed + topo.rank)  # from here each rank draws its own dropout, as one process would
    if stream.is_stream(train_set):  # an IterableDataset: read in order and dealt out by position, no sampler
        train_loader = stream.make_loader(train_set, topo, batch_size=cfg.batch_size, collate_fn=collate)
        val_loader = stream.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
        total = stream.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps, accum=cfg.accum)
    else:
        train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
        val_loader = data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
        total = data.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps, accum=cfg.accum)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # built after sharding: it holds this rank's shards
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = make_loss(model=model)  # the model's own loss, else cross-entropy on the logits (core.loss's table)
    loss_fn = choose_loss(cfg.loss, loss_fn, model=model)  # --loss ce, mse, model or module:function
    # Every counted target of the global batch weighs the same, across ranks and micro-batches.
    loss_fn = exact_loss.make_exact_loss(loss_fn, model=model)

    # The run folder, new or resumed (refused before it is touched when the checkpoint cannot continue), the
    # checkpoint's state (every rank reads its own shard, resharded to this world size), and the trackers.
    run = folder.open_run(
        cfg, topo, recipe="fsdp", global_batch=global_batch, newest=dcp.newest_good, header=dcp.read_metadata
    )
    start = dcp.load_checkpoint(run, model=model, optimizer=optimizer, scheduler=scheduler)
    meter.carry_window(totals, start["window"], writer=run.writer)  # the log window open at the checkpoint
    run = trackers.attach(run, cfg, step=start["step"], header=dcp.read_metadata)

    # Train. K micro-batches a step; the gradients are reduce-scattered in the last one's backward only.
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
            totals.add(metrics)
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                numbers = {"lr": scheduler.get_last_lr()[0], "grad_norm": stats.grad_norm, "skipped": skipped}
                meter.log_train(run, totals, step=step, total=total, epoch=epoch, **numbers)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                window = meter.open_window(totals)  # its sums so far: a resume goes on with them
                progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=window)
                with meter.paused(totals):  # every rank writes its own shard
                    state = {"optimizer": optimizer, "scheduler": scheduler}
                    dcp.save_checkpoint(run, model=model, **state, progress=progress, keep=cfg.keep)
        # every forward is a collective: a rank whose share ran out repeats its last, uncounted
        with meter.paused(totals):
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
    summary = meter.log_summary(run, totals, evaluation, steps=step, skipped=skipped, weights=saved, **same)
    trackers.close(run)
    return summary


if __name__ == "__main__":
    cli_main(main, Config)
