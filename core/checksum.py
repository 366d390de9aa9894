"""Checksums of a tensor's bytes, as checkpoints record them: "xxh3:16 hex digits", and the reader of the old format.

XXH3-64 (the xxhash package) runs at memory speed (~10 GB/s a core, faster than the old block sums and ~5x
zlib.crc32) and, being a real hash of the bytes in order, catches what the old "blocksum64-crc32:" sums
let through: 8-byte words swapped inside one 4 KiB block, bit flips that cancel in a block's sum.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
import xxhash

_OLD_PREFIX = "blocksum64-crc32:"  # written before the xxh3 one; read only, so old checkpoints still load
_OLD_BLOCK = 4096  # bytes the old format summed into one 64-bit word


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes, in memory order, as a uint8 array.

    A view of its own memory when it is a contiguous CPU tensor (a copy otherwise)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)  # an empty tensor has no storage


def checksum(t: torch.Tensor) -> str:
    """XXH3-64 of the tensor's bytes, "xxh3:16 hex digits" (fixed width); dtype and shape are the header's."""
    return "xxh3:" + xxhash.xxh3_64_hexdigest(_bytes(t))  # hashes the buffer in place, no copy


def blocksum64_crc32(t: torch.Tensor) -> str:
    """The old format: 64-bit word sums per 4 KiB block, CRC32 over the sums and the tail.

    The words are summed wrapping. Blind to words reordered within a block and to changes that cancel in a
    block's sum."""
    data = _bytes(t)
    whole = len(data) // _OLD_BLOCK * _OLD_BLOCK
    sums = np.add.reduce(data[:whole].view(np.uint64).reshape(-1, _OLD_BLOCK // 8), axis=1, dtype=np.uint64)
    return f"{_OLD_PREFIX}{zlib.crc32(data[whole:], zlib.crc32(sums)):08x}"


def checksum_matches(t: torch.Tensor, recorded: str) -> bool:
    """Whether `recorded` is the tensor's checksum: XXH3, or the old blocksum64-crc32 (a copy: `--with old_checksums`).

    Any other string (an unknown algorithm, an empty one for a tensor the header has no checksum for) does not match.
    """
    if recorded.startswith(_OLD_PREFIX):
        return blocksum64_crc32(t) == recorded
    return checksum(t) == recorded
