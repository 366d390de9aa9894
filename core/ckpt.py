"""Checkpoints: safetensors files written by rank 0, atomically, holding the whole train state.

    ckpt/step-000120.safetensors
      tensors   model/<key>, optim/<param index>/<name>, rng/<rank>/cpu, rng/<rank>/cuda
      metadata  format, recipe, config, world_size, torch, and JSON for the rest: optimizer
                param groups, LR scheduler, GradScaler, progress (epoch, batch, step)

Written to a temporary name, fsynced, then renamed: a kill at any moment leaves the last good
checkpoint whole. Loading reads the safetensors header and tensors only: nothing is unpickled.
"""
from __future__ import annotations

import json
import os
import re
import struct
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import nn

from core.config import RecipeError
from core.dist import barrier, broadcast_object, is_rank0
from core.models import unwrap

FORMAT = "torch-dist-recipes/1"
CKPT_NAME = re.compile(r"step-(\d+)\.safetensors")


def atomic_write(path: str | os.PathLike, write) -> Path:
    """Call `write(file)` on a temporary file, fsync, then rename over `path`: readers see the old
    file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb", buffering=0) as f:  # large writes go straight to the kernel
            write(f)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself survive a power cut
    finally:
        os.close(dir_fd)
    return path


_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def tensor_checksum(t: torch.Tensor) -> str:
    """CRC32 of a tensor's bytes, "crc32:8 hex digits" (fixed width). zlib releases the GIL on large
    buffers, so a thread can hash while another writes; every single-byte change is caught."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return f"crc32:{zlib.crc32(t.view(torch.uint8).numpy().data) if t.numel() else 0:08x}"


