"""Plug-in `old_checksums`: the reader of the checksums written before XXH3 ("blocksum64-crc32:": 64-bit word sums per
4 KiB block, CRC32 over the sums and the tail), so that checkpoints of that time still load."""

from __future__ import annotations

import zlib

import numpy as np
import torch

from core.kernel.seams import CHECKSUMS

OLD_PREFIX = "blocksum64-crc32:"
OLD_BLOCK = 4096  # bytes the old format summed into one 64-bit word


def blocksum64_crc32(t: torch.Tensor) -> str:
    """The old format; blind to words reordered within a block and to changes that cancel in a block's sum."""
    t = t.detach().cpu().contiguous().reshape(-1)
    data = t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    whole = len(data) // OLD_BLOCK * OLD_BLOCK
    sums = np.add.reduce(data[:whole].view(np.uint64).reshape(-1, OLD_BLOCK // 8), axis=1, dtype=np.uint64)
    return f"{OLD_PREFIX}{zlib.crc32(data[whole:], zlib.crc32(sums)):08x}"


CHECKSUMS[OLD_PREFIX] = blocksum64_crc32
