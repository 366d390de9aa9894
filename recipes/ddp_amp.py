"""ddp_amp: ddp plus mixed precision, dynamic loss scaling, gradient accumulation and clipping.

    ./launch_single_node.sh ddp_amp --precision bf16 --accum 4 --clip 1.0
    torchrun --standalone --nproc-per-node 2 -m recipes run ddp_amp --precision bf16 --accum 4 --clip 1.0
    python -m recipes run ddp_amp --precision bf16 --accum 4   # one process, no launcher
    ./launch_single_node.sh ddp_amp --precision fp16 --clip 1.0  # GPUs only: fp16 needs CUDA

Builds on: ddp.

The forward runs under torch.autocast (bf16 on CPU or GPU, fp16 on GPU); weights, gradients and
the optimizer stay fp32. fp16 also gets a GradScaler: the loss is scaled up so small gradients
survive fp16, unscaled before clipping, and a step whose gradients overflowed is skipped while
the scale backs off (it grows again after a run of clean steps). An optimizer step takes
--accum K micro-batches: DDP's no_sync() holds the all-reduce back for the first K-1, so it runs
once per step, and each loss counts by its share of the K, so the step is the one a single
process takes on a global batch of batch size x world size x K. An epoch is len(loader) // K
steps: an incomplete group of micro-batches at the epoch's end is dropped. --clip bounds the
total gradient norm over all ranks. A loss that is not finite in fp32/bf16 stops the run
naming the step (--on-nonfinite skip: the step is skipped and counted). --epochs defaults to 10
here: with --accum 4 an epoch has 4x fewer steps, and 5 epochs fall short of ddp's accuracy.
Compared with the source's AMPDistributedTrainer: torch.amp, not torch.cuda.amp; bf16 needs no
scaler; loss and accuracy are reduced over ranks (its _reduce_metric is never defined);
validation every epoch; the scaler's state is in every checkpoint.
"""
import json
import time

import torch

from core import ckpt, comm, data, dist, models, parallel, steps, tuning, watchdog
from core.cli import main_for
from core.config import RecipeError, TrainConfig
from core.log import setup_logging
from core.metrics import Meter, flops_per_sample, peak_flops, planned_steps
from core.registry import Option, register
from core.run import RunWriter


@register("ddp_amp", summary="ddp + autocast (bf16/fp16), GradScaler, accumulation with no_sync, clipping",
          builds_on="ddp", defaults={"epochs": 10},  # --accum 4 takes 4x fewer steps per epoch than ddp
          options={"on_nonfinite": Option("stop", "what a non-finite loss in fp32/bf16 does", ("stop", "skip"))})
def main(cfg: TrainConfig, *, on_nonfinite: str = "stop") -> dict:
    if cfg.static_graph and cfg.accum > 1:  # DDP's static graph asserts (or skips the all-reduce) under no_sync()
        raise RecipeError(f"--static-graph with --accum {cfg.accum}: DDP's static graph breaks under no_sync() "
                          f"(pytorch/pytorch#143580); drop --static-graph or use --accum 1")
    watchdog.prepare_env(debug=cfg.debug, out=cfg.out, watchdog=cfg.hang_factor > 0)  # read by init_pg
    topo = dist.init_pg(timeout_s=cfg.timeout_s)
    try:
        return train(cfg, topo, on_nonfinite=on_nonfinite)
    finally:
        dist.cleanup_pg()


