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
config.base_model_tp_plan, core.tp_plan), else the built-in GPT's (core.parallel). All ranks see
the same batch: the global batch is --batch-size x --accum. --sequence-parallel (the GPT's plan)
keeps the residual stream split along the sequence between sub-layers (LayerNorm on a shard),
turning each all-reduce into a reduce-scatter and an all-gather. --clip takes the norm over the
shards and the layers the plan leaves whole; checkpoints are sharded (every rank writes its slices).
"""

import dataclasses
import itertools
import os
from dataclasses import dataclass

import torch
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
from core.kernel.options import option
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
    """The shared options and sequence parallelism; the tiny GPT on the embedded text by default."""

    title = "tensor parallelism"

    model: str = with_default(Training, "model", "gpt")
    data: str = with_default(Training, "data", "text")
    epochs: int = with_default(Training, "epochs", 1)
    lr: float = with_default(Training, "lr", 3e-3)
    sequence_parallel: bool = option(False, "split LayerNorm and the residual stream along the sequence (the GPT)")


def mesh(cfg: Config, world_size: int) -> dict[str, int]:
    """The device mesh: one tensor-parallel group of every rank, no data parallelism."""
    return {"dp": 1, "tp": world_size}


def check(cfg: Config) -> None:
    """Everything refusable, before any process starts: the model's plan, on a meta-device model."""
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    with torch.device("meta"):  # shapes only: the plan must split every layer it names into tp whole shards
        model = models.build_model(cfg.model)
    tp_plan.check_tp_plan(model, tp=tp, sequence_parallel=cfg.sequence_parallel)  # --sequence-parallel: the GPT's


def main(cfg: Config) -> dict:
    check(cfg)  # a copy has no pre-check: the same refusals here
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: dist.Topology) -> dict:
    totals = meter.Meter(topo.device)  # the loss and accuracy of each log window, summed over the ranks
    # resumed and finished, with the lengths it finished with: nothing is touched (larger ones: it trains longer)
    if done := folder.finished(cfg, topo, recipe="tensor_parallel", header=dcp.read_metadata):
        return done
    global_batch = cfg.batch_size * cfg.accum  # every rank holds the same batch

    # Build. The same seed on every rank gives the same weights; parallelize_module keeps each rank's slices.
    seed_all(cfg.seed)  # torch's, Python's and numpy's generators: the same weights and data on every rank
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    if cfg.init_from:  # the whole weights into the plain model: each rank then keeps its slices of them
        load_weights(model, cfg.init_from)
    device_mesh = parallel.build_mesh(topo, mesh(cfg, topo.world_size))
    tp = device_mesh["tp"].size()
    plan = tp_plan.plan_of(model, sequence_parallel=cfg.sequence_parallel)  # Linear layers split by column or by row
    with tp_plan.tp_kept(model, plan, tp=tp):  # a tied lm_head stays tied
        parallelize_module(model, device_mesh["tp"], plan)
    torch.manual_seed(cfg.seed + device_mesh["dp"].get_local_rank())  # one group, one stream: DTensor needs it
    one_group = dataclasses.replace(topo, rank=0, world_size=1)  # every rank loads the group's whole batch
    if stream.is_stream(train_set):  # an IterableDataset: read in order, no sampler
        train_loader = stream.make_loader(train_set, one_group, batch_size=cfg.batch_size, collate_fn=collate)
        val_loader = stream.make_loader(val_set, one_group, batch_size=cfg.batch_size, train=False, collate_fn=collate)
        total = stream.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps, accum=cfg.accum)
    else:
        options = {"batch_size": cfg.batch_size, "collate_fn": collate}
        train_loader = data.make_loader(train_set, one_group, seed=cfg.seed, **options)
        val_loader = data.make_loader(val_set, one_group, train=False, **options)
        total = data.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps, accum=cfg.accum)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # AdamW steps each slice on its own rank
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = make_loss(model=model)  # the model's own loss, else cross-entropy on the logits (core.loss's table)
    loss_fn = choose_loss(cfg.loss, loss_fn, model=model)  # --loss ce, mse, model or module:function
    # Every counted target of the global batch weighs the same, across ranks and micro-batches.
    loss_fn = exact_loss.make_exact_loss(loss_fn, model=model)
    counts = device_mesh["tp"].get_local_rank() == 0  # the ranks hold one batch: one of them counts it

    # The run folder, new or resumed, the checkpoint's state (every rank reads its slices), and the trackers.
    checkpoints = dict(newest=dcp.newest_good, header=dcp.read_metadata)  # how a resume finds and reads one
    run = folder.open_run(cfg, topo, recipe="tensor_parallel", global_batch=global_batch, dp=1, **checkpoints)
    start = dcp.load_checkpoint(run, model=model, optimizer=optimizer, scheduler=scheduler)
    meter.carry_window(totals, start["window"], writer=run.writer)  # the log window open at the checkpoint
    run = trackers.attach(run, cfg, step=start["step"], header=dcp.read_metadata)

    # Train. Each Linear's forward and backward all-reduce inside the tp group; AdamW steps each rank's slices.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    dp_group = device_mesh["dp"].get_group()  # a group of one: every rank holds the same batch, nothing is averaged
    step_options = dict(optimizer=optimizer, loss_fn=loss_fn, precision=cfg.precision, clip=cfg.clip, dp_group=dp_group)
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        set_epoch(train_loader, epoch, consumed=consumed)
        groups = amp.micro_batch_groups(train_loader, cfg.accum, device=topo.device)  # an incomplete tail is dropped
        for micro_batches in itertools.islice(groups, total - step):
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
                with meter.paused(totals):  # every rank writes its own slices
                    state = {"optimizer": optimizer, "scheduler": scheduler}
                    dcp.save_checkpoint(run, model=model, **state, progress=progress, keep=cfg.keep)
        with meter.paused(totals):  # every rank the same batches, each forward a collective: the means are right
            evaluation = parallel.evaluate_sharded(
                model, val_loader, loss_fn=loss_fn, device=topo.device, forward=exact_loss.forward_sums
            )
        meter.log_eval(run, evaluation, step=step, epoch=epoch)

    # Every rank sends its slices; rank 0 writes the whole model. The buffers are whole on every rank: every rank
    # vouches that it holds the same ones.
    full = parallel.full_state_dict(model)
    saved = weights.write_weights(run, full)
    write_hf_folder(run, model, full, attr=cfg.hf_attr, max_shard_mb=cfg.hf_shard_mb)
    same = replicas_report(dict(model.named_buffers()))  # {"replicas_identical": ...}, in the summary
    summary = meter.log_summary(run, totals, evaluation, steps=step, skipped=skipped, weights=saved, tp=tp, **same)
    trackers.close(run)
    return summary


if __name__ == "__main__":
    cli_main(main, Config)
