"""Plug-in `trackers`: --log-to tensorboard, wandb or both; every record metrics.jsonl gets also goes there (rank 0).

Every number a record holds is already reduced over ranks. The optimizer step is the x-axis of both, and a resumed job
continues the same curves: TensorBoard's event files live in RUN/tensorboard and a resumed writer purges what the
crashed job logged after the checkpoint (the resumed job logs it again); the W&B run id is kept in RUN/wandb-run.json,
so a resumed job (from this folder's checkpoint or another's) continues the W&B run its checkpoint was logged to, whose
steps only grow. WANDB_MODE=offline writes one RUN/wandb/offline-run-* folder per job, all of one run id: `wandb sync
RUN/wandb` uploads them in start order, as one resumed run. The trackers open once the run folder is chosen, before
the checkpoint is read (a tracker that cannot open refuses the run before it writes a record), and close with the
summary record, or with a failed run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

from core.kernel.job import Options, RecipeError, option
from core.kernel.seams import SEAMS
from core.kernel.store import read_checkpoint

TRACKERS = ("tensorboard", "wandb")  # each needs the package of its name: the setup.cfg extra of that name
WANDB_FILE = "wandb-run.json"
NOT_SCALARS = ("kind", "step", "elapsed_s")  # step: the x-axis; elapsed_s restarts with each process
OPENED: dict = {}  # this process's open trackers: {"trackers": Trackers}


@dataclass(frozen=True)
class Tracking(Options):
    """trackers"""

    log_to: str = option("", "also log to tensorboard, wandb, or both (comma-separated); rank 0 logs")
    wandb_project: str = option(
        "",
        "W&B project (default: $WANDB_PROJECT, else torch-dist-recipes); WANDB_MODE=offline logs without a network",
        check=lambda name: len(name) <= 128 and not set(name) & set("/\\#?%:"),
        fix="use a W&B project name of at most 128 characters, without / \\ # ? % :",
    )

    def __post_init__(self):
        super().__post_init__()
        kinds = check_trackers(self.log_to)
        if self.wandb_project and "wandb" not in kinds:  # never silently ignored
            raise RecipeError(
                f"--wandb-project {self.wandb_project}: names the W&B project of --log-to wandb, which is not given; "
                f"add --log-to wandb, or drop --wandb-project"
            )


def check_trackers(log_to: str) -> list[str]:
    """The trackers `--log-to` names, in order; one RecipeError line for an unknown name or a missing package."""
    kinds = list(dict.fromkeys(name.strip() for name in log_to.split(",") if name.strip()))
    if unknown := [kind for kind in kinds if kind not in TRACKERS]:
        raise RecipeError(f"--log-to {log_to}: no tracker named {unknown[0]!r}; use tensorboard, wandb, or both")
    if missing := [kind for kind in kinds if importlib.util.find_spec(kind) is None]:  # finds without importing
        names = " and ".join(missing)
        raise RecipeError(
            f"--log-to {log_to}: {names} {'is' if len(missing) == 1 else 'are'} not installed; "
            f"pip install -e '.[{','.join(missing)}]' (or pip install {' '.join(missing)})"
        )
    return kinds


class Trackers:
    """The open trackers of rank 0: `write` each record, `state` (the W&B run), `close` at the end."""

    def __init__(self, *, tensorboard=None, wandb_run=None, caught: ThreadErrors | None = None):
        self.tensorboard, self.wandb_run = tensorboard, wandb_run
        # a resumed online W&B run starts at the step after its last row: the rows it has stay as they are
        self.wandb_from = wandb_run.starting_step if wandb_run is not None else 0
        self.caught = caught or ThreadErrors()  # the errors of the trackers' own threads, said here as one line

    def write(self, record: dict) -> None:
        """Log one metrics.jsonl record's numbers as KIND/NAME at its optimizer step (the summary's: `steps`)."""
        kind = record["kind"]
        step = record["steps"] if kind == "summary" else record["step"]
        scalars = {
            f"{kind}/{key}": float(value)
            for key, value in record.items()
            if key not in NOT_SCALARS and isinstance(value, int | float)  # a path, a None (no value) are not
        }
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, global_step=step)
            self.tensorboard.flush()  # a record a line, as metrics.jsonl: a live dashboard, a crash loses little
        if self.wandb_run is not None:
            if kind == "summary":
                self.wandb_run.summary.update(scalars)
            elif step >= self.wandb_from:  # W&B steps only grow: a lower one would be dropped with a warning
                self.wandb_run.log(scalars, step=step)  # rows of one step (train, eval) merge into one
        self.caught.say()

    def state(self) -> dict[str, str]:
        """The W&B run these logs continue in (RUN/wandb-run.json holds it too); TensorBoard's needs none."""
        if self.wandb_run is None:
            return {}
        return {"wandb_run_id": self.wandb_run.id, "wandb_project": self.wandb_run.project}

    def close(self, *, failed: bool = False) -> None:
        """Flush and close; `failed`: W&B marks the run failed (a resumed job continues it all the same)."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.finish(exit_code=1 if failed else 0)
            # finish() can return before wandb-core has written an offline run's last records; teardown waits for
            # it, and the recipes end with os._exit, which skips the atexit hook that would call it
            wandb.teardown()
            self.wandb_run = None
            _remove_wandb_temporaries()
        self.caught.restore()  # their threads have ended: threading's own hook again
        self.caught.say()


class ThreadErrors:
    """From open_trackers to close: an exception raised in a tracker's own thread (TensorBoard's event writer, W&B's)
    is kept, not printed (threading's hook would weave `Exception in thread ...` into the run's lines); the main thread
    says it once, as the run's `error:` line. Other threads' errors go to the hook there was."""

    def __init__(self):
        self.errors: list[tuple[str, BaseException]] = []
        self.previous = threading.excepthook
        threading.excepthook = self.hook

    def hook(self, args) -> None:
        kind = _tracker_of(args.exc_traceback)
        if kind:
            self.errors.append((kind, args.exc_value))
        else:
            self.previous(args)

    def restore(self) -> None:
        if threading.excepthook == self.hook:
            threading.excepthook = self.previous

    def say(self) -> None:
        if self.errors:
            (kind, err), *_ = self.errors
            self.errors.clear()
            if isinstance(err, OSError):  # an unwritable folder, a full disk: the error line names it
                raise err
            said = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            raise RecipeError(f"--log-to {kind}: its background thread failed ({said}); the run's logs there stop")


def _tracker_of(tb) -> str | None:
    """The tracker whose code a thread's traceback ran (its package, or torch's TensorBoard writer), or None."""
    names = [frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_tb(tb)]
    return next((k for n in names for k in TRACKERS if n.split(".")[0] == k or n.startswith(f"torch.utils.{k}")), None)


def _remove_wandb_temporaries() -> None:
    """wandb makes two folders in TMPDIR when imported, removed by finalizers at the interpreter's exit, which the
    recipes' os._exit skips. Scalars use neither."""
    from wandb.sdk.artifacts.artifact import Artifact
    from wandb.sdk.data_types import _private

    for folder in (getattr(_private, "MEDIA_TMP", None), getattr(Artifact, "_TMP_DIR", None)):
        if folder is not None:
            folder.cleanup()


