"""fsdp: fully sharded data parallel (FSDP2, fully_shard), one block at a time.

    ./launch_single_node.sh fsdp --max-steps 100
    ./launch_single_node.sh fsdp --precision bf16 --offload cpu
    torchrun --standalone --nproc-per-node 2 -m recipes run fsdp
    python -m recipes run fsdp --max-steps 50     # one process: nothing to shard, same arithmetic

Builds on: ddp (the same data split and loop; parameters, gradients and optimizer state sharded).

DDP keeps a whole copy of the weights, gradients and AdamW state on every rank. fully_shard on
each block, then on the root, keeps 1/N of each on a rank: a block's weights are all-gathered
just before its forward (and again before its backward) and freed after; its gradients are
reduce-scattered, averaged, so each rank steps the optimizer on its own shard only. The step
equals DDP's, and one process's on the global batch (batch size x world size).
--precision bf16 computes in bf16 with gradients reduced in fp32 (MixedPrecisionPolicy);
--offload cpu keeps the shards and the optimizer step in CPU memory. Rank 0 gathers the full
weights at the end into one safetensors file that loads into the plain model.
Defaults: --model gpt --data text (any model with `model.blocks` works).
"""
import time
import warnings

import torch

from core import data, dist, models, parallel, steps
from core.cli import main_for
from core.config import RecipeError, TrainConfig
from core.gpt import RECIPE_DEFAULTS
from core.log import setup_logging
from core.metrics import Meter, planned_steps
from core.registry import Option, register
from core.run import RunWriter


@register("fsdp", summary="FSDP2 fully_shard per block; bf16 MixedPrecisionPolicy; optional CPU offload",
          builds_on="ddp", defaults=RECIPE_DEFAULTS,
          options={"offload": Option("none", "where the parameter shards live between uses", ("none", "cpu"))})
def main(cfg: TrainConfig, *, offload: str = "none") -> dict:
    parallel.refuse_unsupported(cfg, "fsdp", precisions=("fp32", "bf16"))
    if offload == "cpu" and not torch.cuda.is_available():
        raise RecipeError("--offload cpu: there is no GPU, so the shards are in CPU memory already; "
                          "use --offload none")
    topo = dist.init_pg(timeout_s=cfg.timeout_s)
    try:
        return train(cfg, topo, offload=offload)
    finally:
        dist.cleanup_pg()


def train(cfg: TrainConfig, topo: dist.Topology, *, offload: str = "none") -> dict:
    log = setup_logging(topo.rank)
    run = RunWriter.create(cfg.out, cfg.name, topo)
    run.write_config({"recipe": "fsdp", "world_size": topo.world_size, "offload": offload, **cfg.to_dict()})
    # Our logits are views; nothing modifies them in place, which is what this warning is about.
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")

    # Build. The same seed on every rank gives the same weights; fully_shard keeps each rank's slice.
    torch.manual_seed(cfg.seed)
    train_set, val_set = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    mesh = parallel.build_mesh(topo, {"dp": topo.world_size})
    parallel.apply_fsdp(model, mesh=mesh, precision=cfg.precision, offload=offload == "cpu")
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed)
    val_loader = None if val_set is None else data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # built after sharding: it holds the shards
    total = planned_steps(epochs=cfg.epochs, batches_per_epoch=len(train_loader), max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.cross_entropy
    log.info(f"fsdp: {topo.world_size} rank(s) on {topo.device.type}, {cfg.precision}, offload={offload}, "
             f"global batch {cfg.batch_size * topo.world_size}, {total} steps -> {run.run_dir}")

    # Train.
    meter, step, evaluation = Meter(topo.device), 0, {}
    for epoch in range(cfg.epochs):
        train_loader.sampler.set_epoch(epoch)
        for batch in train_loader:
            meter.add(steps.step_plain(model, data.to_device(batch, topo.device), optimizer=optimizer, loss_fn=loss_fn))
            scheduler.step()
            step += 1
            if step % cfg.log_every == 0:  # a collective: every rank reads the meter at the same step
                run.log("train", step=step, epoch=epoch, lr=scheduler.get_last_lr()[0], **meter.read())
            run.progress(step, total, every=cfg.log_every, epoch=epoch, **meter.last)
            if step == cfg.max_steps:
                break
        if val_loader:
            started = time.perf_counter()
            evaluation = steps.evaluate(model, val_loader, loss_fn=loss_fn, device=topo.device)
            meter.exclude(started)
            run.log("eval", step=step, epoch=epoch, **evaluation)
            log.info(f"epoch {epoch} val_loss {evaluation['val_loss']:.4f} val_acc {evaluation['val_acc']:.4f}")
        if step == cfg.max_steps:
            break

    # Save: all ranks gather the shards into rank 0's plain model, which writes one safetensors file.
    last = meter.read()
    plain = parallel.gather_into(models.build_model(cfg.model), model)
    weights = run.save_weights(plain, metadata={"recipe": "fsdp", "model": cfg.model})
    summary = {**evaluation, "train_loss": last["loss"], "samples_per_s": meter.samples_per_s, "steps": step,
               "world_size": topo.world_size, "global_batch": cfg.batch_size * topo.world_size,
               "weights": str(weights)}
    run.summary(**summary)
    return summary


if __name__ == "__main__":
    main_for(main)
