"""Plug-in `profile`: --profile, a torch.profiler Chrome trace of steps 6-8 per rank in RUN/profile/rank{R}.json."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.kernel.job import Options, option
from core.kernel.seams import SEAMS

PROFILER: dict = {}  # this process's profiler while a run with --profile trains: {"on": torch.profiler.profile}


@dataclass(frozen=True)
class ProfileOption(Options):
    """monitoring and debugging"""

    profile: bool = option(False, "write a torch.profiler trace of a few steps, one file per rank")


def start_profiler(cfg, run) -> None:
    """Every rank, once the run folder is open: the profiler starts (its schedule skips the first 5 steps)."""
    PROFILER.clear()
    if not getattr(cfg, "profile", False):
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    folder = run.path / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / f"rank{dist.get_rank()}.json"
    PROFILER["on"] = torch.profiler.profile(
        activities=activities,
        record_shapes=True,
        schedule=torch.profiler.schedule(skip_first=5, wait=0, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace)),
    )
    PROFILER["on"].start()


def profile_step(metrics: dict) -> None:
    if "on" in PROFILER:
        PROFILER["on"].step()


def stop_profiler(cfg, run, model) -> None:
    if "on" in PROFILER:
        PROFILER.pop("on").stop()


SEAMS["option_groups"].append(ProfileOption)
SEAMS["before_job"].append(start_profiler)
SEAMS["on_step"].append(profile_step)
SEAMS["after_job"].append(stop_profiler)