def open_trackers(
    kinds: list[str], *, run_dir: Path, config: dict, resume_state: dict | None, step: int, project: str = ""
) -> Trackers:
    """Open `kinds` (from check_trackers) for the run in `run_dir`; rank 0 only. `resume_state`: state() of the run
    the checkpoint resumed was logged to (None: a fresh run), `step`: the optimizer step training continues after."""
    caught = ThreadErrors()  # from here: what the trackers' threads raise is said once, by the main thread
    tensorboard = wandb_run = None
    try:
        tensorboard = _open_tensorboard(run_dir, step=step) if "tensorboard" in kinds else None
        if "wandb" in kinds:
            wandb_run = _open_wandb(run_dir, config=config, resume_state=resume_state, project=project)
        caught.say()
    except BaseException:
        if tensorboard is not None:
            tensorboard.close()
        caught.restore()
        raise
    return Trackers(tensorboard=tensorboard, wandb_run=wandb_run, caught=caught)


def _open_tensorboard(run_dir: Path, *, step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise RecipeError(f"--log-to tensorboard: {err}; pip install -e '.[tensorboard]'") from None
    folder = run_dir / "tensorboard"
    folder.mkdir(exist_ok=True)
    try:  # writable: else its writer thread would meet it, after the writer started
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(folder)) from None
    # purge_step: TensorBoard's reader drops what the crashed job logged after the checkpoint (steps > `step`),
    # which the resumed job logs again; the checkpoint's own step stays (logged before the checkpoint was taken)
    return SummaryWriter(log_dir=str(folder), purge_step=step + 1 if step else None)


