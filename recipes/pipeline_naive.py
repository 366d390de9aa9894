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

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
from torch import nn

import core.attach  # noqa: F401 - the package runs it with every plug-in; a standalone copy joins those --with names
from core.gpt_builtin import build_gpt, build_text, gpt_defaults
from core.kernel.job import Checkpointing, RecipeError, Training, cli_main, say
from core.kernel.loss import make_loss
from core.kernel.replica import evaluate, load_checkpoint, save_checkpoint
from core.kernel.seams import SEAMS, fire
from core.kernel.step import check_finite, step_plain, total_steps
from core.kernel.store import finished, open_run, write_weights
from core.kernel.train import (
    Tally,
    Topology,
    cleanup_pg,
    init_pg,
    log_eval,
    log_summary,
    log_train,
    make_loader,
    not_training,
    to_device,
)
from core.pipeline import check_pipeline_model, plan_split


class PipelineParallelModel(nn.Module):
    """Stage k's blocks on devices[k]; forward hands the activations from device to device."""

    def __init__(self, module: nn.Module, devices: list[torch.device]):
        super().__init__()
        self.module = module
        count = check_pipeline_model(module)
        weights = [float(sum(p.numel() for p in b.parameters())) for b in module.blocks]
        sizes = plan_split(weights, min(len(devices), count))
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
        check_pipeline_model(build_gpt(cfg))


def main(cfg: Config) -> dict:
    check(cfg)  # a copy has no pre-check: the same refusals here
    topo = init_pg(timeout_s=cfg.timeout_s)  # a world of one: the kernel works unchanged
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: Topology) -> dict:
    if done := finished(cfg, topo, recipe="pipeline_naive"):  # resumed, finished: nothing is touched
        return done
    global_batch = cfg.batch_size  # one process

    # Build: the plain model's blocks spread over the GPUs (the CPU alone without them).
    torch.manual_seed(cfg.seed)  # the same weights and data on every rank (--data's factory: its own seeds)
    train_set, val_set, collate = build_text(cfg)
    plain = build_gpt(cfg)
    fire("after_build", cfg, plain)  # the plain model, before its blocks are placed (--init-from)
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or [torch.device("cpu")]
    model = PipelineParallelModel(plain, devices)
    output_device = model.placement[-1][0]  # targets meet the logits on the last device
    train_loader = make_loader(train_set, topo, batch_size=cfg.batch_size, collate_fn=collate, seed=cfg.seed)
    val_loader = make_loader(val_set, topo, batch_size=cfg.batch_size, collate_fn=collate, train=False)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=cfg.lr)
    total = total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = make_loss(cfg, plain)  # the model's own loss, else cross-entropy on the logits

    # The run folder, new or resumed, and the checkpoint's state (of the plain model: its own names).
    run = open_run(cfg, topo, recipe="pipeline_naive", global_batch=global_batch)
    state = dict(model=plain, optimizer=optimizer, scheduler=scheduler)  # what a checkpoint holds, with the generators
    start = load_checkpoint(run, **state)
    totals = Tally(topo.device, start["window"])  # each log window's loss and accuracy (and the checkpoint's open one)
    placed = [(str(d), len(ix)) for d, ix in model.placement]
    say(run, f"pipeline_naive: blocks per device {placed}; one device busy at a time")

    # Train. One batch at a time through every device in turn.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        train_loader.sampler.set_epoch(epoch, consumed=consumed)
        for batch in itertools.islice(train_loader, total - step):
            batch = to_device(batch, output_device)  # forward moves the inputs to the first device itself
            metrics, grad_norm = step_plain(model, batch, optimizer=optimizer, loss_fn=loss_fn)
            step, consumed = step + 1, consumed + global_batch
            skipped += check_finite(grad_norm, step=step, on_nonfinite=cfg.on_nonfinite)
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            totals.add(metrics)
            fire("on_step", metrics)  # the training clock
            if step % cfg.log_every == 0 or step == total:
                lr = scheduler.get_last_lr()[0]
                log_train(run, totals, step=step, total=total, epoch=epoch, lr=lr, grad_norm=grad_norm, skipped=skipped)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                with not_training():
                    progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=totals.reduce())
                    save_checkpoint(run, **state, progress=progress, keep=cfg.keep)
        with not_training():
            evaluation = evaluate(model, val_loader, loss_fn=loss_fn, device=output_device)
        log_eval(run, evaluation, step=step, epoch=epoch)

    # The plain model's weights.
    saved = write_weights(run, plain.state_dict())
    numbers = dict(steps=step, skipped_steps=skipped, weights=str(saved), devices=len(model.placement))
    return log_summary(cfg, run, plain, totals, evaluation, **numbers)


# Options and start: in a standalone copy these come last, after everything they use.
@dataclass(frozen=True)
class Config(*gpt_defaults([Training, Checkpointing, *SEAMS["option_groups"]])):
    """pipeline_naive's options (the GPT on text by default), and those of the plug-ins it was joined with."""


if __name__ == "__main__":
    cli_main(main, Config)
