"""pipeline_naive: the source's PipelineParallelModel: blocks spread over this machine's GPUs, one process.

    python -m recipes run pipeline_naive --max-steps 100
    NPROC_PER_NODE=1 ./launch_single_node.sh pipeline_naive --max-steps 100

Builds on: dp (one process driving every local device), and leads to: pipeline.

The model's blocks are cut into one contiguous group per visible GPU (balanced by parameter
count) and each group lives on its GPU; forward moves the activations from one device to the
next. This fits a model too big for one GPU, but it is not parallel: a batch runs through
device 0, then device 1, and so on, so at any moment every device but one sits idle (with
4 GPUs, each works a quarter of the time), and backward walks back the same way. The
`pipeline` recipe fixes that: it cuts each batch into micro-batches so the stages work on
different micro-batches at once (torch.distributed.pipelining, one process per stage), and it
runs across nodes. On a CPU-only machine (or one GPU) this is plain single-device training.
Defaults: --model gpt --data text (any model whose forward is `model.blocks(x)` works).
"""
import os
import time

import torch
from torch import nn

from core import data, dist, models, parallel, pipeline, steps
from core.cli import main_for
from core.config import RecipeError, TrainConfig
from core.gpt import RECIPE_DEFAULTS
from core.log import setup_logging
from core.metrics import Meter, planned_steps
from core.registry import register
from core.run import RunWriter


class PipelineParallelModel(nn.Module):
    """Stage k's blocks on devices[k]; forward hands the activations from device to device.

    The plain model is kept as `.module`, so its state dict (and the saved weights) has no prefix."""

    def __init__(self, module: nn.Module, devices: list[torch.device]):
        super().__init__()
        self.module = module
        count = pipeline.check_block_model(module, num_stages=1)
        weights = [float(sum(p.numel() for p in b.parameters())) for b in module.blocks]
        sizes = pipeline.plan_split(weights, min(len(devices), count))
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        self.placement = [(devices[k], range(s, s + n)) for k, (s, n) in enumerate(zip(starts, sizes))]
        for device, indices in self.placement:
            for i in indices:
                module.blocks[i].to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for device, indices in self.placement:
            x = x.to(device)  # the hand-over: the previous device waits from here on
            for i in indices:
                x = self.module.blocks[i](x)
        return x


@register("pipeline_naive", summary="the source's PipelineParallelModel: blocks over local GPUs, one at a time busy",
          multi_node=False, builds_on="dp", defaults=RECIPE_DEFAULTS)
def main(cfg: TrainConfig) -> dict:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError(f"pipeline_naive runs in one process but was started with WORLD_SIZE="
                          f"{os.environ['WORLD_SIZE']}; run `python -m recipes run pipeline_naive`, or use "
                          f"the pipeline recipe for several processes")
    parallel.refuse_unsupported(cfg, "pipeline_naive")
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # a world of one, so the shared helpers work unchanged
    try:
        return train(cfg, topo)
    finally:
        dist.cleanup_pg()


def train(cfg: TrainConfig, topo: dist.Topology) -> dict:
    log = setup_logging(topo.rank)
    run = RunWriter.create(cfg.out, cfg.name, topo)
    run.write_config({"recipe": "pipeline_naive", "world_size": 1, **cfg.to_dict()})

    torch.manual_seed(cfg.seed)
    train_set, val_set = data.build_data(cfg.data)
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or [torch.device("cpu")]
    model = PipelineParallelModel(models.build_model(cfg.model), devices)
    output_device = model.placement[-1][0]  # targets meet the logits on the last device
    log.info(f"pipeline_naive: blocks per device {[(str(d), len(ix)) for d, ix in model.placement]}; "
             f"one device busy at a time")
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed)
    val_loader = None if val_set is None else data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    total = planned_steps(epochs=cfg.epochs, batches_per_epoch=len(train_loader), max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.cross_entropy

    meter, step, evaluation = Meter(output_device), 0, {}
    for epoch in range(cfg.epochs):
        train_loader.sampler.set_epoch(epoch)
        for batch in train_loader:
            meter.add(steps.step_plain(model, data.to_device(batch, output_device), optimizer=optimizer,
                                       loss_fn=loss_fn))
            scheduler.step()
            step += 1
            if step % cfg.log_every == 0:  # a collective: every rank reads the meter at the same step
                run.log("train", step=step, epoch=epoch, lr=scheduler.get_last_lr()[0], **meter.read())
            run.progress(step, total, every=cfg.log_every, epoch=epoch, **meter.last)
            if step == cfg.max_steps:
                break
        if val_loader:
            started = time.perf_counter()
            evaluation = steps.evaluate(model, val_loader, loss_fn=loss_fn, device=output_device)
            meter.exclude(started)
            run.log("eval", step=step, epoch=epoch, **evaluation)
            log.info(f"epoch {epoch} val_loss {evaluation['val_loss']:.4f} val_acc {evaluation['val_acc']:.4f}")
        if step == cfg.max_steps:
            break

    last = meter.read()
    weights = run.save_weights(model, metadata={"recipe": "pipeline_naive", "model": cfg.model})
    summary = {**evaluation, "train_loss": last["loss"], "samples_per_s": meter.samples_per_s, "steps": step,
               "world_size": 1, "devices": len(model.placement), "global_batch": cfg.batch_size,
               "weights": str(weights)}
    run.summary(**summary)
    return summary


if __name__ == "__main__":
    main_for(main)
