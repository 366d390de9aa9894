"""ddp: DistributedDataParallel, the base recipe every other one builds on.

    ./launch_single_node.sh ddp --epochs 5
    torchrun --standalone --nproc-per-node 2 -m recipes run ddp --epochs 5
    python -m recipes run ddp --epochs 5          # one process, no launcher

Builds on: nothing.

Every rank holds a whole replica of the model and a disjoint share of each epoch's data;
backward() all-reduces the gradients, so every replica takes the step one process would
take on the whole global batch (batch size x world size). Compared with the source's
train_ddp: the device comes from LOCAL_RANK (RANK breaks on the second node), the port is
torchrun's (a fixed 12355 collides), loss and accuracy are reduced over all ranks (not rank
0's share), validation runs every epoch, and rank 0 writes safetensors with no `module.` prefix.

Monitoring and tuning (docs/monitoring.md): rank 0 shows progress; metrics.jsonl gets the step-time
breakdown, memory, gradient norm (and MFU on a GPU); a watchdog names a rank that stops; --comm-hook,
--bucket-mb, --compile, --activation-checkpointing, --channels-last, --debug and --profile are options.
"""
import json
import time

import torch

from core import ckpt, comm, data, dist, models, parallel, steps, tuning, watchdog
from core.cli import main_for
from core.config import TrainConfig
from core.log import setup_logging
from core.metrics import Meter, flops_per_sample, peak_flops, planned_steps
from core.registry import register
from core.run import RunWriter


@register("ddp", summary="DistributedDataParallel; loss and accuracy reduced over all ranks")
def main(cfg: TrainConfig) -> dict:
    watchdog.prepare_env(debug=cfg.debug, out=cfg.out, watchdog=cfg.hang_factor > 0)  # read by init_pg
    topo = dist.init_pg(timeout_s=cfg.timeout_s)
    try:
        return train(cfg, topo)
    finally:
        dist.cleanup_pg()


def train(cfg: TrainConfig, topo: dist.Topology) -> dict:
    log = setup_logging(topo.rank)
    resume_from = ckpt.choose_resume(cfg.resume, out=cfg.out, prefix=cfg.name)  # rank 0 decides for all
    run = RunWriter.create(cfg.out, cfg.name, topo, run_dir=ckpt.run_dir_of(resume_from))
    run.write_config({"recipe": "ddp", "world_size": topo.world_size, **cfg.to_dict()})

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
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    total = planned_steps(epochs=cfg.epochs, batches_per_epoch=len(train_loader), max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.cross_entropy
    progress = {"epoch": 0, "batch": 0, "step": 0}  # where training starts: 0, or a checkpoint's place
    if resume_from:
        progress = ckpt.load_checkpoint(resume_from, model=model, optimizer=optimizer, scheduler=scheduler,
                                        world_size=topo.world_size)
        log.info(f"resumed from {resume_from} at epoch {progress['epoch']} step {progress['step']}")
    log.info(f"ddp: {topo.world_size} rank(s) on {topo.device.type} ({topo.backend}), "
             f"global batch {cfg.batch_size * topo.world_size}, {total} steps -> {run.run_dir}")

    # Train. The meter times each step's phases from hooks; the watchdog reports a rank that stops stepping.
    peak = peak_flops(topo.device, cfg.precision)  # MFU on a known GPU
    sample_x, sample_y = train_set[0]  # a sequence model's target has one token per position: tokens/s too
    flops = peak and flops_per_sample(lambda: models.build_model(cfg.model), sample_x)  # counted on the meta device
    meter = Meter(topo.device, peak_flops=peak, flops_per_sample=flops,
                  tokens_per_sample=torch.as_tensor(sample_y).numel()).attach(train_model, optimizer)
    watch = watchdog.Watchdog(run.run_dir, topo, factor=cfg.hang_factor, min_s=cfg.hang_min_s, timeout_s=cfg.timeout_s)
    step, evaluation = progress["step"], {}
    with watch, watchdog.profiler(run.run_dir, topo, enabled=cfg.profile) as profiler:
        for epoch in range(progress["epoch"], cfg.epochs):
            done = progress["batch"] if epoch == progress["epoch"] else 0  # batches a checkpoint already covers
            # A new shuffle each epoch, the same on every rank; a resumed epoch skips what it already trained on.
            train_loader.sampler.set_epoch(epoch, skip=done * cfg.batch_size)
            for batch_index, batch in enumerate(train_loader, start=done + 1):
                batch = data.to_device(batch, topo.device)
                meter.add(steps.step_plain(train_model, batch, optimizer=optimizer, loss_fn=loss_fn))
                scheduler.step()
                step += 1
                watch.beat(step)
                profiler.step()
                if step % cfg.log_every == 0:  # a collective: every rank reads the meter at the same step
                    run.log("train", step=step, epoch=epoch, lr=scheduler.get_last_lr()[0], **meter.read())
                run.progress(step, total, every=cfg.log_every, epoch=epoch, **meter.last)
                if cfg.ckpt_every and step % cfg.ckpt_every == 0:  # a collective: rank 0 writes, the others wait
                    started = time.perf_counter()
                    ckpt.save_checkpoint(run.run_dir / "ckpt", model=model, optimizer=optimizer, scheduler=scheduler,
                                         progress={"epoch": epoch, "batch": batch_index, "step": step}, keep=cfg.keep,
                                         metadata={"recipe": "ddp", "config": json.dumps(cfg.to_dict())})
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
    weights = run.save_weights(model, metadata={"recipe": "ddp", "model": cfg.model})
    summary = {**evaluation, "train_loss": last["loss"], "samples_per_s": meter.samples_per_s,
               "steps": step, "world_size": topo.world_size, "global_batch": cfg.batch_size * topo.world_size,
               # rank 0 alone writes the weights: every rank, on every node, vouches that it holds the same
               "replicas_identical": dist.same_on_all_ranks(models.fingerprint(model)),
               "weights": str(weights)}
    run.summary(**summary)
    return summary


if __name__ == "__main__":
    main_for(main)
