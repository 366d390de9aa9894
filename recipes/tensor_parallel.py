"""tensor_parallel: fsdp's loop with Megatron-style tensor parallelism instead (DTensor, parallelize_module).

    ./launch_single_node.sh tensor_parallel --max-steps 100
    ./launch_single_node.sh tensor_parallel --sequence-parallel --accum 2 --clip 1.0
    torchrun --standalone --nproc-per-node 2 -m recipes run tensor_parallel --ckpt-every 50
    python -m recipes run tensor_parallel --max-steps 50   # one process: a tp size of 1

Every rank holds a slice of every block: attention's q, k, v and the MLP's first layer are split
by output column (ColwiseParallel: each rank computes its own heads and hidden units), the layers
after them by input row (RowwiseParallel: partial sums, all-reduced). That is one all-reduce per
sub-layer forward and one backward, so tensor parallelism belongs inside a node on a fast link.
All ranks see the same batch: the global batch is --batch-size x --accum. --sequence-parallel keeps
the residual stream split along the sequence between sub-layers (LayerNorm on a shard), turning
each all-reduce into a reduce-scatter and an all-gather. --clip takes the norm over the shards and
the layers the plan leaves whole; checkpoints are sharded (every rank writes its slices) and resume
on the same number of ranks. The model needs the GPT's attn.q/k/v/proj and mlp.fc/proj layers.
"""

import dataclasses
import itertools
import os
from dataclasses import dataclass

import torch

from core import data, dist, models, parallel, steps
from core.config import (
    Accumulation,
    Checkpointing,
    ShardedPrecision,
    Training,
    cli_main,
    option,
    with_default,
)
from core.sharded_run import ShardedRun


@dataclass(frozen=True)
class Config(Training, Checkpointing, ShardedPrecision, Accumulation):
    """The shared options and sequence parallelism; the tiny GPT on the embedded text by default."""

    title = "tensor parallelism"

    model: str = with_default(Training, "model", "gpt")
    data: str = with_default(Training, "data", "text")
    epochs: int = with_default(Training, "epochs", 1)
    lr: float = with_default(Training, "lr", 3e-3)
    sequence_parallel: bool = option(False, "split LayerNorm and the residual stream along the sequence")


def mesh(cfg: Config, world_size: int) -> dict[str, int]:
    """The device mesh: one tensor-parallel group of every rank, no data parallelism."""
    return {"dp": 1, "tp": world_size}


def check(cfg: Config) -> None:
    """Everything refusable, before any process starts: the model's structure on the meta device."""
    with torch.device("meta"):  # shapes only: the heads and MLP units must split into tp whole shards
        model = models.build_model(cfg.model)
    parallel.check_tp(model, int(os.environ.get("WORLD_SIZE", "1")), sequence_parallel=cfg.sequence_parallel)


def main(cfg: Config) -> dict:
    check(cfg)
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, LOCAL_RANK, WORLD_SIZE; a world of one without
    try:
        global_batch = cfg.batch_size * cfg.accum  # every rank holds the same batch
        with ShardedRun.start(
            cfg, topo, recipe="tensor_parallel", global_batch=global_batch, mesh=mesh(cfg, topo.world_size)
        ) as run:
            return train(cfg, topo, run)
    finally:
        dist.cleanup_pg()


def train(cfg: Config, topo: dist.Topology, run: ShardedRun) -> dict:
    # Build. The same seed on every rank gives the same weights; parallelize_module keeps each rank's slices.
    torch.manual_seed(cfg.seed)
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    tp_mesh = parallel.build_mesh(topo, {"tp": topo.world_size})
    parallel.apply_tp(model, tp_mesh, sequence_parallel=cfg.sequence_parallel)  # the parallelize_module plan
    one_group = dataclasses.replace(topo, rank=0, world_size=1)  # every rank loads the group's whole batch
    train_loader = data.make_loader(train_set, one_group, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
    val_loader = data.make_loader(val_set, one_group, batch_size=cfg.batch_size, train=False, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # AdamW steps each slice on its own rank
    total = run.total_steps(train_loader, accum=cfg.accum)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.make_loss(cfg.loss)
    progress = run.resume(model=model, optimizer=optimizer, scheduler=scheduler)  # every rank reads its slices

    # Train. The ranks hold one batch: rank 0 alone counts it in the logged loss and throughput.
    step = progress["step"]
    for epoch in range(progress["epoch"], cfg.epochs):
        if step >= total:  # --max-steps reached; a resumed run that had finished stops here
            break
        data.set_epoch(train_loader, epoch, consumed=run.epoch(epoch))  # resumed mid-epoch: skip what was trained
        groups = steps.micro_batch_groups(train_loader, cfg.accum, device=topo.device)  # an incomplete tail is dropped
        for micro_batches in itertools.islice(groups, total - step):
            metrics, stats = steps.train_step(
                model, micro_batches, optimizer=optimizer, loss_fn=loss_fn, precision=cfg.precision, clip=cfg.clip
            )
            scheduler.step()
            step += 1
            run.step(
                step, metrics=metrics if topo.is_rank0 else {}, stats=stats, lr=scheduler.get_last_lr()[0], total=total
            )
            run.checkpoint(step, model=model, optimizer=optimizer, scheduler=scheduler)  # every rank its slices
        run.evaluate(model, val_loader, loss_fn=loss_fn, step=step)  # every rank the same batches: the means are right

    # Every rank sends its slices; rank 0 writes the whole model as one file.
    return run.finish(model)


if __name__ == "__main__":
    cli_main(main, Config, check=check)
