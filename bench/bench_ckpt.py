"""Checkpoint write and read speed against the disk's own bound, measured side by side in one run.

    python bench/bench_ckpt.py [--mb 100] [--repeats 3] [--dir /tmp] [--device cpu|cuda]

Two more figures (issue 14): the cost of the checksums (the same write without them, with the old
blocksum64-crc32 ones and with the xxh3 ones, in turn in each repeat; goal: at most 10% slower), and
the time a training step is blocked by a checkpoint of a train state, background
(core.ckpt_async.CheckpointSaver(background=True): a host copy) against in-line (the whole write); goal: at most
0.2x. The floor of the background figure is a host copy of the state, printed too: for a GPU's
state that is a pinned device-to-host copy (tens of GB/s); for a CPU's state it is a memcpy, which
on a small shared machine runs no faster than the write itself.

Rows: the raw sequential write speed of this disk (dd with conv=fdatasync: the physical
bound), our checkpoint path (core.kernel.store.write_weights with the fast_writer plug-in, as the package
writes: safetensors to a temporary name, fsync, rename), and torch.save + fsync. Reads: safetensors
load_file against torch.load(weights_only=True), both from the page cache (dropping caches needs
privileges a bench should not ask for); load_file maps the file, so its figure is the cost of
opening it more than of reading it. The figure of merit is ours / raw; the goal is >= 0.80.
"""

import argparse
import copy
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from core.ckpt_async import CheckpointSaver, stage
from core.kernel.job import RunFolder
from core.kernel.store import checksum, write_weights
from core.plugins.fast_writer import write_fast  # the package's writer (core/attach.py attaches it)
from core.plugins.old_checksums import blocksum64_crc32


def dd_write_mb_s(path: Path, mb: int) -> float:
    out = subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", "conv=fdatasync"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    seconds = float(re.search(r"([\d.]+) s,", out).group(1))
    return mb / seconds


def timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def torch_save_fsync(state, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def save_weights(state, path: Path) -> None:
    """What a run writes at its end (RUN/model.safetensors), here under `path`."""
    write_weights(RunFolder(path.parent, None, "bench", {"model": "bench"}, True), state).rename(path)


def host_copies(state) -> dict:
    """The copies write_tensors writes from: on the CPU, contiguous, one per entry (tied weights apart)."""
    return {k: t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True) for k, t in state.items()}


