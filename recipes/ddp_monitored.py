"""ddp_monitored: ddp plus the monitoring, debugging and tuning a long job needs.

    ./launch_single_node.sh ddp_monitored --epochs 5 --hang-factor 20
    torchrun --standalone --nproc-per-node 2 -m recipes run ddp_monitored --comm-hook fp16 --bucket-mb 50
    python -m recipes run ddp_monitored --profile --max-steps 20   # one process, no launcher
    ./launch_single_node.sh ddp_monitored --ckpt-every 100 --ckpt-async --log-to tensorboard

Each train record gets where the step's time went (data, compute, comm_wait, optimizer; the
slowest rank's step), peak memory and, on a known GPU, MFU. A watchdog thread on every rank writes
every thread's stack and names the rank the others wait for when a step takes --hang-factor times
the median; --debug sets TORCH_DISTRIBUTED_DEBUG and the NCCL flight recorder; --profile writes a
torch.profiler trace per rank. Tuning: DDP comm hooks (fp16, bf16, PowerSGD compression), bucket
size, gradients as bucket views, torch.compile after wrapping, activation checkpointing per block,
channels-last; --ckpt-async writes checkpoints in a background thread (docs/monitoring.md).
"""

import itertools
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from core import ckpt, comm, data, dist, folder, meter, models, monitor, steps, trackers, weights
from core.ckpt_async import AsyncCheckpoints, CheckpointSaver
from core.config import Checkpointing, DDPOptions, Training, cli_main
from core.kernel.loader import seed_all, set_epoch, to_device
from core.kernel.pg import cleanup_pg
from core.loss import make_loss
from core.loss_options import choose_loss
from core.metrics import flops_per_sample, peak_flops
from core.plugins.hf import HFExport, write_hf_folder
from core.plugins.init_from import InitFrom, load_weights
from core.plugins.replicas import replicas_report
from core.tuning import TuningOptions, checkpoint_blocks, to_channels_last
from core.watchdog import DebugOptions, Watchdog, prepare_env


@dataclass(frozen=True)
class Config(
    Training,
    Checkpointing,
    AsyncCheckpoints,
    DDPOptions,
    comm.CommOptions,
    TuningOptions,
    DebugOptions,
    trackers.Tracking,
    InitFrom,
    HFExport,
):
    """ddp's options, and the monitoring, debugging, tuning, asynchronous checkpoint and tracker ones."""


def check(cfg: Config) -> None:
    """Before launch: a comm hook the backend lacks, and tuning options the model does not fit (on the meta device)."""
    on_gpu = dist.pick_device(0).type == "cuda"  # what init_pg picks (TDR_BACKEND aside)
    comm.check_hook(cfg.comm_hook, backend="nccl" if on_gpu else "gloo")
    if cfg.channels_last:
        to_channels_last(meta_model(cfg))
    if cfg.activation_checkpointing:
        checkpoint_blocks(meta_model(cfg))


def meta_model(cfg: Config) -> torch.nn.Module:
    """The model on the meta device: its layers and blocks, found without memory."""
    with torch.device("meta"):
        return models.build_model(cfg.model)


def main(cfg: Config) -> dict:
    check(cfg)
    prepare_env(debug=cfg.debug, out=cfg.out, watchdog=cfg.hang_factor > 0)  # read when the group is made
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, WORLD_SIZE, LOCAL_RANK; alone: a world of one
    try:
        return train(cfg, topo)
    finally:
        cleanup_pg()


