"""Monitoring and debugging added to a Run: where each step's time goes, MFU, memory, the hang
watchdog and the profiler (docs/monitoring.md). Costs a recipe three lines:

    watchdog.prepare_env(debug=cfg.debug, out=cfg.out, watchdog=cfg.hang_factor > 0)   # before init_pg
    with Monitor(run, train_model, optimizer, cfg=cfg, sample=train_set[0]) as monitor:
        ... run.step(step, ..., **monitor.step(step))                                    # every step
"""

from __future__ import annotations

import torch

from core import metrics, models, watchdog


class Monitor:
    """Step-phase clock, memory, gradient norm and MFU in the train records; watchdog and profiler around the loop."""

    def __init__(self, run, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, cfg, sample=None):
        self.run, self.every = run, cfg.log_every
        self.clock = metrics.StepClock(run.topo.device)
        self.clock.attach(model, optimizer)
        self.params = [p for p in model.parameters() if p.requires_grad]
        peak = metrics.peak_flops(run.topo.device, getattr(cfg, "precision", "fp32"))  # MFU on a known GPU only
        inputs = sample[0] if isinstance(sample, tuple | list) else sample
        self.flops = (
            peak and inputs is not None and metrics.flops_per_sample(lambda: models.build_model(cfg.model), inputs)
        )
        self.peak = peak
        self.watch = watchdog.Watchdog(
            run.run_dir, run.topo, factor=cfg.hang_factor, min_s=cfg.hang_min_s, timeout_s=cfg.timeout_s
        )
        self.profiler = watchdog.profiler(run.run_dir, run.topo, enabled=cfg.profile)
        run.on_pause.append(self.paused)

    def __enter__(self) -> Monitor:
        self.watch.__enter__()
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.profiler.__exit__(*exc)
        self.watch.__exit__(*exc)

    def paused(self) -> None:
        """Evaluation or a checkpoint ran: not a step, for neither the clock nor the watchdog."""
        self.clock.skip_gap()
        self.watch.beat(self.watch.step, timed=False)

    def step(self, step: int) -> dict[str, float]:
        """Every step: beat the watchdog, step the profiler; every --log-every steps the breakdown (a collective)."""
        self.watch.beat(step)
        self.profiler.step()
        if step % self.every:
            return {}
        local = {f"{k}_ms": v for k, v in self.clock.take().items()}
        local["peak_mem_mb"] = metrics.peak_memory_mb(self.run.topo.device)
        local["grad_norm_local"] = metrics._grad_norm(self.params)
        table = metrics._gather(torch.tensor(list(local.values()), dtype=torch.float64, device=self.run.topo.device))
        per_key = dict(zip(local, table.unbind(1)))  # key -> one value per rank
        steps = per_key["steps_ms"].clamp(min=1)
        mean = {p: per_key[f"{p}_ms"] / steps for p in metrics.PHASES}
        record = {f"{p}_ms": float(v.mean()) for p, v in mean.items()}
        record["step_ms_max"] = float(mean["step"].max())  # the slowest rank sets the pace
        record["peak_mem_mb"] = float(per_key["peak_mem_mb"].max())  # the fullest rank is what runs out
        if self.flops and self.peak and record["step_ms"] > 0:
            per_rank_samples = self.run.global_batch / table.shape[0]
            record["mfu"] = self.flops * per_rank_samples / (record["step_ms"] / 1e3) / self.peak
        return record
