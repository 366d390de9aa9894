"""fsdp_tp: fsdp across groups, tensor parallel inside each group of --tp ranks (a dp x tp mesh).

    NPROC_PER_NODE=4 ./launch_single_node.sh fsdp_tp --tp 2 --max-steps 100
    torchrun --standalone --nproc-per-node 4 -m recipes run fsdp_tp --tp 2 --accum 2 --clip 1.0
    ./launch_single_node.sh fsdp_tp --tp 2        # 2 processes: tp=2, dp=1 (tensor parallel only)

Ranks form a dp x tp mesh (rank = dp_index * tp + tp_index, so a tensor-parallel group is
neighbouring ranks, the ones on one node's fast link). Within a group, the blocks' Linear layers
are split column/row-wise as in tensor_parallel and all its ranks see the same batch; across
groups, fully_shard shards those DTensor slices again and averages gradients as in fsdp, each
group taking its own share of the data. Global batch: --batch-size x dp x --accum. The world size
must be a multiple of --tp. --clip takes the norm over both meshes; checkpoints are sharded and
resume with the same --tp (dp may change). Rank 0 gathers the full weights into one file.
"""

import dataclasses
import itertools
import os
import warnings
from dataclasses import dataclass

import torch

from core import data, dist, models, parallel, steps
from core.config import (
    Accumulation,
    Checkpointing,
    RecipeError,
    ShardedPrecision,
    Training,
    cli_main,
    option,
    with_default,
)
from core.sharded_run import ShardedRun


@dataclass(frozen=True)
class Config(Training, Checkpointing, ShardedPrecision, Accumulation):
    """fsdp's options without --offload, and the tensor-parallel group size; the tiny GPT on the text by default."""

    title = "2-D parallelism"

    model: str = with_default(Training, "model", "gpt")
    data: str = with_default(Training, "data", "text")
    epochs: int = with_default(Training, "epochs", 1)
    lr: float = with_default(Training, "lr", 3e-3)
    tp: int = option(
        2,
        "tensor-parallel group size (ranks per group); dp = world size / tp",
        check=lambda v: 1 <= v <= 2**16,
        fix="use 1 or more ranks per group",
    )
    blocks: str = option("", "the nn.ModuleList of blocks to shard one by one, e.g. transformer.h (default: found)")


def mesh(cfg: Config, world_size: int) -> dict[str, int]:
    """The device mesh: dp groups of tp neighbouring ranks."""
    return {"dp": max(world_size // cfg.tp, 1), "tp": cfg.tp}


def check(cfg: Config) -> None:
    """Everything refusable, before any process starts: the mesh, precision, the model's structure (meta device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % cfg.tp:
        raise RecipeError(
            f"--tp {cfg.tp}: the world size {world} is not a multiple of it, so no dp x tp mesh "
            f"can be built; launch a multiple of {cfg.tp} processes or use --tp {world}"
        )
    with torch.device("meta"):  # shapes only: the heads split into tp whole shards, and the blocks are found
        model = models.build_model(cfg.model)
    parallel.check_tp(model, cfg.tp)
    parallel.find_blocks(model, name=cfg.blocks or None)


def main(cfg: Config) -> dict:
    check(cfg)
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, LOCAL_RANK, WORLD_SIZE; a world of one without
    try:
        plan = mesh(cfg, topo.world_size)
        global_batch = cfg.batch_size * plan["dp"] * cfg.accum  # a tp group shares one batch
        with ShardedRun.start(cfg, topo, recipe="fsdp_tp", global_batch=global_batch, mesh=plan) as run:
            return train(cfg, topo, run)
    finally:
        dist.cleanup_pg()


def train(cfg: Config, topo: dist.Topology, run: ShardedRun) -> dict:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # logits are views, never edited in place
    # Build: slice within each tp group first, then shard those slices across the dp groups.
    torch.manual_seed(cfg.seed)
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    device_mesh = parallel.build_mesh(topo, mesh(cfg, topo.world_size))
    parallel.apply_tp(model, device_mesh["tp"])
    parallel.apply_fsdp(model, mesh=device_mesh["dp"], precision=cfg.precision, blocks=cfg.blocks or None)
    dp, dp_rank = device_mesh["dp"].size(), device_mesh["dp"].get_local_rank()
    my_group = dataclasses.replace(topo, rank=dp_rank, world_size=dp)  # a tp group shares its data
    train_loader = data.make_loader(train_set, my_group, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
    val_loader = data.make_loader(val_set, my_group, batch_size=cfg.batch_size, train=False, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # built after sharding: it holds this rank's shards
    total = run.total_steps(train_loader, accum=cfg.accum)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.make_loss(cfg.loss)
    progress = run.resume(model=model, optimizer=optimizer, scheduler=scheduler)  # every rank reads its shards
    counts = device_mesh["tp"].get_local_rank() == 0  # one rank per tp group counts the group's batch

    # Train. K micro-batches a step; the gradients are reduce-scattered over dp in the last one's backward only.
    step = progress["step"]
    for epoch in range(progress["epoch"], cfg.epochs):
        if step >= total:  # --max-steps reached; a resumed run that had finished stops here
            break
        data.set_epoch(train_loader, epoch, consumed=run.epoch(epoch))  # resumed mid-epoch: skip what was trained
        groups = steps.micro_batch_groups(train_loader, cfg.accum, device=topo.device)  # an incomplete tail is dropped
        for micro_batches in itertools.islice(groups, total - step):
            # bf16 lives in fully_shard's MixedPrecisionPolicy (apply_fsdp), so no autocast here
            metrics, stats = steps.train_step(
                model,
                micro_batches,
                optimizer=optimizer,
                loss_fn=loss_fn,
                clip=cfg.clip,
                sync=parallel.fsdp_sync,
                dp_group=device_mesh["dp"].get_group(),
            )
            scheduler.step()
            step += 1
            run.step(step, metrics=metrics if counts else {}, stats=stats, lr=scheduler.get_last_lr()[0], total=total)
            run.checkpoint(step, model=model, optimizer=optimizer, scheduler=scheduler)  # every rank its shard
        run.evaluate(model, val_loader, loss_fn=loss_fn, step=step)  # a tp group's ranks count alike: means are right

    # Every rank sends its shards; rank 0 writes the whole model as one file.
    return run.finish(model, tp=cfg.tp, dp=dp)


if __name__ == "__main__":
    cli_main(main, Config, check=check)