def train(cfg: Config, topo: dist.Topology) -> dict:
    totals = meter.Meter(topo.device)  # the loss and accuracy of each log window, summed over the ranks
    # resumed and finished, with the lengths it finished with: nothing is touched (larger ones: it trains longer)
    if done := folder.finished(cfg, topo, recipe="ddp_monitored", header=ckpt.read_metadata):
        return done
    global_batch = cfg.batch_size * topo.world_size

    # Build. The same seed on every rank gives every replica the same initial weights. The order is torch's:
    # change the plain model, wrap it, register the comm hook, compile the wrapper.
    seed_all(cfg.seed)  # torch's, Python's and numpy's generators: the same weights and data on every rank
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    if cfg.init_from:  # a new run from earlier weights (a resumed run then takes its checkpoint's)
        load_weights(model, cfg.init_from)
    if cfg.sync_batchnorm:  # BatchNorm statistics over the global batch (GPUs only: DDP refuses it on CPU)
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.channels_last:  # conv weights in NHWC, the layout tensor cores read fastest (in place)
        to_channels_last(model)
    if cfg.activation_checkpointing:  # each block's activations recomputed in backward instead of kept
        checkpoint_blocks(model)
    ddp_model = DistributedDataParallel(
        model,
        device_ids=[topo.device.index] if topo.device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
        bucket_cap_mb=cfg.bucket_mb,  # one all-reduce per bucket, started as soon as its gradients are ready
        gradient_as_bucket_view=cfg.grad_as_bucket_view,  # .grad points into the bucket: one copy less
    )
    comm.register(ddp_model, cfg.comm_hook, backend=topo.backend)  # fp16/bf16/PowerSGD compression; none: DDP's own
    train_model = torch.compile(ddp_model) if cfg.compile else ddp_model  # after DDP: graph breaks at its buckets
    torch.manual_seed(cfg.seed + topo.rank)  # from here each rank draws its own dropout, as one process would
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
    val_loader = data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    total = data.total_steps(train_loader, epochs=cfg.epochs, max_steps=cfg.max_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = make_loss(model=model)  # the model's own loss, else cross-entropy on the logits (core.loss's table)
    loss_fn = choose_loss(cfg.loss, loss_fn, model=model)  # --loss ce, mse, model or module:function
    timer = monitor.StepClock(topo.device)  # where each step's time goes, from hooks: no code in the step
    timer.attach(train_model, optimizer)
    peak = peak_flops(topo.device)  # MFU on a known GPU only: its peak FLOP/s, and one sample's FLOPs on meta
    flops = peak and flops_per_sample(lambda: models.build_model(cfg.model), train_set[0])

    # The run folder: a new one, or the one of the checkpoint --resume names, refused before it is touched when
    # the checkpoint cannot continue in this job. Then that checkpoint's state, every rank's own generator too,
    # and the trackers --log-to names, which continue from the checkpoint's step.
    checkpoints = dict(newest=ckpt.newest_good, header=ckpt.read_metadata)  # how a resume finds and reads one
    run = folder.open_run(cfg, topo, recipe="ddp_monitored", global_batch=global_batch, **checkpoints)
    start = ckpt.load_checkpoint(run, model=model, optimizer=optimizer, scheduler=scheduler)
    meter.carry_window(totals, start["window"], writer=run.writer)  # the log window open at the checkpoint
    run = trackers.attach(run, cfg, step=start["step"], header=ckpt.read_metadata)
    saver = CheckpointSaver(background=cfg.ckpt_async)  # --ckpt-async: a thread writes the file
    watch = Watchdog(run.path, topo, factor=cfg.hang_factor, min_s=cfg.hang_min_s, timeout_s=cfg.timeout_s)
    watch.start()  # a thread: a step that takes --hang-factor times the median gets every rank's stack written
    profiler = monitor.profiler(run.path, topo, enabled=cfg.profile)  # --profile: a trace of a few steps per rank
    profiler.start()

    # Train. DDP averages the gradients inside backward(): every replica takes the same step.
    step, skipped, evaluation = start["step"], start["skipped"], {}
    for epoch in range(start["epoch"], cfg.epochs):
        if step >= total and epoch > start["epoch"]:  # --max-steps reached (resumed at the last step: evaluate)
            break
        consumed = start["samples"] if epoch == start["epoch"] else 0  # resumed mid-epoch: skip what was trained
        set_epoch(train_loader, epoch, consumed=consumed)
        for batch in itertools.islice(train_loader, total - step):
            batch = to_device(batch, topo.device)
            metrics, grad_norm = steps.step_plain(train_model, batch, optimizer=optimizer, loss_fn=loss_fn)
            step, consumed = step + 1, consumed + global_batch
            skipped += steps.check_finite(grad_norm, step=step, on_nonfinite=cfg.on_nonfinite)
            scheduler.step()  # after the check: a stop at step 1 prints the error line alone
            totals.add(metrics)
            watch.beat(step)
            profiler.step()
            if step % cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
                numbers = {"lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm, "skipped": skipped}
                timing = monitor.breakdown(  # the phases of every rank's steps since the last record (a collective)
                    timer.take(), device=topo.device, global_batch=global_batch, flops_per_sample=flops, peak_flops=peak
                )
                meter.log_train(run, totals, step=step, total=total, epoch=epoch, **numbers, **timing)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == total:  # the last: it can go on
                window = meter.open_window(totals)  # its sums so far: a resume goes on with them
                progress = dict(epoch=epoch, samples=consumed, step=step, skipped=skipped, window=window)
                with meter.paused(totals):
                    with monitor.paused(timer, watch):
                        state = {"optimizer": optimizer, "scheduler": scheduler}  # the train state besides the model
                        saver.save(run, model=model, **state, progress=progress, keep=cfg.keep)
        with meter.paused(totals):  # each rank evaluates its share; the sums are all-reduced
            with monitor.paused(timer, watch):
                evaluation = steps.evaluate(model, val_loader, loss_fn=loss_fn, device=topo.device)
        meter.log_eval(run, evaluation, step=step, epoch=epoch)
    profiler.stop()
    watch.stop()
    saver.close()  # the last background write lands before the final weights (or its failure is one line)

    # Rank 0 alone writes the weights; every rank vouches that it holds the same ones.
    saved = weights.write_weights(run, model.state_dict())
    write_hf_folder(run, model, model.state_dict(), attr=cfg.hf_attr, max_shard_mb=cfg.hf_shard_mb)
    same = replicas_report(model.state_dict())  # {"replicas_identical": ...}, in the summary
    summary = meter.log_summary(run, totals, evaluation, steps=step, skipped=skipped, weights=saved, **same)
    trackers.close(run)
    return summary


if __name__ == "__main__":
    cli_main(main, Config)