def _open_wandb(run_dir: Path, *, config: dict, resume_state: dict | None, project: str):
    try:
        import wandb
    except ImportError as err:
        raise RecipeError(f"--log-to wandb: {err}; pip install -e '.[wandb]'") from None
    saved = run_dir / WANDB_FILE
    known = resume_state if resume_state and "wandb_run_id" in resume_state else None
    if known is None and saved.is_file():  # no run given: the run folder's own id
        known = json.loads(saved.read_text())
    run_id = known["wandb_run_id"] if known else secrets.token_hex(4)  # 8 of [0-9a-f], as W&B's own ids are made of
    project = (known or {}).get("wandb_project") or project or os.environ.get("WANDB_PROJECT", "torch-dist-recipes")
    text = json.dumps({"wandb_run_id": run_id, "wandb_project": project}) + "\n"
    tmp = saved.with_name(f".{saved.name}.tmp-{os.getpid()}")  # written whole, then renamed: never half a file
    tmp.write_text(text)
    os.replace(tmp, saved)  # before init: a job that dies in it resumes the same id
    return wandb.init(
        project=project,
        id=run_id,
        name=run_dir.name,
        dir=str(run_dir),
        config=config,
        resume="allow" if known else None,  # allow: also a run whose offline fragments were never synced
    )


def open_logs(cfg, run) -> None:
    """Rank 0 opens the trackers --log-to names, continuing the curves of the checkpoint it resumes (its step, and
    the W&B run of the folder it was written in)."""
    close_logs(refused=False)  # one run at a time in a process
    kinds = check_trackers(getattr(cfg, "log_to", ""))  # a recipe without --log-to: none
    if not kinds or not run.writer:
        return
    step, state = 0, None
    if run.resume_from is not None:
        step = json.loads(read_checkpoint(run.resume_from, tensors=False)[1]["progress"])["step"]
        logged = run.resume_from.parent.parent / WANDB_FILE  # RUN/ckpt/step-N: the W&B run it was logged to
        state = json.loads(logged.read_text()) if logged.is_file() else None
    OPENED["trackers"] = open_trackers(
        kinds, run_dir=run.path, config=run.config, resume_state=state, step=step, project=cfg.wandb_project
    )


def log_record(run, record: dict) -> None:
    """Each record to the open trackers; the summary, the run's last, closes them."""
    if trackers := OPENED.get("trackers"):
        trackers.write(record)
        if record["kind"] == "summary":
            OPENED.pop("trackers").close()


def close_logs(*, refused: bool) -> None:
    """A run that ends in an error: W&B marks it failed (a resumed job continues it all the same)."""
    if trackers := OPENED.pop("trackers", None):
        with contextlib.suppress(Exception):  # the run's own error is the line it ends with
            trackers.close(failed=True)


SEAMS["option_groups"].append(Tracking)
SEAMS["before_job"].append(open_logs)
SEAMS["log_sinks"].append(log_record)
SEAMS["on_fail"].append(close_logs)