def save_with(state, path: Path, checksum_of) -> None:
    """write_weights' write with another checksum function (None: no checksums): copies, temporary file, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write_fast(f, host_copies(state), checksum_of=checksum_of)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def hash_s(state, checksum_of) -> float:
    """The time checksum_of takes over every tensor of the state, alone (no write)."""
    tensors = host_copies(state)
    return timed(lambda: [checksum_of(t) for t in tensors.values()])


def blocked_s(saver: CheckpointSaver, run: RunFolder, model, optimizer, scheduler, step: int) -> float:
    """The time save() keeps the training loop waiting; the previous write has landed (untimed)."""
    saver.wait()
    start = time.perf_counter()
    state = dict(model=model, optimizer=optimizer, scheduler=scheduler)
    saver.save(run, **state, progress={"epoch": 0, "samples": 0, "step": step}, keep=1)
    blocked = time.perf_counter() - start
    saver.wait()
    return blocked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--device", default="cpu", help="where the train state of the blocked-time rows lives")
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # a checkpoint save is a collective

    # A model-shaped state dict: a few large matrices and many small vectors, args.mb in all.
    numel = args.mb * 2**20 // 4
    model = torch.nn.Module()
    for i in range(8):
        model.register_buffer(f"w{i}", torch.randn(numel // 8 - 1024))
        model.register_buffer(f"b{i}", torch.randn(1024))
    size_mb = sum(t.numel() * 4 for t in model.state_dict().values()) / 2**20

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        folder = Path(folder)
        rows = {
            "raw dd fdatasync": [],
            "ours: safetensors save (atomic, fsync)": [],
            "ours without checksums": [],
            "ours with the old blocksum64-crc32": [],
            "torch.save + fsync": [],
            "ours: safetensors load_file": [],
            "torch.load(weights_only=True)": [],
        }
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # the state is the model's
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        trained = copy.deepcopy(model).to(args.device)
        copies = []  # a plain host copy of the state: the floor of any background save's blocked time
        savers = {"in-line": CheckpointSaver(background=False), "background": CheckpointSaver(background=True)}
        runs = {name: RunFolder(folder / name, None, "bench", {"global_batch": 1}, True) for name in savers}
        for run in runs.values():
            run.path.mkdir()
        blocked, buffers = {name: [] for name in savers}, {}
        checksums = {"none": None, "old blocksum64-crc32": blocksum64_crc32, "new xxh3": checksum}
        save_s = {name: [] for name in checksums}  # seconds per save, each checksum in turn
        hashing = {name: [] for name in checksums if checksums[name] is not None}
        for i in range(args.repeats):  # interleaved, so a noisy neighbour hits every row alike
            # Each write goes to a new name, as checkpoints do (step-N); replacing an existing 100 MB
            # file instead costs its block freeing inside the rename (we measured ~4x slower).
            ours, theirs = folder / f"w-{i}.safetensors", folder / f"w-{i}.pt"
            rows["raw dd fdatasync"].append(dd_write_mb_s(folder / f"dd-{i}.bin", args.mb) * size_mb / args.mb)
            rows["ours: safetensors save (atomic, fsync)"].append(
                size_mb / timed(save_weights, model.state_dict(), ours)
            )
            names = list(checksums)[i % 3 :] + list(checksums)[: i % 3]  # each takes each place in turn
            for name in names:
                path = folder / f"c-{i}-{name.split()[0]}.safetensors"
                save_s[name].append(timed(save_with, model.state_dict(), path, checksums[name]))
                path.unlink()
            for name in hashing:
                hashing[name].append(hash_s(model.state_dict(), checksums[name]))
            rows["ours without checksums"].append(size_mb / save_s["none"][-1])
            rows["ours with the old blocksum64-crc32"].append(size_mb / save_s["old blocksum64-crc32"][-1])
            for name, saver in savers.items():
                blocked[name].append(blocked_s(saver, runs[name], trained, optimizer, scheduler, i))
            copies.append(timed(stage, trained.state_dict(), buffers))
            rows["torch.save + fsync"].append(size_mb / timed(torch_save_fsync, model.state_dict(), theirs))
            rows["ours: safetensors load_file"].append(size_mb / timed(load_file, ours))
            rows["torch.load(weights_only=True)"].append(size_mb / timed(torch.load, theirs, weights_only=True))
            for old in (ours, theirs, folder / f"dd-{i}.bin"):  # pruning, as --keep does: not part of a save
                old.unlink()
    medians = {name: statistics.median(v) for name, v in rows.items()}
    raw = medians["raw dd fdatasync"]
    print(f"state dict: {size_mb:.0f} MB, median of {args.repeats}, folder {args.dir}")
    print(f"{'path':42s} {'MB/s':>8s} {'vs raw write':>13s}")
    for name, value in medians.items():
        print(f"{name:42s} {value:8.0f} {value / raw:12.2f}x")
    ratio = medians["ours: safetensors save (atomic, fsync)"] / raw
    print(f"checkpoint write / raw write = {ratio:.2f} (goal >= 0.80): {'ok' if ratio >= 0.8 else 'BELOW GOAL'}")
    print(f"save time by checksum (median of {args.repeats}; ratios: median over repeats of the same repeat's pair)")
    for name, times in save_s.items():
        line = f"  {name:21s} {1000 * statistics.median(times):6.0f} ms"
        if name in hashing:
            ratio = statistics.median(t / plain for t, plain in zip(times, save_s["none"]))
            line += f"  {ratio:.3f}x without (goal <= 1.10): {'ok' if ratio <= 1.1 else 'OVER'}"
            line += f"; hashing alone {size_mb / statistics.median(hashing[name]):.0f} MB/s"
        print(line)
    paired = statistics.median(new / old for new, old in zip(save_s["new xxh3"], save_s["old blocksum64-crc32"]))
    print(f"  new / old: {paired:.3f}x")
    stall = {name: statistics.median(v) for name, v in blocked.items()}
    ratio = stall["background"] / stall["in-line"]
    print(f"host copy of the state ({args.device} -> host buffers): {size_mb / statistics.median(copies):.0f} MB/s")
    print(
        f"training blocked per checkpoint: in-line {1000 * stall['in-line']:.0f} ms, background "
        f"{1000 * stall['background']:.0f} ms = {ratio:.2f}x (goal <= 0.20): {'ok' if ratio <= 0.2 else 'OVER'}"
    )


if __name__ == "__main__":
    main()
