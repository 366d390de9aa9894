"""The run folder and everything a recipe does besides training, behind one object: `Run`.

    runs/ddp-3/config.json       the options, the recipe, the world size (written once, by a fresh run)
    runs/ddp-3/metrics.jsonl     one JSON object a line: kind = train | eval | resume | summary
    runs/ddp-3/model.safetensors final weights of the plain model
    runs/ddp-3/ckpt/             checkpoints
    runs/ddp-3/.lock             the host and PID of the job that holds the folder

Every rank builds the same Run; only rank 0 writes or prints. Numbers it logs are reduced over
ranks first, so what it prints speaks for the job.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from core import ckpt, steps
from core.ckpt import model_state, sharded, state_bytes
from core.ckpt_checks import check_continues
from core.config import RecipeError
from core.data import too_few_batches
from core.dist import Topology, broadcast_object
from core.folder import (
    append_line,
    check_writable,
    disk_error,
    find_resume,
    new_run_dir,
    nothing_to_resume,
    release_folder,
    run_dirs,
    take_folder,
)
from core.meter import Meter, fmt_value, progress_line


class Run:
    """One training run's folder, records, progress line, checkpoints and summary.

    with Run.start(cfg, topo, recipe="ddp", global_batch=...) as run:
        progress = run.resume(model=model, optimizer=optimizer, scheduler=scheduler)
        ... run.step(...) every step, run.checkpoint(...) after it, run.evaluate(...) every epoch
        return run.finish(model)
    """

    def __init__(
        self,
        cfg,
        topo: Topology,
        *,
        recipe: str,
        global_batch: int,
        run_dir: Path,
        resume_from,
        mesh: dict | None = None,
        fresh: bool = False,  # a new folder (not the resumed checkpoint's)
    ):
        self.cfg, self.topo, self.recipe, self.global_batch, self.mesh = cfg, topo, recipe, global_batch, mesh
        self.run_dir, self.resume_from, self.fresh, self.enabled = run_dir, resume_from, fresh, topo.is_rank0
        self.meter, self.evaluation, self.skipped = Meter(topo.device), {}, 0
        self.progress = {"epoch": 0, "samples": 0, "step": 0, "skipped": 0}
        self.started, self.resumed_step, self.saver = time.perf_counter(), None, None
        self.tty = sys.stdout.isatty()
        self.on_pause = []  # called after evaluation and checkpoints (core.monitor: not a step)
        self.stop_on_nonfinite = cfg.on_nonfinite == "stop"

    @classmethod
    def start(cls, cfg, topo: Topology, *, recipe: str, global_batch: int, mesh: dict | None = None) -> Run:
        """Rank 0 picks the folder (a new one, or the resumed checkpoint's), takes its lock and tells the others."""
        choice = None
        if topo.is_rank0:
            try:
                choice = cls._take_folder(cfg, topo, recipe=recipe, global_batch=global_batch, mesh=mesh)
            except RecipeError as err:
                choice = str(err)  # every rank raises it: none waits for a folder that never comes
        choice = broadcast_object(choice)
        if isinstance(choice, str):
            raise RecipeError(choice)
        if topo.is_rank0:  # on stderr, where the launchers read it: a stopped job names its newest checkpoint
            print(f"run folder {choice['run_dir']}", file=sys.stderr, flush=True)
        return cls(cfg, topo, recipe=recipe, global_batch=global_batch, mesh=mesh, **choice)

    @classmethod
    def _take_folder(cls, cfg, topo: Topology, *, recipe: str, global_batch: int, mesh: dict | None) -> dict:
        """Rank 0: the checks that need no model (whatever started the run), then the folder and its lock."""
        prefix = cfg.name or recipe  # RUN/ckpt/step-N of this recipe's runs continues RUN; others start a new one
        check_writable(cfg.out)
        resume_from = find_resume(getattr(cfg, "resume", ""), out=cfg.out, prefix=prefix, newest=cls.newest_checkpoint)
        if resume_from is None and getattr(cfg, "resume", "") == "auto":
            print(nothing_to_resume(cfg.out, prefix), flush=True)  # not silently a new run
        if resume_from is not None:
            dp = (mesh or {}).get("dp", topo.world_size)
            header = cls.checkpoint_header(resume_from)
            check_continues(resume_from, header, cfg, recipe=recipe, global_batch=global_batch, dp=dp)
        ours = [d.resolve() for d in run_dirs(cfg.out, prefix)]
        in_run = resume_from is not None and resume_from.resolve().parent.parent in ours
        run_dir = resume_from.parent.parent if in_run else new_run_dir(cfg.out, prefix)
        config = {"recipe": recipe, "world_size": topo.world_size, "global_batch": global_batch, "mesh": mesh}
        take_folder(run_dir, fresh=not in_run, config=config | cfg.to_dict())
        return {"run_dir": run_dir, "resume_from": resume_from, "fresh": not in_run}

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind, *exc) -> None:
        if self.saver is not None:
            try:
                self.saver.close()  # a background checkpoint write finishes before the job ends
            except OSError as err:
                raise disk_error(err, self.saver.path, 0) from None
        if self.enabled:  # a new run refused for bad input leaves no folder: --resume auto finds the one before
            release_folder(self.run_dir, discard=self.fresh and kind is not None and issubclass(kind, RecipeError))

    # Records and the terminal.
    def log(self, kind: str, **fields) -> None:
        if self.enabled:
            append_line(
                self.run_dir / "metrics.jsonl",
                {"kind": kind, "elapsed_s": round(time.perf_counter() - self.started, 3), **fields},
            )

    def print(self, message: str) -> None:
        if self.enabled:
            print(("\r\x1b[K" if self.tty else "") + message, flush=True)

    # The training loop's side effects.
    def resume(self, *, model, optimizer, scheduler=None, scaler=None) -> dict:
        """Load the checkpoint this run continues from (all ranks), or start at zero; returns the progress."""
        if self.resume_from is not None:
            self.progress.update(self._load(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler))
            self.resumed_step = self.progress["step"]
            self.log(
                "resume",
                checkpoint=str(self.resume_from),
                step=self.resumed_step,
                world_size=self.topo.world_size,
                global_batch=self.global_batch,
            )
            self.print(f"resumed from {self.resume_from} at step {self.resumed_step}")
        self.skipped = self.progress["skipped"]
        return self.progress

    def total_steps(self, loader, *, accum: int = 1) -> int:
        """Optimizer steps the run will take (the LR schedule's length): --epochs over the loader, or --max-steps."""
        try:
            batches = len(loader)
        except TypeError:  # streaming data without a length: only --max-steps can say
            if not self.cfg.max_steps:
                raise RecipeError(
                    "the training data has no length (a streaming data set): set --max-steps so "
                    "that the learning-rate schedule has an end"
                ) from None
            return self.cfg.max_steps
        if batches < accum:  # every rank has as many batches as the others: all raise alike
            raise RecipeError(
                too_few_batches(
                    loader, batches, batch_size=self.cfg.batch_size, accum=accum, world_size=self.topo.world_size
                )
            )
        total = self.cfg.epochs * (batches // accum)
        return min(total, self.cfg.max_steps) if self.cfg.max_steps else total

    def epoch(self, epoch: int) -> int:
        """Call at each epoch's start: the samples of its global order already trained on (0, or a checkpoint's)."""
        if epoch != self.progress["epoch"]:
            self.progress.update(epoch=epoch, samples=0)
        return self.progress["samples"]

    def step(self, step: int, *, metrics: dict, stats: steps.StepStats, lr: float, total: int, **extra) -> None:
        """After every optimizer step: count it, stop (or skip) on a non-finite loss, log every --log-every."""
        if stats.skipped and not stats.scaled:  # fp16's loss scaler skips overflowing steps as a routine
            if self.stop_on_nonfinite:  # every rank reads the same all-reduced norm: all stop together
                raise RecipeError(
                    f"step {step}: the loss or the gradients are not finite (gradient norm "
                    f"{stats.grad_norm}); lower --lr, set --clip, or pass --on-nonfinite skip"
                )
            self.skipped += 1
        self.meter.add(metrics)
        self.progress.update(step=step, samples=self.progress["samples"] + self.global_batch, skipped=self.skipped)
        if step % self.cfg.log_every == 0 or step == total:  # a collective: every rank reads at the same step
            last = self.meter.read()
            self.log(
                "train",
                step=step,
                epoch=self.progress["epoch"],
                lr=lr,
                grad_norm=stats.grad_norm,
                skipped=self.skipped,
                **({"loss_scale": stats.scale} if stats.scaled else {}),
                **last,
                **extra,
            )
            self.print(progress_line(step, total, epoch=self.progress["epoch"], **last))

    def checkpoint(self, step: int, *, model, optimizer, scheduler=None, scaler=None) -> None:
        """Every --ckpt-every steps: the whole train state (a collective; rank 0 writes)."""
        if not getattr(self.cfg, "ckpt_every", 0) or step % self.cfg.ckpt_every:
            return
        paused = time.perf_counter()
        metadata = {
            "recipe": self.recipe,
            "config": json.dumps(self.cfg.to_dict()),
            "mesh": json.dumps(self.mesh),
            "global_batch": str(self.global_batch),
        }
        progress = dict(self.progress, global_batch=self.global_batch)
        try:
            self._save(
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                scaler=scaler,
                progress=progress,
                metadata=metadata,
            )
        except OSError as err:  # a full disk: one line with the numbers, the checkpoints before stay whole
            holders = [*model, optimizer] if isinstance(model, list | tuple) else [model, optimizer]
            failed = self.saver.path if self.saver and self.saver.path else self.run_dir / "ckpt" / f"step-{step:06d}"
            raise disk_error(err, failed, state_bytes(*holders)) from None  # async: maybe the previous one
        self._paused(paused)

    # The checkpoint format: one file that rank 0 writes (core.sharded_run.ShardedRun: a shard per rank).
    @staticmethod
    def newest_checkpoint(run_dir: Path) -> Path | None:
        return ckpt.newest_good(run_dir / "ckpt")

    @staticmethod
    def checkpoint_header(path: Path) -> dict[str, str]:
        return ckpt.read_metadata(path)

    def _load(self, **state) -> dict:  # rank 0 reads the file and hands it out
        return ckpt.load_checkpoint(self.resume_from, world_size=self.topo.world_size, **state)

    def _save(self, **state) -> None:
        if self.saver is None:
            background = getattr(self.cfg, "ckpt_async", False)
            self.saver = ckpt.CheckpointSaver(self.run_dir / "ckpt", keep=self.cfg.keep, background=background)
        self.saver.save(**state)

    def _paused(self, since: float) -> None:
        self.meter.paused_s += time.perf_counter() - since
        for callback in self.on_pause:
            callback()

    def evaluate(self, model, loader, *, loss_fn=None, step: int, compute=None) -> dict:
        """Validation loss (and accuracy) over every rank's share, once each; its time is not training time.
        `compute`: the recipe's own evaluation, called with no arguments (a pipeline's runs its schedule)."""
        if loader is None:
            return {}
        paused = time.perf_counter()
        self.evaluation = (
            compute()
            if compute is not None
            else steps.evaluate(  # sharded: each forward is a collective, every rank runs as many
                model, loader, loss_fn=loss_fn, device=self.topo.device, in_step=sharded(model)
            )
        )
        self._paused(paused)
        self.log("eval", step=step, epoch=self.progress["epoch"], **self.evaluation)
        self.print(f"epoch {self.progress['epoch']} " + " ".join(f"{k} {v:.4f}" for k, v in self.evaluation.items()))
        return self.evaluation

    def finish(self, model, *, state: dict | None = None, **extra) -> dict:
        """Rank 0 writes the final weights and the summary; every rank returns the same numbers.
        A resumed run that had already finished trains nothing and leaves its weights as they are.
        `state`: the full state dict on rank 0 when the recipe gathers it itself (pipeline stages)."""
        step = self.progress["step"]
        if self.resumed_step is not None and self.resumed_step == step:
            self.print(f"{self.run_dir} already finished at step {step}; nothing to train, weights untouched")
            return {"steps": step, "already_finished": True}
        weights = self.run_dir / "model.safetensors"
        state = model_state(model) if state is None else state  # a collective for sharded models
        if self.enabled:
            try:
                ckpt.save_weights(state, weights, metadata={"recipe": self.recipe, "model": self.cfg.model})
            except OSError as err:
                raise disk_error(err, weights, state_bytes(model)) from None
        summary = {
            **self.evaluation,
            "train_loss": self.meter.last.get("loss"),
            **self.meter.throughput(),
            "steps": step,
            "skipped_steps": self.skipped,
            "world_size": self.topo.world_size,
            "global_batch": self.global_batch,
            **extra,
            "weights": str(weights),
            "elapsed_s": round(time.perf_counter() - self.started, 3),
        }
        self.log("summary", **summary)
        self.print("summary " + " ".join(f"{k}={fmt_value(v)}" for k, v in summary.items()))
        return summary
