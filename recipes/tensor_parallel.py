"""tensor_parallel: Megatron-style tensor parallelism with DTensor (parallelize_module).

    ./launch_single_node.sh tensor_parallel --max-steps 100
    ./launch_single_node.sh tensor_parallel --sequence-parallel on
    torchrun --standalone --nproc-per-node 2 -m recipes run tensor_parallel
    python -m recipes run tensor_parallel --max-steps 50   # one process: a tp size of 1

Builds on: ddp (the same loop; the model is split across ranks instead of copied).

Every rank holds a slice of every block: attention's q, k, v and the MLP's first layer are
split by output column (ColwiseParallel: each rank computes its own heads and hidden units),
the layers after them by input row (RowwiseParallel: partial sums, all-reduced). That is one
all-reduce per sub-layer forward and one backward, so tensor parallelism belongs inside a node
on a fast link. All ranks of the group see the same batch: the global batch is --batch-size.
--sequence-parallel on keeps the residual stream split along the sequence between
sub-layers (LayerNorm on a shard), turning each all-reduce into reduce-scatter + all-gather.
Defaults: --model gpt --data text (the model must have the GPT's attn/mlp Linear layers).
"""
import dataclasses
import os
import time

import torch

from core import data, dist, models, parallel, steps
from core.cli import main_for
from core.config import TrainConfig
from core.gpt import RECIPE_DEFAULTS
from core.log import setup_logging
from core.metrics import Meter, planned_steps
from core.registry import Option, register
from core.run import RunWriter


@register("tensor_parallel", summary="Megatron column/row-parallel attention and MLP (DTensor), opt. sequence parallel",
          builds_on="ddp", defaults=RECIPE_DEFAULTS,
          options={"sequence_parallel": Option("off", "split LayerNorm and the residual stream along the sequence",
                                               choices=("off", "on"))})
def main(cfg: TrainConfig, *, sequence_parallel: str = "off") -> dict:
    parallel.refuse_unsupported(cfg, "tensor_parallel")
    torch.manual_seed(cfg.seed)  # the same weights on every rank before they are sliced
    model = models.build_model(cfg.model)
    parallel.check_tp(model, int(os.environ.get("WORLD_SIZE", "1")), sequence_parallel=sequence_parallel == "on")
    topo = dist.init_pg(timeout_s=cfg.timeout_s)
    try:
        return train(cfg, topo, model, sequence_parallel=sequence_parallel == "on")
    finally:
        dist.cleanup_pg()


def train(cfg: TrainConfig, topo: dist.Topology, model: torch.nn.Module, *, sequence_parallel: bool = False) -> dict:
    log = setup_logging(topo.rank)
    run = RunWriter.create(cfg.out, cfg.name, topo)
    run.write_config({"recipe": "tensor_parallel", "world_size": topo.world_size,
                      "sequence_parallel": sequence_parallel, **cfg.to_dict()})

    # Build: slice the model over a 1-D mesh of all ranks; parameters become DTensor shards.
    mesh = parallel.build_mesh(topo, {"tp": topo.world_size})
    model = parallel.apply_tp(model.to(topo.device), mesh, sequence_parallel=sequence_parallel)
    train_set, val_set = data.build_data(cfg.data)
    one_group = dataclasses.replace(topo, rank=0, world_size=1)  # every rank loads the group's whole batch
    train_loader = data.make_loader(train_set, one_group, batch_size=cfg.batch_size, seed=cfg.seed)
    val_loader = None if val_set is None else data.make_loader(val_set, one_group, batch_size=cfg.batch_size,
                                                               train=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # AdamW steps each shard on its own rank
    total = planned_steps(epochs=cfg.epochs, batches_per_epoch=len(train_loader), max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.cross_entropy
    log.info(f"tensor_parallel: tp={topo.world_size} sequence_parallel={sequence_parallel} on {topo.device.type}, "
             f"global batch {cfg.batch_size}, {total} steps -> {run.run_dir}")

    # Train: the same loop as ddp; only rank 0 counts the batch, the others hold the same one.
    meter, step, evaluation = Meter(topo.device), 0, {}
    for epoch in range(cfg.epochs):
        train_loader.sampler.set_epoch(epoch)
        for batch in train_loader:
            metrics = steps.step_plain(model, data.to_device(batch, topo.device), optimizer=optimizer, loss_fn=loss_fn)
            if topo.is_rank0:
                meter.add(metrics)
            scheduler.step()
            step += 1
            if step % cfg.log_every == 0:  # a collective: every rank reads the meter at the same step
                run.log("train", step=step, epoch=epoch, lr=scheduler.get_last_lr()[0], **meter.read())
            run.progress(step, total, every=cfg.log_every, epoch=epoch, **meter.last)
            if step == cfg.max_steps:
                break
        if val_loader:
            started = time.perf_counter()
            # every rank counts the same samples: the means are right, the sums N times too big
            evaluation = steps.evaluate(model, val_loader, loss_fn=loss_fn, device=topo.device)
            meter.exclude(started)
            run.log("eval", step=step, epoch=epoch, **evaluation)
            log.info(f"epoch {epoch} val_loss {evaluation['val_loss']:.4f} val_acc {evaluation['val_acc']:.4f}")
        if step == cfg.max_steps:
            break

    # Save: gather the shards into rank 0's plain model, written as one safetensors file.
    last = meter.read()
    plain = parallel.gather_into(models.build_model(cfg.model), model)
    weights = run.save_weights(plain, metadata={"recipe": "tensor_parallel", "model": cfg.model})
    summary = {**evaluation, "train_loss": last["loss"], "samples_per_s": meter.samples_per_s, "steps": step,
               "world_size": topo.world_size, "global_batch": cfg.batch_size, "weights": str(weights)}
    run.summary(**summary)
    return summary


if __name__ == "__main__":
    main_for(main)
