"""fsdp: ddp_amp with the model fully sharded (FSDP2, fully_shard), one block at a time.

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
sharded: every rank writes its own shard, and a run resumes at another world size.
Rank 0 gathers the full weights at the end into one safetensors file.
"""

import itertools
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
    with torch.device("meta"):  # shapes only: the model's blocks are found (or --blocks refused) without memory
        parallel.find_blocks(models.build_model(cfg.model), name=cfg.blocks or None)


def main(cfg: Config) -> dict:
    check(cfg)
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, LOCAL_RANK, WORLD_SIZE; a world of one without
    try:
        global_batch = cfg.batch_size * topo.world_size * cfg.accum
        with ShardedRun.start(
            cfg, topo, recipe="fsdp", global_batch=global_batch, mesh=mesh(cfg, topo.world_size)
        ) as run:
            return train(cfg, topo, run)
    finally:
        dist.cleanup_pg()


def train(cfg: Config, topo: dist.Topology, run: ShardedRun) -> dict:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # logits are views, never edited in place
    # Build. The same seed on every rank gives the same weights; fully_shard keeps each rank's slice of them.
    torch.manual_seed(cfg.seed)
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    dp_mesh = parallel.build_mesh(topo, mesh(cfg, topo.world_size))
    parallel.apply_fsdp(model, mesh=dp_mesh, precision=cfg.precision, offload=cfg.offload, blocks=cfg.blocks or None)
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
    val_loader = data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # built after sharding: it holds this rank's shards
    total = run.total_steps(train_loader, accum=cfg.accum)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.make_loss(cfg.loss)
    progress = run.resume(model=model, optimizer=optimizer, scheduler=scheduler)  # every rank reads its own shard

    # Train. K micro-batches a step; the gradients are reduce-scattered in the last one's backward only.
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
                dp_group=dp_mesh.get_group(),
            )
            scheduler.step()
            step += 1
            run.step(step, metrics=metrics, stats=stats, lr=scheduler.get_last_lr()[0], total=total)
            run.checkpoint(step, model=model, optimizer=optimizer, scheduler=scheduler)  # every rank its shard
        run.evaluate(model, val_loader, loss_fn=loss_fn, step=step)

    # Every rank sends its shards; rank 0 writes the whole model as one file.
    return run.finish(model)


if __name__ == "__main__":
    cli_main(main, Config, check=check)
