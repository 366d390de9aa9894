"""The run folder and its checkpoints: safetensors files written atomically, checked on load, resumed exactly."""

from __future__ import annotations

import contextlib
import json
import os
import re
import zlib
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
import xxhash
from safetensors import SafetensorError, safe_open
from torch import nn

from core.kernel.job import RecipeError, RunFolder, open_log, os_error_line, say, write_record
from core.kernel.seams import CHECKSUMS, SEAMS, fire
from core.kernel.train import Topology

# The options that shape what is trained: a resumed run keeps them, or it would be another run.
TRAJECTORY = ("lr", "seed", "model", "data", "loss", "precision", "accum", "clip", "epochs", "max_steps", "init_from")
IMPLIED = {"precision": "fp32", "accum": 1, "clip": 0.0}  # how a recipe that does not take the option trains
FORMAT = "torch-dist-recipes/2"  # /2: checksums in every file
START = {"epoch": 0, "samples": 0, "step": 0, "skipped": 0, "window": {}}  # a new run's progress


def from_rank0(rank0: bool, fn):
    """fn() on rank 0, its value on every rank; its RecipeError or OSError is raised on every rank (none waits)."""
    try:
        value = fn() if rank0 else None
    except (RecipeError, OSError) as err:
        value = RecipeError(os_error_line(err) if isinstance(err, OSError) else str(err))
    dist.broadcast_object_list(box := [value], src=0)  # rank 0's own objects between our processes, not a file
    if isinstance(box[0], RecipeError):
        raise box[0]
    return box[0]