def train(cfg: TrainConfig, topo: dist.Topology, *, on_nonfinite: str = "stop") -> dict:
    log = setup_logging(topo.rank)
    resume_from = ckpt.choose_resume(cfg.resume, out=cfg.out, prefix=cfg.name)  # rank 0 decides for all
    run = RunWriter.create(cfg.out, cfg.name, topo, run_dir=ckpt.run_dir_of(resume_from))
    run.write_config({"recipe": "ddp_amp", "world_size": topo.world_size, **cfg.to_dict()})

    # Build. The same seed on every rank gives the same initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(cfg.seed)
    train_set, val_set = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    # Computation and communication options (docs/monitoring.md): none changes the arithmetic beyond rounding.
    model = tuning.before_wrap(model, channels_last=cfg.channels_last,
                               activation_checkpointing=cfg.activation_checkpointing)
    ddp_model = parallel.wrap_ddp(model, device=topo.device, comm_hook=cfg.comm_hook, **comm.ddp_options(cfg))
    train_model = tuning.after_wrap(ddp_model, compile=cfg.compile)  # compiled after DDP, as torch documents
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed)
    val_loader = None if val_set is None else data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False)
    if len(train_loader) < cfg.accum:  # every rank has as many batches as the others: all raise alike
        raise RecipeError(f"--accum {cfg.accum}: an epoch has only {len(train_loader)} micro-batches per rank; "
                          f"use --accum {len(train_loader)} or less, or a smaller --batch-size")
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    total = planned_steps(epochs=cfg.epochs, batches_per_epoch=len(train_loader), accum=cfg.accum,
                          max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    scaler = steps.make_scaler(cfg.precision, device=topo.device)  # loss scaling for fp16; a pass-through otherwise
    loss_fn = steps.cross_entropy
    progress = {"epoch": 0, "batch": 0, "step": 0, "skipped": 0}  # where training starts: 0, or a checkpoint's place
    if resume_from:
        progress = ckpt.load_checkpoint(resume_from, model=model, optimizer=optimizer, scheduler=scheduler,
                                        scaler=scaler, world_size=topo.world_size)
        log.info(f"resumed from {resume_from} at epoch {progress['epoch']} step {progress['step']}")
    global_batch = cfg.batch_size * topo.world_size * cfg.accum
    log.info(f"ddp_amp: {topo.world_size} rank(s) on {topo.device.type} ({topo.backend}), {cfg.precision}, "
             f"global batch {global_batch} ({cfg.accum} micro-batches), {total} steps -> {run.run_dir}")

    # Train. The meter times each step's phases from hooks; the watchdog reports a rank that stops stepping.
    peak = peak_flops(topo.device, cfg.precision)  # MFU on a known GPU
    meter = Meter(topo.device, peak_flops=peak, flops_per_sample=peak and flops_per_sample(
        lambda: models.build_model(cfg.model), train_set[0][0])).attach(train_model, optimizer, grad_norm=False)
    watch = watchdog.Watchdog(run.run_dir, topo, factor=cfg.hang_factor, min_s=cfg.hang_min_s, timeout_s=cfg.timeout_s)
    step, skipped, evaluation = progress["step"], progress.get("skipped", 0), {}
    with watch, watchdog.profiler(run.run_dir, topo, enabled=cfg.profile) as profiler:
        for epoch in range(progress["epoch"], cfg.epochs):
            done = progress["batch"] if epoch == progress["epoch"] else 0  # micro-batches a checkpoint covers
            # A new shuffle each epoch, the same on every rank; a resumed epoch skips what it already trained on.
            train_loader.sampler.set_epoch(epoch, skip=done * cfg.batch_size)
            groups = steps.micro_batch_groups(train_loader, cfg.accum, device=topo.device)  # K at a time, tail dropped
            for group_index, micro_batches in enumerate(groups, start=1):
                metrics, stats = steps.step_amp(train_model, micro_batches, optimizer=optimizer, loss_fn=loss_fn,
                                                precision=cfg.precision, scaler=scaler, clip=cfg.clip)
                if stats.skipped and cfg.precision != "fp16" and on_nonfinite == "stop":  # fp16: the scaler's routine
                    raise RecipeError(f"step {step + 1}: the loss is not finite (gradient norm {stats.grad_norm}) "
                                      f"in {cfg.precision}; lower --lr, set --clip, or pass --on-nonfinite skip")
                meter.add(metrics)
                skipped += stats.skipped
                scheduler.step()
                step += 1
                watch.beat(step)
                profiler.step()
                if step % cfg.log_every == 0:  # a collective: every rank reads the meter at the same step
                    run.log("train", step=step, epoch=epoch, lr=scheduler.get_last_lr()[0], **meter.read(
                        grad_norm=stats.grad_norm, loss_scale=stats.scale, skipped=skipped))  # grad norm before --clip
                run.progress(step, total, every=cfg.log_every, epoch=epoch, **meter.last)
                if cfg.ckpt_every and step % cfg.ckpt_every == 0:  # a collective: rank 0 writes, the others wait
                    started = time.perf_counter()
                    ckpt.save_checkpoint(run.run_dir / "ckpt", model=model, optimizer=optimizer, scheduler=scheduler,
                                         scaler=scaler, keep=cfg.keep, progress={
                                             "epoch": epoch, "batch": done + group_index * cfg.accum, "step": step,
                                             "skipped": skipped},
                                         metadata={"recipe": "ddp_amp", "config": json.dumps(cfg.to_dict())})
                    meter.exclude(started)
                    watch.beat(step, timed=False)
                if step == cfg.max_steps:
                    break
            if val_loader:
                started = time.perf_counter()
                evaluation = steps.evaluate(model, val_loader, loss_fn=loss_fn, device=topo.device)
                meter.exclude(started)
                watch.beat(step, timed=False)
                run.log("eval", step=step, epoch=epoch, **evaluation)
                log.info(f"epoch {epoch} val_loss {evaluation['val_loss']:.4f} val_acc {evaluation['val_acc']:.4f}")
            if step == cfg.max_steps:
                break

    # Save and summarise: rank 0 writes, every rank returns the same numbers.
    if val_loader and not evaluation:  # resumed after the last epoch's evaluation, or no epoch ran
        evaluation = steps.evaluate(model, val_loader, loss_fn=loss_fn, device=topo.device)
    last = meter.read()
    weights = run.save_weights(model, metadata={"recipe": "ddp_amp", "model": cfg.model})
    summary = {**evaluation, "train_loss": last["loss"], "samples_per_s": meter.samples_per_s,
               "steps": step, "skipped_steps": skipped, "world_size": topo.world_size, "global_batch": global_batch,
               "weights": str(weights)}
    run.summary(**summary)
    return summary


if __name__ == "__main__":
    main_for(main)
