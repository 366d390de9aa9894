"""Plug-in `fast_writer`: checkpoints and weights written straight from the tensors' memory by a writer of the
(simple, documented) safetensors format, with the same checksums: safetensors' own writer first copies every tensor
into a bytes object, which at checkpoint sizes halves the write speed and doubles the memory (bench/bench_ckpt.py)."""

from __future__ import annotations

import json
import struct

import torch

from core.kernel.seams import SEAMS
from core.kernel.store import checksum


def write_fast(
    f, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, *, checksum_of=checksum
) -> None:
    """The safetensors format, with the checksums in its header, written straight from the tensors' memory.

    The tensors are on the CPU and contiguous; `f` is an open file. safetensors.torch.save_file first copies
    every tensor into a bytes object; at checkpoint sizes that copy halves the write speed, so the (simple,
    documented) format is written here.
    """
    header, offset = {"__metadata__": dict(metadata or {})}, 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": _dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if checksum_of is not None:  # None: no checksums (bench/bench_ckpt.py measures what they cost)
        header["__metadata__"]["checksums"] = json.dumps({key: checksum_of(t) for key, t in tensors.items()})
        header["__metadata__"]["header_checksum"] = checksum(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes with spaces
    _write_all(f, memoryview(struct.pack("<Q", len(encoded)) + encoded))
    for tensor in tensors.values():
        if tensor.numel():
            _write_all(f, tensor.reshape(-1).view(torch.uint8).numpy().data)  # no copy: the tensor's own bytes


def _dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of a dtype: F32, BF16, I64, U8, BOOL, ..."""
    if dtype == torch.bool:
        return "BOOL"
    kind = "BF" if dtype == torch.bfloat16 else "F" if dtype.is_floating_point else "U" if dtype == torch.uint8 else "I"
    return f"{kind}{dtype.itemsize * 8}"


def _write_all(f, view: memoryview) -> None:
    while view:  # an unbuffered write may take less than it was given (Linux: at most ~2 GB a call)
        view = view[f.write(view) :]


SEAMS["writers"].append(write_fast)
