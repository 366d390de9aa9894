"""ddp_monitored: ddp plus the monitoring, debugging and tuning a long job needs.

    ./launch_single_node.sh ddp_monitored --epochs 5 --hang-factor 20
    torchrun --standalone --nproc-per-node 2 -m recipes run ddp_monitored --comm-hook fp16 --bucket-mb 50
    python -m recipes run ddp_monitored --profile --max-steps 20   # one process, no launcher

Each train record gets where the step's time went (data, compute, comm_wait, optimizer; the
slowest rank's step), peak memory, the gradient norm and, on a known GPU, MFU. A watchdog thread
on every rank writes every thread's stack and names the rank the others wait for when a step
takes --hang-factor times the median; --debug sets TORCH_DISTRIBUTED_DEBUG and the NCCL flight
recorder; --profile writes a torch.profiler trace per rank. Tuning: DDP comm hooks (fp16, bf16,
PowerSGD compression), bucket size, gradients as bucket views, torch.compile after wrapping,
activation checkpointing per block, channels-last (docs/monitoring.md has the numbers).
"""

import itertools
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from core import comm, data, dist, models, steps, tuning, watchdog
from core.config import AsyncCheckpoints, Checkpointing, DDPOptions, Training, cli_main, option
from core.monitor import Monitor
from core.run import Run


@dataclass(frozen=True)
class Config(Training, Checkpointing, AsyncCheckpoints, DDPOptions):
    """ddp's options, and the monitoring and tuning ones."""

    comm_hook: str = option(
        "none", "gradient all-reduce: plain, compressed to fp16/bf16, or PowerSGD low-rank", choices=comm.HOOKS
    )
    bucket_mb: float = option(
        25.0,
        "DDP gradient bucket size in MB (one all-reduce per bucket)",
        check=lambda v: 0 < v <= 1e5,
        fix="use a size in MB from above 0 to 100000 (25: DDP's)",
    )
    grad_as_bucket_view: bool = option(False, "gradients are views into DDP's buckets (saves a copy and memory)")
    compile: bool = option(False, "torch.compile the model (after DDP wraps it)")
    activation_checkpointing: bool = option(False, "recompute each block's activations in backward (less memory)")
    channels_last: bool = option(False, "channels-last memory format for conv models (GPU)")
    hang_factor: float = option(
        20.0,
        "watchdog: dump every rank's stack when a step takes this many times the median step (0: off)",
        check=lambda v: v == 0 or 1 < v <= 1e6,
        fix="use 0 (off) or a multiple above 1 of the median step",
    )
    hang_min_s: float = option(
        60.0,
        "watchdog: never call a step shorter than this many seconds a hang",
        check=lambda v: 0 < v <= 1e7,
        fix="use a positive number of seconds",
    )
    debug: bool = option(False, "TORCH_DISTRIBUTED_DEBUG, and the NCCL flight recorder on GPU")
    profile: bool = option(False, "write a torch.profiler trace of a few steps, one file per rank")


def main(cfg: Config) -> dict:
    watchdog.prepare_env(debug=cfg.debug, out=cfg.out, watchdog=cfg.hang_factor > 0)  # read when the group is made
    topo = dist.init_pg(timeout_s=cfg.timeout_s)  # torchrun's RANK, LOCAL_RANK, WORLD_SIZE; a world of one without
    try:
        with Run.start(cfg, topo, recipe="ddp_monitored", global_batch=cfg.batch_size * topo.world_size) as run:
            return train(cfg, topo, run)
    finally:
        dist.cleanup_pg()


def train(cfg: Config, topo: dist.Topology, run: Run) -> dict:
    # Build. The same seed on every rank gives every replica the same initial weights.
    torch.manual_seed(cfg.seed)
    train_set, val_set, collate = data.build_data(cfg.data)
    model = models.build_model(cfg.model).to(topo.device)
    model = comm.prepare_batchnorm(model, sync=cfg.sync_batchnorm, warn=run.print)
    # The order is torch's: change the plain model, wrap it, register the hook, compile the wrapper.
    model = tuning.before_wrap(
        model, channels_last=cfg.channels_last, activation_checkpointing=cfg.activation_checkpointing
    )
    ddp_model = DistributedDataParallel(
        model,
        device_ids=[topo.device.index] if topo.device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
        bucket_cap_mb=cfg.bucket_mb,
        gradient_as_bucket_view=cfg.grad_as_bucket_view,
    )
    comm.register(ddp_model, cfg.comm_hook, backend=topo.backend)
    train_model = tuning.after_wrap(ddp_model, compile=cfg.compile)
    train_loader = data.make_loader(train_set, topo, batch_size=cfg.batch_size, seed=cfg.seed, collate_fn=collate)
    val_loader = data.make_loader(val_set, topo, batch_size=cfg.batch_size, train=False, collate_fn=collate)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    total = run.total_steps(train_loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(total, 1))
    loss_fn = steps.make_loss(cfg.loss)
    progress = run.resume(model=model, optimizer=optimizer, scheduler=scheduler)

    # Train. DDP averages the gradients inside backward(); the monitor times each phase from hooks.
    step = progress["step"]
    with Monitor(run, train_model, optimizer, cfg=cfg, sample=next(iter(train_set), None)) as monitor:
        for epoch in range(progress["epoch"], cfg.epochs):
            if step >= total:  # --max-steps reached; a resumed run that had finished stops here
                break
            data.set_epoch(train_loader, epoch, consumed=run.epoch(epoch))  # resumed mid-epoch: skip what was trained
            for batch in itertools.islice(train_loader, total - step):
                batch = data.to_device(batch, topo.device)
                metrics, stats = steps.train_step(train_model, [batch], optimizer=optimizer, loss_fn=loss_fn)
                scheduler.step()
                step += 1
                run.step(
                    step, metrics=metrics, stats=stats, lr=scheduler.get_last_lr()[0], total=total, **monitor.step(step)
                )
                run.checkpoint(step, model=model, optimizer=optimizer, scheduler=scheduler)
            run.evaluate(model, val_loader, loss_fn=loss_fn, step=step)

    # Rank 0 alone writes the weights: every rank vouches that it holds the same ones.
    return run.finish(model, **comm.replicas_report(model))


if __name__ == "__main__":
    cli_main(main, Config)
