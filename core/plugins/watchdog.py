"""Plug-in `watchdog`: a hang watchdog (--hang-factor, --hang-min-s) and --debug (docs/monitoring.md)."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from core.kernel.job import Options, option, say
from core.kernel.seams import SEAMS
from core.kernel.store import read_checkpoint
from core.kernel.train import Topology
from core.monitor import BEFORE_PG


@dataclass(frozen=True)
class DebugOptions(Options):
    """monitoring and debugging"""

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


def prepare_env(*, debug: bool = False, out: str = "runs", watchdog: bool = True) -> dict[str, str]:
    """Set the environment c10d reads when the process group is created; returns what was set."""
    wanted = {}
    if watchdog:  # a small flight recorder: each rank's last collectives, for the hang report
        wanted["TORCH_FR_BUFFER_SIZE"] = "64"
    if debug:
        nccl = torch.cuda.is_available() and os.environ.get("TDR_BACKEND", "nccl") == "nccl"
        # DETAIL also wraps gloo's group in a checker, and with it DDP's constructor segfaults (torch 2.13, CPU)
        wanted.update(TORCH_DISTRIBUTED_DEBUG="DETAIL" if nccl else "INFO", TORCH_FR_BUFFER_SIZE="2000")
        if nccl:  # the NCCL flight recorder: each rank dumps its last collectives when one times out
            wanted.update(
                TORCH_NCCL_DUMP_ON_TIMEOUT="1",
                TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(Path(out).resolve() / "flight-recorder-rank"),
            )
    for key, value in wanted.items():
        os.environ.setdefault(key, value)  # the user's own setting wins
    if debug:
        dist.set_debug_level_from_env()
    return {k: os.environ[k] for k in wanted}


def collectives() -> dict:
    """How many collectives this rank has issued on the default group, and the last one the flight recorder saw."""
    info = {"issued": -1, "last": None}
    if not dist.is_initialized():
        return info
    try:
        info["issued"] = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
        trace = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, True))
        if trace.get("entries"):
            last = trace["entries"][-1]
            info["last"] = {k: last.get(k) for k in ("profiling_name", "collective_seq_id", "state", "input_sizes")}
    except (RuntimeError, AttributeError, ValueError):  # no flight recorder in this build or backend
        pass
    return info


class Watchdog:
    """One thread per rank (see the module docstring), from `start` to `stop`; `beat(step)` after every step."""

    def __init__(self, run_dir: Path, topo: Topology, *, factor: float, min_s: float, timeout_s: float):
        self.run_dir, self.topo = Path(run_dir), topo
        self.factor, self.min_s, self.cap_s = factor, min_s, 0.9 * timeout_s  # report before the collective fails
        self.poll_s = min(1.0, min_s / 4)
        self.durations: deque[float] = deque(maxlen=50)
        self.step, self.last_beat, self.fired_at, self.held = 0, time.perf_counter(), -1, False
        self._stop = threading.Event()
        prefix = f"tdr-watchdog/{self.run_dir.name}/"  # this run's keys: a group may train more than one run
        self.store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        self._thread = threading.Thread(target=self._watch, name="tdr-watchdog", daemon=True)

    def start(self) -> Watchdog:
        """Start the thread (factor 0: the watchdog is off, and nothing starts)."""
        if self.factor > 0:
            self._thread.start()
        return self

    def hold(self) -> None:
        """Evaluation or a checkpoint runs until the next beat: no step's median applies, only the cap."""
        self.held = True

    def beat(self, step: int, *, timed: bool = True) -> None:
        """A step ended (timed=False: evaluation or a checkpoint ended; not a step time for the median)."""
        now = time.perf_counter()
        if timed:
            self.durations.append(now - self.last_beat)
        self.step, self.last_beat, self.held = step, now, False

    def threshold(self) -> float:
        if self.held or len(self.durations) < 5:  # no median yet (the first steps compile, warm caches): the cap
            return self.cap_s
        return min(max(self.factor * statistics.median(self.durations), self.min_s), self.cap_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):  # an Event, not sleep: stop() ends the wait at once
            stalled = time.perf_counter() - self.last_beat
            if stalled > self.threshold() and self.fired_at != self.step:
                self.fired_at = self.step
                self._fire(stalled)

    def _fire(self, stalled: float) -> None:
        info = {
            "rank": self.topo.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": self.step,
            "stalled_s": round(stalled, 1),
            "threshold_s": round(self.threshold(), 1),
            **collectives(),
        }
        path = self.run_dir / f"hang-rank{self.topo.rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)  # another node's rank: the run folder may be rank 0's only
        with open(path, "w") as f:
            f.write(json.dumps(info) + "\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)  # C-level: works while the main thread is stuck
        say(  # every rank's; rank 0's also in train.log
            None,
            f"warning: watchdog: rank {self.topo.rank}: step {self.step + 1} has run {stalled:.0f}s (threshold "
            f"{info['threshold_s']}s); stack in {path}",
            level="WARNING",
        )
        self.store.set(f"rank{self.topo.rank}", json.dumps(info))
        if self.topo.rank == 0:
            self._report(info)

    def _report(self, mine: dict) -> None:
        """Rank 0: gather the other ranks' summaries (a few polls' grace) and name the ranks behind."""
        keys = [f"rank{r}" for r in range(self.topo.world_size)]
        deadline = time.perf_counter() + 4 * self.poll_s + 2
        while not self.store.check(keys) and time.perf_counter() < deadline:
            self._stop.wait(self.poll_s / 2)
        infos = {0: mine}
        for r in range(1, self.topo.world_size):
            if self.store.check([f"rank{r}"]):
                infos[r] = json.loads(self.store.get(f"rank{r}"))
                self.store.delete_key(f"rank{r}")  # read once: a later stall waits for fresh summaries
        report = behind(infos, world_size=self.topo.world_size)
        say(None, f"warning: watchdog: {report['message']}; stacks in {self.run_dir}/hang-rank*.txt", level="WARNING")
        with open(self.run_dir / "hang-report.json", "w") as f:
            json.dump({**report, "ranks": infos}, f, indent=2)


def behind(infos: dict[int, dict], *, world_size: int) -> dict:
    """Which ranks the others wait for: the fewest collectives issued, then the lowest step; silent ranks apart."""
    progress = {r: (i["step"], i["issued"]) for r, i in infos.items()}
    slowest = min(progress.values())
    late = sorted(r for r, p in progress.items() if p == slowest)
    silent = sorted(set(range(world_size)) - set(infos))
    if len(late) == len(progress) and not silent:
        message = f"all {world_size} ranks stalled at the same point (step {slowest[0]}, {slowest[1]} collectives)"
    else:
        message = (
            f"rank(s) {', '.join(map(str, late))} behind: step {slowest[0]}, {slowest[1]} collectives "
            f"issued; the others are ahead, waiting for them"
        )
    if silent:
        message += f"; rank(s) {', '.join(map(str, silent))} sent no report (stuck holding the GIL, or dead)"
    return {"behind": late, "silent": silent, "message": message}


WATCH: dict = {}  # this process's watchdog while a run trains: {"on": Watchdog}


def prepare(cfg) -> None:
    """Before the process group exists: the environment it reads (a recipe without these options: nothing)."""
    if hasattr(cfg, "hang_factor"):
        prepare_env(debug=cfg.debug, out=cfg.out, watchdog=cfg.hang_factor > 0)


def start_watch(cfg, run) -> None:
    """Every rank, once the run folder is open: the thread starts (--hang-factor 0: the watchdog is off)."""
    stop_watch()
    if getattr(cfg, "hang_factor", 0) > 0:
        topo = Topology(dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
        watch = Watchdog(run.path, topo, factor=cfg.hang_factor, min_s=cfg.hang_min_s, timeout_s=cfg.timeout_s)
        if run.resume_from is not None:  # the step training continues after: what a hang report names
            watch.step = json.loads(read_checkpoint(run.resume_from, tensors=False)[1]["progress"])["step"]
        WATCH["on"] = watch.start()


def beat(metrics: dict) -> None:
    if watch := WATCH.get("on"):
        watch.beat(watch.step + 1)


@contextlib.contextmanager
def held():
    """Evaluation or a checkpoint: not a step for the median; the watchdog still reports one that reaches its cap."""
    watch = WATCH.get("on")
    if watch is None:
        yield
        return
    watch.hold()
    try:
        yield
    finally:
        watch.beat(watch.step, timed=False)


def stop_watch(*args, **kwargs) -> None:
    if watch := WATCH.pop("on", None):
        watch.stop()


SEAMS["option_groups"].append(DebugOptions)
BEFORE_PG.append(prepare)
SEAMS["before_job"].append(start_watch)
SEAMS["on_step"].append(beat)
SEAMS["pauses"].append(held)
SEAMS["after_job"].append(stop_watch)
SEAMS["on_fail"].append(stop_watch)