def finished(cfg, topo: Topology, *, recipe: str) -> dict | None:
    """The summary of the finished run --resume continues, said in one line (nothing is touched); else None."""
    resume = cfg.resume or "auto" * (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0")  # torchrun restarted it

    def summary() -> dict | None:  # rank 0 reads the folder: other nodes need not see it
        with contextlib.suppress(IndexError, KeyError, OSError, ValueError):  # no run, no record, or a torn last line
            run = Path(resume).parents[1] if resume != "auto" else run_dirs(cfg.out, cfg.name or recipe)[-1]
            last = json.loads((run / "metrics.jsonl").read_bytes().splitlines()[-1])  # the summary is written last
            if last.pop("kind") == "summary" and not any(hook(cfg, run, resume) for hook in SEAMS["trains_on"]):
                how = "more --epochs or --max-steps" + " in a copy made --with longer" * (not SEAMS["trains_on"])
                print(f"{run} already finished at step {last.get('steps')}; nothing to train ({how} train it on)")
                return {**last, "already_finished": True}

    return from_rank0(topo.rank == 0 and bool(resume), summary)  # no --resume: a new run, nothing to look for


def open_run(cfg, topo: Topology, *, recipe: str, global_batch: int) -> RunFolder:
    """Rank 0 picks the run folder, refusing a checkpoint that cannot continue in this job; every rank gets it."""
    config = {"recipe": recipe, "world_size": topo.world_size, "global_batch": global_batch, **vars(cfg)}
    prefix = cfg.name or recipe
    resume = cfg.resume or "auto" * (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0")  # torchrun restarted it

    def choose() -> tuple[Path, Path | None]:
        open_log(None)  # the lines said while choosing go into train.log
        runs = run_dirs(cfg.out, prefix)
        path = (newest_good(runs[-1]) if runs else None) if resume == "auto" else Path(resume) if resume else None
        if resume == "auto" and not path:  # not silently a new run
            where = f"{runs[-1]}, the newest {prefix} run, has no usable checkpoint" if runs else f"no {prefix} run"
            say(None, f"--resume auto: {where} in {cfg.out}; starting a new run")
        path and check_continues(path, read_checkpoint(path, tensors=False)[1], config)
        in_run = bool(path) and path.resolve().parent.parent in [r.resolve() for r in runs]  # else a new folder
        folder = path.parent.parent if in_run else run_dirs(cfg.out, prefix, new=True)[-1]
        fire("on_open", folder, config, new=not in_run)  # before anything in the folder is written: lock, config.json
        return folder, path

    run = RunFolder(*from_rank0(topo.rank == 0, choose), recipe, config, topo.rank == 0)
    open_log(run)
    say(run, f"run folder {run.path}", level="DEBUG")  # on stderr, where a launcher's supervisor reads it
    fire("before_job", cfg, run)
    return run


def check_continues(path: Path, meta: dict[str, str], config: dict) -> None:
    """One RecipeError line, naming both sides and the fix, when the checkpoint would train another run here."""
    allowed = {key for check in SEAMS["resume_checks"] for key in check(path, meta, config) or ()}  # longer's
    saved, batch, now = json.loads(meta.get("config", "{}")), int(meta.get("global_batch", 0)), config["global_batch"]
    if batch and batch != now:  # every later step would differ
        per_rank, rest = divmod(batch, now // config["batch_size"])  # this job's ranks x --accum
        fix = f"--batch-size {per_rank}" if not rest else f"a number of ranks that divides {batch}"
        raise RecipeError(f"{path}: saved with global batch {batch} and this job's is {now}; use {fix}")
    old, new = {**IMPLIED, **saved}, {**IMPLIED, **config}  # an option on one side only is not compared
    if differ := [k for k in TRAJECTORY if k in old and k in new and k not in allowed and old[k] != new[k]]:
        changed = ", ".join(f"--{k.replace('_', '-')} {old[k]} -> {new[k]}" for k in differ)
        fix = [saved.get("recipe", "")] * any(k not in config for k in differ)  # an option this recipe lacks
        fix += [f"--{k.replace('_', '-')} {old[k]}" for k in differ]
        raise RecipeError(f"{path}: other options ({changed}) would train another run; resume with {' '.join(fix)}")


def run_dirs(out: str, prefix: str, *, new: bool = False) -> list[Path]:
    """The folders OUT/PREFIX-N, lowest N first; new: and the next one, made now so that no other job takes it."""
    name = re.compile(re.escape(prefix) + r"-(\d+)")
    numbered = sorted((int(m[1]), p) for p in Path(out).glob("*") if (m := name.fullmatch(p.name)))  # none: no folder
    with contextlib.suppress(FileExistsError):  # another job took it between the listing and the mkdir: the next
        if new:
            (path := Path(out) / f"{prefix}-{numbered[-1][0] + 1 if numbered else 1}").mkdir(parents=True)
            numbered.append((0, path))
        return [p for _, p in numbered]
    return run_dirs(out, prefix, new=True)


def checksum(x: torch.Tensor | dict) -> str:
    """XXH3-64 of a tensor's bytes ("xxh3:..."), or CRC32 of a safetensors header but its own checksum ("crc32:...")."""
    if isinstance(x, dict):
        meta = {k: v for k, v in x.get("__metadata__", {}).items() if k != "header_checksum"}
        canonical = json.dumps({**x, "__metadata__": meta}, sort_keys=True, separators=(",", ":"))
        return f"crc32:{zlib.crc32(canonical.encode()):08x}"
    return "xxh3:" + xxhash.xxh3_64_hexdigest(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict) -> None:
    """A safetensors file with its checksums, written to a temporary file renamed over `path`: never half a file."""
    out = {k: t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True) for k, t in tensors.items()}
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}  # safetensors keeps strings
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # copies: tied weights apart (safetensors refuses them)
    with open(tmp, "wb") as f:  # a write killed midway leaves only this hidden file, which no listing takes
        if SEAMS["writers"]:  # the fast_writer plug-in: straight from the tensors' memory
            SEAMS["writers"][-1](f, out, meta)
        else:
            meta["checksums"] = json.dumps({key: checksum(t) for key, t in out.items()})
            data = safetensors.torch.save(out, meta)  # its layout sets the offsets the header checksum covers
            meta["header_checksum"] = checksum(json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")]))
            f.write(safetensors.torch.save(out, meta))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    os.fsync(folder := os.open(path.parent, os.O_RDONLY))  # the rename itself survives a power cut
    os.close(folder)


def read_checkpoint(path: Path, model: nn.Module | None = None, *, tensors: bool = True) -> tuple[dict, dict]:
    """A checkpoint's tensors (or none) and metadata, the header and each tensor checked against its checksum."""
    fix = f"resume from an older checkpoint in {path.parent} (--resume auto skips damaged ones)"
    try:
        with safe_open(str(path), framework="pt") as f:  # checks the header and that no byte is missing
            meta, found = f.metadata() or {}, {key: f.get_tensor(key) for key in f.keys()} if tensors else {}  # noqa: SIM118
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (SafetensorError, OSError) as err:  # or no file: a run folder, its ckpt folder (which step?), nothing
        gone = f"--resume {path}: no such checkpoint file; pass a ckpt/step-N.safetensors, or auto"
        raise RecipeError(f"{path}: truncated or corrupted ({err}); {fix}" if path.is_file() else gone) from None
    if meta.get("format") != FORMAT:
        raise RecipeError(f"{path}: not a checkpoint of this project (format {meta.get('format')!r}); {fix}")
    if meta.get("header_checksum") != checksum(header):
        raise RecipeError(f"{path}: the header does not match its checksum (edited or damaged); {fix}")
    sums = json.loads(meta["checksums"])
    for key, tensor in found.items():  # an older format's checksum: its plug-in's (old_checksums)
        if CHECKSUMS.get(sums.get(key, "").partition(":")[0] + ":", checksum)(tensor) != sums.get(key):
            raise RecipeError(f"{path}: tensor {key} does not match its checksum (the file is damaged); {fix}")
    tensors and fire("read_checks", path, found, model)  # (checks, shard_ckpt) not on a header-only read
    return found, meta


def newest_good(run_dir: Path) -> Path | None:
    """The newest checkpoint of RUN/ckpt that reads back whole; a damaged newer one is skipped in a warning."""
    for path in sorted((run_dir / "ckpt").glob("step-*.safetensors"), key=lambda p: (len(p.name), p.name))[::-1]:
        try:
            return read_checkpoint(path) and path
        except RecipeError as err:
            why = str(err).removeprefix(f"{path}: ").split("; ")[0]
            say(None, f"warning: --resume auto: skipping {path}, damaged ({why}); trying the one before", "WARNING")


def resumed(run: RunFolder, meta: dict, tensors: dict, *, optimizer, scheduler) -> dict:
    """The rest of a resume: the scheduler (this job's T_max: --with longer), this rank's generators, the record."""
    scheduler.load_state_dict((saved := json.loads(meta["scheduler"])) | {"T_max": scheduler.T_max})
    for key in (k for k in tensors if k.startswith(f"rng/{dist.get_rank()}/")):  # a new rank keeps its seeded ones
        torch.set_rng_state(tensors[key]) if key.endswith("/cpu") else torch.cuda.set_rng_state(tensors[key])
    progress = {**START, **json.loads(meta["progress"])}
    window, shape = progress.pop("window"), {k: run.config[k] for k in ("world_size", "global_batch")}
    write_record(run, {"kind": "resume", "checkpoint": str(run.resume_from), **progress, **shape})
    say(run, f"resumed from {run.resume_from} at step {progress['step']}")
    fire("on_resume", run, saved, optimizer=optimizer, scheduler=scheduler, step=progress["step"])
    return progress | {"window": window if run.writer else {}}  # the open log window: rank 0 carries it


def write_weights(run: RunFolder, state: dict[str, torch.Tensor]) -> Path:
    """Rank 0 writes the final weights as RUN/model.safetensors."""
    path = run.path / "model.safetensors"
    if run.writer:
        write_tensors(path, state, {"recipe": run.recipe} | {k: v for k, v in run.config.items() if k == "model"})
    return path
