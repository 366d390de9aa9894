"""Whether a recorded checksum is a tensor's: XXH3 (core/kernel/store.py's checksum) or the old blocksum64-crc32 (the
old_checksums plug-in), for the checkpoints of the recipes not yet on the kernel.

XXH3-64 (the xxhash package) runs at memory speed (~10 GB/s a core, faster than the old block sums and ~5x
zlib.crc32) and, being a real hash of the bytes in order, catches what the old "blocksum64-crc32:" sums
let through: 8-byte words swapped inside one 4 KiB block, bit flips that cancel in a block's sum.
"""

from __future__ import annotations

import numpy as np
import torch

from core.kernel.store import checksum
from core.plugins.old_checksums import OLD_PREFIX, blocksum64_crc32


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes, in memory order, as a uint8 array (a view of its memory when contiguous on the CPU)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)  # an empty tensor has no storage


def checksum_matches(t: torch.Tensor, recorded: str) -> bool:
    """Whether `recorded` is the tensor's checksum: XXH3, or the old blocksum64-crc32. Any other string (an unknown
    algorithm, an empty one for a tensor the header has no checksum for) does not match."""
    if recorded.startswith(OLD_PREFIX):
        return blocksum64_crc32(t) == recorded
    return checksum(t) == recorded
