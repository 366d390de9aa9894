"""What a GPU process holds that no tracker sees, beside the plan's tensors: the fixed terms (CUDA context, cuBLAS
workspace, NCCL buffers, allocator headroom), from published measurements (docs/memory-plan.md); `plan --fixed
TERM=VALUE,...` or TDR_FIXED sets any of them, `none` all to 0."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tools.options import UsageError

GIB, MIB, KIB = 2**30, 2**20, 2**10
CONTEXT_GIB = {"lazy": 0.3, "eager": 0.7}  # pytorch/pytorch#86509: 287,047,680 bytes lazy, 666,632,192 eager
HOPPER_WORKSPACE = ":4096:8"  # torch's default CUBLAS_WORKSPACE_CONFIG on sm90: 8 chunks of 4096 KiB, 32 MiB
OTHER_WORKSPACE = ":4096:2:16:8"  # on other GPUs: 2 of 4096 KiB and 8 of 16 KiB, 8.125 MiB
NCCL_GIB = 0.7  # per communicator: NVIDIA/nccl#964 measured 544 MB (2 ranks) and 688 MB (3-4); #864 about 1.6 GB
HEADROOM = 0.10  # of the peak: the allocator's slack, which expandable_segments shrinks (meta-pytorch/torchtune#1185)
TERMS = ("context", "workspace", "nccl", "headroom")
LABELS = dict(zip(TERMS, ("CUDA context", "cuBLAS workspace", "NCCL buffers", "allocator headroom")))


@dataclass(frozen=True)
class Fixed:
    """One process's fixed terms; the headroom is a fraction of that process's peak."""

    context_bytes: int
    workspace_bytes: int
    nccl_bytes_each: int  # per communicator
    communicators: int
    headroom: float
    why: dict  # term: where its value comes from, as the block prints it

    @property
    def nccl_bytes(self) -> int:
        return self.nccl_bytes_each * self.communicators

    def headroom_bytes(self, peak: int) -> int:
        return int(peak * self.headroom)

    def total(self, peak: int) -> int:
        return self.context_bytes + self.workspace_bytes + self.nccl_bytes + self.headroom_bytes(peak)

    def need(self, peak: int) -> int:
        """What a process whose tensors peak at `peak` bytes needs of its GPU."""
        return peak + self.total(peak)

    def to_json(self, peak: int) -> dict:
        """The terms as `plan --json`'s "fixed" keys, the headroom for `peak`."""
        return {
            "context_bytes": self.context_bytes,
            "workspace_bytes": self.workspace_bytes,
            "nccl_bytes": self.nccl_bytes,
            "nccl_communicators": self.communicators,
            "headroom_fraction": self.headroom,
            "headroom_bytes": self.headroom_bytes(peak),
            "total_bytes": self.total(peak),
        }

    def block(self, peak: int, *, rank: int, gib) -> list[str]:
        """The labelled lines the plan prints under its table; `gib(bytes)`: a number of GiB as the table writes it."""
        sizes = (self.context_bytes, self.workspace_bytes, self.nccl_bytes, self.headroom_bytes(peak))
        lines = ["fixed per process on a GPU, not in the table (docs/memory-plan.md; --fixed TERM=VALUE sets one):"]
        lines += [f"  {LABELS[t]:<19} {gib(size):>7} GiB  {self.why[t]}" for t, size in zip(TERMS, sizes)]
        need, total = gib(self.need(peak)), gib(self.total(peak))
        lines.append(f"  rank {rank} needs {need} GiB of its GPU: its peak {gib(peak)} + these {total}")
        return lines


def parse_fixed(spec: str, *, option: str = "--fixed") -> dict[str, float]:
    """`TERM=VALUE,...`, `none` (every term 0) or `none,TERM=VALUE,...` as {term: value}; a bad one is one line."""
    said = f"{option} {spec}" if option.startswith("--") else f"{option}={spec}"
    fix = f"give TERM=VALUE,... with TERM one of {', '.join(TERMS)} (e.g. nccl=1.6,headroom=0.2), or none"
    values = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part == "none":
            values |= dict.fromkeys(TERMS, 0.0)
            continue
        term, _, text = (s.strip() for s in part.partition("="))
        if term not in TERMS:
            raise UsageError(f"{said}: no term {term!r}; {fix}")
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (0 <= value < (1 if term == "headroom" else 1024)):
            takes = "a fraction of the peak, 0 to 1" if term == "headroom" else "GiB, 0 to 1024"
            raise UsageError(f"{said}: {term} takes {takes}, not {text!r}; {fix}")
        values[term] = value
    return values


def workspace_bytes(config: str) -> int:
    """The bytes a CUBLAS_WORKSPACE_CONFIG (`:SIZE_KiB:COUNT` pairs) asks for: what torch allocates per handle."""
    numbers = [int(n) for n in config.split(":") if n.strip().isdigit()]
    return sum(size * count for size, count in zip(numbers[::2], numbers[1::2])) * KIB


def communicators(dims: dict[str, int], world_size: int) -> int:
    """The NCCL communicators a process makes: the job's group, and one per mesh dimension smaller than the job."""
    return 0 if world_size < 2 else 1 + sum(1 for size in dims.values() if 1 < size < world_size)


def fixed_terms(*, dims: dict[str, int], world_size: int, spec: str | None = None, major: int | None = None) -> Fixed:
    """The fixed terms of one process of a GPU job on a mesh of `dims`; `spec`: --fixed (default: TDR_FIXED),
    `major`: the GPU's compute capability (default: this machine's)."""
    option = "--fixed" if spec is not None else "TDR_FIXED"
    told = parse_fixed(os.environ.get("TDR_FIXED", "") if spec is None else spec, option=option)
    if major is None and gpu_job():
        major = torch.cuda.get_device_capability()[0]
    eager = os.environ.get("CUDA_MODULE_LOADING", "").upper() == "EAGER"
    default = OTHER_WORKSPACE if major is not None and major < 9 else HOPPER_WORKSPACE  # unknown, newer: the larger
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") or default
    count = communicators(dims, world_size) if os.environ.get("TDR_BACKEND", "nccl") == "nccl" else 0
    each = told.get("nccl", NCCL_GIB)
    why = {
        "context": "CUDA_MODULE_LOADING=EAGER" if eager else "lazy module loading, torch's default",
        "workspace": f"CUBLAS_WORKSPACE_CONFIG={config}"
        + ("" if config != default else ", torch's default on this GPU" if major else ", torch's default on Hopper"),
        "nccl": f"{count} communicator{'s' * (count != 1)} x {each:g} GiB",
        "headroom": f"{told.get('headroom', HEADROOM):.0%} of the peak",
    }
    why |= {term: f"{option} {term}={value:g}" + f": {why[term]}" * (term == "nccl") for term, value in told.items()}
    context = told.get("context", CONTEXT_GIB["eager" if eager else "lazy"])
    workspace = int(told["workspace"] * GIB) if "workspace" in told else workspace_bytes(config)
    return Fixed(int(context * GIB), workspace, int(each * GIB), count, told.get("headroom", HEADROOM), why)


def gpu_job() -> bool:
    """Whether the job's ranks run on this machine's GPUs (TDR_DEVICE=cpu: a CPU job on a GPU machine)."""
    return torch.cuda.is_available() and os.environ.get("TDR_DEVICE") != "cpu"


def over(peak: int, fixed: Fixed | None, free: int) -> bool:
    """Whether a process whose tensors peak at `peak` bytes, with these fixed terms, needs more than `free` bytes."""
    return (fixed.need(peak) if fixed else peak) > free