def write_safetensors(f, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """The safetensors format, written straight from the tensors' memory into an open file.

    safetensors.torch.save_file first copies every tensor into a bytes object; at checkpoint
    sizes that copy halves the write speed, so the (simple, documented) format is written here.
    """
    header, offset = {"__metadata__": metadata or {}}, 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes with spaces
    _write_all(f, memoryview(struct.pack("<Q", len(encoded)) + encoded))
    for tensor in tensors.values():
        if tensor.numel():
            _write_all(f, tensor.reshape(-1).view(torch.uint8).numpy().data)  # no copy: the tensor's own bytes


def _write_all(f, view: memoryview) -> None:
    while view:  # an unbuffered write may take less than it was given (Linux: at most ~2 GB a call)
        view = view[f.write(view):]


def savable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two entries sharing storage (safetensors refuses tied weights)."""
    out, seen = {}, set()
    for key, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        out[key] = tensor.clone() if storage in seen else tensor
        if storage is not None:
            seen.add(storage)
    return out


def save_weights(state: dict, path: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> Path:
    """The plain model's state dict (no wrapper prefixes), loadable with safetensors.torch.load_file."""
    tensors = savable(state)
    return atomic_write(path, lambda f: write_safetensors(f, tensors, metadata))


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state_dict -> tensors by name, plus the JSON-able rest (param groups, scalars)."""
    tensors, scalars = {}, {}
    for index, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{index}/{name}"] = value
            else:
                scalars[f"{index}/{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, index, name = key.split("/", 2)
        state.setdefault(int(index), {})[name] = value
    for key, value in rest["scalars"].items():
        index, name = key.split("/", 1)
        state.setdefault(int(index), {})[name] = value
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in group.items()}
              for group in rest["param_groups"]]  # JSON made tuples (betas) into lists
    return {"state": state, "param_groups": groups}


def _rng_states() -> list[dict[str, torch.Tensor]]:
    """Every rank's generator states, gathered (a collective: all ranks call it)."""
    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        mine["cuda"] = torch.cuda.get_rng_state()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def save_checkpoint(ckpt_dir: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    progress: dict, scheduler=None, scaler=None, keep: int = 2,
                    metadata: dict[str, str] | None = None) -> Path:
    """Write ckpt_dir/step-N.safetensors on rank 0 and keep the newest `keep`. A collective.

    `progress` is {"epoch", "batch" (micro-batches done in that epoch), "step"}.
    """
    rng = _rng_states()
    path = Path(ckpt_dir) / f"step-{progress['step']:06d}.safetensors"
    if is_rank0():
        optim_tensors, optim_rest = _flatten_optimizer(optimizer.state_dict())
        tensors = {f"model/{k}": v for k, v in unwrap(model).state_dict().items()} | optim_tensors
        tensors |= {f"rng/{rank}/{kind}": state for rank, states in enumerate(rng) for kind, state in states.items()}
        header = {**(metadata or {}), "format": FORMAT, "world_size": str(len(rng)), "torch": torch.__version__,
                  "optimizer": json.dumps(optim_rest), "progress": json.dumps(progress),
                  "scheduler": json.dumps(scheduler.state_dict() if scheduler else None),
                  "scaler": json.dumps(scaler.state_dict() if scaler and scaler.is_enabled() else None)}
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = savable(tensors)
        atomic_write(path, lambda f: write_safetensors(f, tensors, header))
        for old in list_checkpoints(path.parent)[:-keep]:  # only after the new one is safely in place
            old.unlink(missing_ok=True)
    barrier()  # nobody runs ahead while rank 0 writes: a kill after this finds the checkpoint
    return path


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints in a folder, oldest first (temporary files of an interrupted write are ignored)."""
    folder = Path(ckpt_dir)
    found = [(int(m.group(1)), p) for p in folder.glob("step-*.safetensors") if (m := CKPT_NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)] if folder.is_dir() else []


def _open_checked(path: str | os.PathLike, read):
    """Run read(safe_open handle) on a checkpoint; one RecipeError line when the file isn't a good one."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"--resume {path}: no such checkpoint file")
    try:
        with safe_open(str(path), framework="pt") as f:  # checks the header and that no byte is missing
            metadata = f.metadata() or {}
            if metadata.get("format") == FORMAT:
                return read(f), metadata
    except (SafetensorError, OSError) as err:
        with open(path, "rb") as f:
            head = f.read(2)
        if head == b"PK" or head[:1] == b"\x80":  # torch.save's zip, or a raw pickle
            raise RecipeError(f"{path}: a pickle (torch.save) file, not a safetensors checkpoint; it is never "
                              f"unpickled here: resume from a ckpt/step-N.safetensors file") from None
        raise RecipeError(f"{path}: not a readable checkpoint ({err}); it is truncated or corrupted: "
                          f"resume from an older one in {path.parent}") from None
    raise RecipeError(f"{path}: a safetensors file but not a checkpoint of this project "
                      f"(format {metadata.get('format')!r}); resume from a ckpt/step-N.safetensors file")


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and header of a checkpoint."""
    return _open_checked(path, lambda f: {key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118


def check_resume_file(path: str | os.PathLike, model_shapes: dict[str, tuple]) -> None:
    """Header-only check, before any process group: the file is whole and holds this model."""
    shapes, _ = _open_checked(path, lambda f: {
        k.removeprefix("model/"): tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith("model/")})
    check_model_matches(Path(path), shapes, model_shapes)


def is_readable(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:  # checks the header and that no byte is missing
            return (f.metadata() or {}).get("format") == FORMAT
    except (SafetensorError, OSError):
        return False


def _few(items: list[str]) -> str:
    return ", ".join(items[:3]) + (f" (+{len(items) - 3} more)" if len(items) > 3 else "")


def check_model_matches(path: Path, saved: dict[str, tuple], expected: dict[str, tuple]) -> None:
    """Name the missing and unexpected keys and the shape mismatches (key -> shape dicts), in one line."""
    missing = sorted(expected.keys() - saved.keys())
    unexpected = sorted(saved.keys() - expected.keys())
    shapes = [f"{k} {tuple(saved[k])} vs {tuple(expected[k])}"
              for k in sorted(expected.keys() & saved.keys()) if tuple(saved[k]) != tuple(expected[k])]
    problems = [f"{label}: {_few(found)}" for label, found in
                (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)) if found]
    if problems:
        raise RecipeError(f"{path} holds another model ({'; '.join(problems)}); resume with the --model it was "
                          f"trained with, or start a new run")


def shapes_of(model: nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in unwrap(model).state_dict().items()}


def choose_resume(resume: str, *, out: str, prefix: str) -> Path | None:
    """The checkpoint to start from, decided by rank 0 and broadcast: ranks never disagree.

    "auto" takes the newest readable checkpoint of the newest run `out/prefix-N` (none: a fresh
    run). A group that torchrun restarted after a failure (TORCHELASTIC_RESTART_COUNT > 0)
    resumes the same way by itself.
    """
    if not resume and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"
    choice = None
    if is_rank0() and resume == "auto":
        from core.run import latest_run_dir  # run.py imports this module for its writers

        latest = latest_run_dir(out, prefix)
        readable = [p for p in list_checkpoints(latest / "ckpt") if is_readable(p)] if latest else []
        choice = str(readable[-1]) if readable else None
    elif resume and resume != "auto":
        choice = resume
    choice = broadcast_object(choice)
    return Path(choice) if choice else None


def newest_good(ckpt_dir):  # SHIM (branch ckpt replaces)
    readable = [p for p in list_checkpoints(ckpt_dir) if is_readable(p)]
    return readable[-1] if readable else None


def remove_stale_temporaries(run_dir) -> None:  # SHIM (branch ckpt replaces)
    pass


def check_resume(path, *, model_shapes, recipe, precision, world_size, global_batch) -> dict:  # SHIM
    check_resume_file(path, model_shapes)
    return _open_checked(path, lambda f: None)[1]


class CheckpointSaver:  # SHIM (branch ckpt replaces)
    def __init__(self, ckpt_dir, *, keep, background=False):
        self.ckpt_dir, self.keep = ckpt_dir, keep

    def save(self, **state):
        save_checkpoint(self.ckpt_dir, keep=self.keep, **state)

    def close(self):
        pass


def run_dir_of(checkpoint: Path | None) -> Path | None:
    """A checkpoint in RUN/ckpt/ continues in RUN; one from elsewhere starts a new run folder."""
    return checkpoint.parent.parent if checkpoint and checkpoint.parent.name == "ckpt" else None


def load_checkpoint(path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, world_size: int,
                    scheduler=None, scaler=None) -> dict:
    """Restore the whole train state on every rank and return the progress. A collective.

    Rank 0 reads and checks the file (other nodes need not see it) and broadcasts it, or the
    one-line reason it can't be used, so every rank fails or succeeds together.
    """
    payload = None
    if is_rank0():
        try:
            tensors, meta = read_checkpoint(path)
            if int(meta["world_size"]) != world_size:
                raise RecipeError(f"{path} was written by {meta['world_size']} ranks and this job has {world_size}: "
                                  f"exact resume needs the same world size (set NPROC_PER_NODE/NNODES to match)")
            check_model_matches(path, {k.removeprefix("model/"): v.shape for k, v in tensors.items()
                                       if k.startswith("model/")}, shapes_of(model))
            payload = (tensors, meta)
        except RecipeError as err:
            payload = str(err)
    payload = broadcast_object(payload)  # our own tensors between our own processes, not the file
    if isinstance(payload, str):
        raise RecipeError(payload)
    tensors, meta = payload
    unwrap(model).load_state_dict({k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")})
    optimizer.load_state_dict(_unflatten_optimizer(
        {k: v for k, v in tensors.items() if k.startswith("optim/")}, json.loads(meta["optimizer"])))
    if scheduler is not None and json.loads(meta["scheduler"]) is not None:
        scheduler.load_state_dict(json.loads(meta["scheduler"]))
    if scaler is not None and json.loads(meta.get("scaler", "null")) is not None:
        scaler.load_state_dict(json.loads(meta["scaler"]))
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_rng_state(tensors[f"rng/{rank}/cpu"])
    if torch.cuda.is_available() and f"rng/{rank}/cuda" in tensors:
        torch.cuda.set_rng_state(tensors[f"rng/{rank}/cuda"])
    return json.loads(meta["progress"])
