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

from core import ckpt, data, dist, folder, meter, models, pipeline, steps, weights
from core.config import Checkpointing, Training, cli_main, with_default
from core.kernel.loader import seed_all, set_epoch, to_device
from core.kernel.log import say
from core.kernel.options import RecipeError
from core.kernel.pg import cleanup_pg
from core.loss import make_loss
from core.loss_options import choose_loss
from core.plugins.hf import HFExport, write_hf_folder
from core.plugins.init_from import InitFrom, load_weights


@dataclass(frozen=True)
class Config(Training, Checkpointing, InitFrom, HFExport):
    """The shared training and checkpoint options; the tiny GPT on the embedded text by default."""

    model: str = with_default(Training, "model", "gpt")
    data: str = with_default(Training, "data", "text")
    epochs: int = with_default(Training, "epochs", 1)
    lr: float = with_default(Training, "lr", 3e-3)


class PipelineParallelModel(nn.Module):
    """Stage k's blocks on devices[k]; forward hands the activations from device to device."""

    def __init__(self, module: nn.Module, devices: list[torch.device]):
        super().__init__()
        self.module = module
        count = pipeline.check_pipeline_model(module)
        weights = [float(sum(p.numel() for p in b.parameters())) for b in module.blocks]
        sizes = pipeline.plan_split(weights, min(len(devices), count))
        ends = itertools.accumulate(sizes)
        self.placement = [(device, range(end - n, end)) for device, n, end in zip(devices, sizes, ends)]
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
    """Everything refusable, before any process starts: one process, and a model of blocks."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError(
            f"pipeline_naive runs in one process, not WORLD_SIZE={os.environ['WORLD_SIZE']}: run "
            f"`python -m recipes run pipeline_naive`, or use the pipeline recipe for several processes"
        )
    with torch.device("meta"):
        pipeline.check_pipeline_model(models.build_model(cfg.model))


def main(cfg: Config) -> dict:
    check(cfg)  # a copy has no pre-check: the same refusals here
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # a world of one: the shared helpers work unchanged
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: dist.Topology) -> dict:
    totals = meter.Meter(topo.device)  # the loss and accuracy of each log window, summed over the ranks
    # resumed and finished, with the lengths it finished with: nothing is touched (larger ones: it trains longer)
    if done := folder.finished(cfg, topo, recipe="pipeline_naive", header=ckpt.read_metadata):
        return done
    global_batch = cfg.batch_size  # one process

    # Build: the plain model's blocks spread over the GPUs (the CPU alone without them).
    seed_all(cfg.seed)  # torch's, Python's and numpy's generators: the same weights and data on every rank
    train_set, val_set, collate = data.build_data(cfg.data)
    plain = models.build_model(cfg.model)
    if cfg.init_from:  # a new run from earlier weights (a resumed run then takes its checkpoint's)
        load_weights(plain, cfg.init_from)
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or [torch.device("cpu")]
    model = PipelineParallelModel(plain, devices)
    output_device = model.placement[-1][0]  # targets meet the logits on the last device
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
    val_loader = data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=cfg.lr)
    total = data.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = make_loss(model=plain)  # the model's own loss, else cross-entropy on the logits (core.loss's table)
    loss_fn = choose_loss(cfg.loss, loss_fn, model=plain)  # --loss ce, mse, model or module:function

    # The run folder, new or resumed, and the checkpoint's state (of the plain model: its own names).
    checkpoints = dict(newest=ckpt.newest_good, header=ckpt.read_metadata)  # how a resume finds and reads one
    run = folder.open_run(cfg, topo, recipe="pipeline_naive", global_batch=global_batch, **checkpoints)
    start = ckpt.load_checkpoint(run, model=plain, optimizer=optimizer, scheduler=scheduler)
    meter.carry_window(totals, start["window"], writer=run.writer)  # the log window open at the checkpoint
    placed = [(str(d), len(ix)) for d, ix in model.placement]
    say(run, f"pipeline_naive: blocks per device {placed}; one device busy at a time")

    # Train. One batch at a time through every device in turn.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        set_epoch(train_loader, epoch, consumed=consumed)
        for batch in itertools.islice(train_loader, total - step):
            batch = to_device(batch, output_device)  # forward moves the inputs to the first device itself
            metrics, grad_norm = steps.step_plain(model, batch, optimizer=optimizer, loss_fn=loss_fn)
            step, consumed = step + 1, consumed + global_batch
            skipped += steps.check_finite(grad_norm, step=step, on_nonfinite=cfg.on_nonfinite)
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            totals.add(metrics)
            if step % cfg.log_every == 0 or step == total:
                numbers = {"lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm, "skipped": skipped}
                meter.log_train(run, totals, step=step, total=total, epoch=epoch, **numbers)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                window = meter.open_window(totals)  # its sums so far: a resume goes on with them
                progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=window)
                with meter.paused(totals):
                    state = {"optimizer": optimizer, "scheduler": scheduler}  # the train state besides the model
                    ckpt.save_checkpoint(run, model=plain, **state, progress=progress, keep=cfg.keep)
        with meter.paused(totals):
            evaluation = steps.evaluate(model, val_loader, loss_fn=loss_fn, device=output_device)
        meter.log_eval(run, evaluation, step=step, epoch=epoch)

    # The plain model's weights.
    saved = weights.write_weights(run, plain.state_dict())
    write_hf_folder(run, plain, plain.state_dict(), attr=cfg.hf_attr, max_shard_mb=cfg.hf_shard_mb)
    return meter.log_summary(
        run, totals, evaluation, steps=step, skipped=skipped, weights=saved, devices=len(model.placement)
    )


if __name__ == "__main__":
    cli_main(main, Config)
