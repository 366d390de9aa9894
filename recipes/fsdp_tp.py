"""fsdp_tp: 2-D parallelism, tensor parallel inside a group, FSDP2 across groups (a dp x tp mesh).

    NPROC_PER_NODE=4 ./launch_single_node.sh fsdp_tp --tp 2 --max-steps 100
    torchrun --standalone --nproc-per-node 4 -m recipes run fsdp_tp --tp 2
    ./launch_single_node.sh fsdp_tp --tp 2        # 2 processes: tp=2, dp=1 (tensor parallel only)

Builds on: tensor_parallel and fsdp.

Ranks form a dp x tp mesh (rank = dp_index * tp + tp_index, so a tensor-parallel group is
neighbouring ranks, the ones on one node's fast link). Within a row, the blocks' Linear layers
are split column/row-wise as in tensor_parallel and all ranks see the same batch; across rows,
fully_shard shards those DTensor slices again and averages gradients as in fsdp, each row
taking its own share of the data. Global batch: --batch-size x dp. The world size must be a
multiple of --tp. Rank 0 gathers the full weights into one safetensors file.
Defaults: --model gpt --data text.
"""
import dataclasses
import os
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


@register("fsdp_tp", summary="2-D mesh: tensor parallel within groups of --tp ranks, FSDP2 across them",
          builds_on="fsdp", defaults=RECIPE_DEFAULTS,
          options={"tp": Option(2, "tensor-parallel group size (ranks per group); dp = world size / tp")})
def main(cfg: TrainConfig, *, tp: int = 2) -> dict:
    parallel.refuse_unsupported(cfg, "fsdp_tp", precisions=("fp32", "bf16"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp < 1 or world % tp:
        raise RecipeError(f"--tp {tp}: the world size {world} is not a multiple of it, so no dp x tp mesh "
                          f"can be built; launch a multiple of {tp} processes or use --tp {world}")
    torch.manual_seed(cfg.seed)
    model = models.build_model(cfg.model)
    parallel.check_tp(model, tp)
    topo = dist.init_pg(timeout_s=cfg.timeout_s)
    try:
        return train(cfg, topo, model, tp=tp)
    finally:
        dist.cleanup_pg()


def train(cfg: TrainConfig, topo: dist.Topology, model: torch.nn.Module, *, tp: int = 2) -> dict:
    log = setup_logging(topo.rank)
    run = RunWriter.create(cfg.out, cfg.name, topo)
    dp = topo.world_size // tp
    run.write_config({"recipe": "fsdp_tp", "world_size": topo.world_size, "tp": tp, "dp": dp, **cfg.to_dict()})
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # logits are views, never edited

    # Build: slice within each tp group first, then shard those slices across the dp groups.
    mesh = parallel.build_mesh(topo, {"dp": dp, "tp": tp})
    model = parallel.apply_tp(model.to(topo.device), mesh["tp"])
    parallel.apply_fsdp(model, mesh=mesh["dp"], precision=cfg.precision)
    train_set, val_set = data.build_data(cfg.data)
    my_row = dataclasses.replace(topo, rank=mesh["dp"].get_local_rank(), world_size=dp)  # a tp group shares data
    train_loader = data.make_loader(train_set, my_row, batch_size=cfg.batch_size, seed=cfg.seed)
    val_loader = None if val_set is None else data.make_loader(val_set, my_row, batch_size=cfg.batch_size,
                                                               train=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    total = planned_steps(epochs=cfg.epochs, batches_per_epoch=len(train_loader), max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.cross_entropy
    counts = mesh["tp"].get_local_rank() == 0  # one rank per tp group adds the group's batch to the meter
    log.info(f"fsdp_tp: dp={dp} x tp={tp} on {topo.device.type}, {cfg.precision}, "
             f"global batch {cfg.batch_size * dp}, {total} steps -> {run.run_dir}")

    # Train.
    meter, step, evaluation = Meter(topo.device), 0, {}
    for epoch in range(cfg.epochs):
        train_loader.sampler.set_epoch(epoch)
        for batch in train_loader:
            metrics = steps.step_plain(model, data.to_device(batch, topo.device), optimizer=optimizer, loss_fn=loss_fn)
            if counts:
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
            evaluation = steps.evaluate(model, val_loader, loss_fn=loss_fn, device=topo.device)  # means: exact
            meter.exclude(started)
            run.log("eval", step=step, epoch=epoch, **evaluation)
            log.info(f"epoch {epoch} val_loss {evaluation['val_loss']:.4f} val_acc {evaluation['val_acc']:.4f}")
        if step == cfg.max_steps:
            break

    # Save: gather the 2-D shards into rank 0's plain model, written as one safetensors file.
    last = meter.read()
    plain = parallel.gather_into(models.build_model(cfg.model), model)
    weights = run.save_weights(plain, metadata={"recipe": "fsdp_tp", "model": cfg.model})
    summary = {**evaluation, "train_loss": last["loss"], "samples_per_s": meter.samples_per_s, "steps": step,
               "world_size": topo.world_size, "tp": tp, "dp": dp, "global_batch": cfg.batch_size * dp,
               "weights": str(weights)}
    run.summary(**summary)
    return summary


if __name__ == "__main__":
    main_for(main)
