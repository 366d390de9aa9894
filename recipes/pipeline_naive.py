"""pipeline_naive: the source's PipelineParallelModel: blocks spread over this machine's GPUs, one process.

    python -m recipes run pipeline_naive --max-steps 100
    NPROC_PER_NODE=1 ./launch_single_node.sh pipeline_naive --max-steps 100

The model's blocks are cut into one contiguous group per visible GPU (balanced by parameter
count) and each group lives on its GPU; forward moves the activations from one device to the
next. This fits a model too big for one GPU, but it is not parallel: a batch runs through
device 0, then device 1, and so on, so at any moment every device but one sits idle (with
4 GPUs, each works a quarter of the time), and backward walks back the same way. The
`pipeline` recipe fixes that: it cuts each batch into micro-batches so the stages work on
different micro-batches at once (torch.distributed.pipelining, one process per stage), and it
runs across nodes. On a CPU-only machine (or one GPU) this is plain single-device training.
Defaults: --model gpt --data text (any model whose forward is `model.blocks(x)` works). Builds on dp.
"""

import itertools
import os
from dataclasses import dataclass

import torch
from torch import nn

from core import data, dist, models, pipeline, steps
from core.config import Checkpointing, RecipeError, Training, cli_main, with_default
from core.run import Run


@dataclass(frozen=True)
class Config(Training, Checkpointing):
    """The shared training and checkpoint options; the tiny GPT on the embedded text by default."""

    model: str = with_default(Training, "model", "gpt")
    data: str = with_default(Training, "data", "text")
    epochs: int = with_default(Training, "epochs", 1)
    lr: float = with_default(Training, "lr", 3e-3)


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


def check(cfg: Config) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError(
            f"pipeline_naive runs in one process but was started with WORLD_SIZE="
            f"{os.environ['WORLD_SIZE']}; run `python -m recipes run pipeline_naive`, or use "
            f"the pipeline recipe for several processes"
        )
    with torch.device("meta"):
        pipeline.check_block_model(models.build_model(cfg.model), num_stages=1)


def main(cfg: Config) -> dict:
    check(cfg)
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # a world of one: the shared helpers work unchanged
    try:
        with Run.start(cfg, topo, recipe="pipeline_naive", global_batch=cfg.batch_size) as run:
            return train(cfg, topo, run)
    finally:
        dist.cleanup_pg()


def train(cfg: Config, topo: dist.Topology, run: Run) -> dict:
    torch.manual_seed(cfg.seed)
    train_set, val_set, collate = data.build_data(cfg.data)
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or [torch.device("cpu")]
    model = PipelineParallelModel(models.build_model(cfg.model), devices)
    output_device = model.placement[-1][0]  # targets meet the logits on the last device
    run.print(
        f"pipeline_naive: blocks per device {[(str(d), len(ix)) for d, ix in model.placement]}; "
        f"one device busy at a time"
    )
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
    val_loader = data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    total = run.total_steps(train_loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.make_loss(cfg.loss)
    progress = run.resume(model=model, optimizer=optimizer, scheduler=scheduler)

    step = progress["step"]
    for epoch in range(progress["epoch"], cfg.epochs):
        if step >= total:  # --max-steps reached; a resumed run that had finished stops here
            break
        data.set_epoch(train_loader, epoch, consumed=run.epoch(epoch))
        for batch in itertools.islice(train_loader, total - step):
            batch = data.to_device(batch, output_device)
            metrics, stats = steps.train_step(model, [batch], optimizer=optimizer, loss_fn=loss_fn)
            scheduler.step()
            step += 1
            run.step(step, metrics=metrics, stats=stats, lr=scheduler.get_last_lr()[0], total=total)
            run.checkpoint(step, model=model, optimizer=optimizer, scheduler=scheduler)
        run.evaluate(model, val_loader, loss_fn=loss_fn, step=step)

    return run.finish(model, devices=len(model.placement))


if __name__ == "__main__":
    cli_main(main, Config, check=check)
