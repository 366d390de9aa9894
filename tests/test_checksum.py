"""Tensor checksums (issue 20.8): xxh3 catches what the old blocksum64-crc32 let through (words swapped in a
4 KiB block, bit flips that cancel in its sum), a torn tail and a single flip; old checkpoints still verify."""

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from core.kernel.job import RecipeError, RunFolder
from core.kernel.replica import save_checkpoint
from core.kernel.seams import CHECKSUMS
from core.kernel.store import checksum, newest_good, read_checkpoint
from core.plugins.fast_writer import write_fast
from core.plugins.old_checksums import blocksum64_crc32
from tiny import TiedMLP

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
BLOCK = 4096  # the old format's block: the blind spots below lie inside one


def _tensor(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` holding exactly these bytes (a copy: `data` stays the caller's)."""
    return torch.from_numpy(data.copy()).view(dtype)


@st.composite
def _case(draw, *, min_bytes: int = 1):
    """Random bytes, a whole number of elements of a drawn dtype, and that dtype."""
    dtype = draw(st.sampled_from(DTYPES))
    size = torch.empty(0, dtype=dtype).element_size()
    count = draw(st.integers(-(-min_bytes // size), (3 * BLOCK + 200) // size))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.integers(0, 256, count * size, dtype=np.uint8), dtype


def checksum_matches(t: torch.Tensor, recorded: str) -> bool:
    """Whether `recorded` is the tensor's checksum, as read_checkpoint asks it: the function its prefix names in
    CHECKSUMS (the old_checksums plug-in's), else XXH3."""
    return CHECKSUMS.get(recorded.partition(":")[0] + ":", checksum)(t) == recorded


def _words(data: np.ndarray) -> np.ndarray:
    """The whole 8-byte words of `data`, counted from its start, as a view (writes go to `data`)."""
    return data[: len(data) // 8 * 8].view(np.uint64)


def _same_block_words(draw, data: np.ndarray) -> tuple[int, int]:
    """Two distinct 8-byte word indices inside one whole 4 KiB block of `data` (counted from its start)."""
    block = draw(st.integers(0, len(data) // BLOCK - 1))
    first, second = draw(st.lists(st.integers(0, BLOCK // 8 - 1), min_size=2, max_size=2, unique=True))
    return block * BLOCK // 8 + first, block * BLOCK // 8 + second


def _refused_by_new_and_missed_by_old(original: np.ndarray, damaged: np.ndarray, dtype: torch.dtype) -> None:
    good, bad = _tensor(original, dtype), _tensor(damaged, dtype)
    assert checksum_matches(good, checksum(good))
    assert not checksum_matches(bad, checksum(good))
    assert checksum_matches(bad, blocksum64_crc32(good)), "the damage is in the old format's blind spot"


@pytest.mark.fast
@settings(max_examples=150, deadline=None)
@given(case=_case(min_bytes=BLOCK), data=st.data())
def test_two_words_swapped_inside_one_block_are_caught(case, data):
    original, dtype = case
    i, j = _same_block_words(data.draw, original)
    words = _words(original)
    assume(words[i] != words[j])
    damaged = original.copy()
    _words(damaged)[[i, j]] = words[[j, i]]
    _refused_by_new_and_missed_by_old(original, damaged, dtype)


@pytest.mark.fast
@settings(max_examples=150, deadline=None)
@given(case=_case(min_bytes=BLOCK), data=st.data(), bit=st.integers(0, 63))
def test_two_bit_flips_that_cancel_in_the_block_sum_are_caught(case, data, bit):
    original, dtype = case
    i, j = _same_block_words(data.draw, original)
    mask = np.uint64(1 << bit)
    words = _words(original)  # the original has a 0 at that bit in word i and a 1 in word j
    words[i] &= ~mask
    words[j] |= mask
    damaged = original.copy()
    _words(damaged)[i] |= mask  # +2**bit ...
    _words(damaged)[j] &= ~mask  # ... and -2**bit: the same sum
    _refused_by_new_and_missed_by_old(original, damaged, dtype)


@pytest.mark.fast
@settings(max_examples=150, deadline=None)
@given(case=_case(), data=st.data())
def test_a_torn_tail_is_caught(case, data):
    original, dtype = case
    torn = data.draw(st.integers(0, len(original) - 1))
    assume(original[torn:].any())
    damaged = original.copy()
    damaged[torn:] = 0  # what a write cut short leaves where the rest of the file was to be
    good = _tensor(original, dtype)
    assert not checksum_matches(_tensor(damaged, dtype), checksum(good))


@pytest.mark.fast
@settings(max_examples=150, deadline=None)
@given(case=_case(), data=st.data(), bit=st.integers(0, 7))
def test_a_single_flipped_bit_is_caught_in_either_format(case, data, bit):
    original, dtype = case
    damaged = original.copy()
    damaged[data.draw(st.integers(0, len(original) - 1))] ^= 1 << bit
    good, bad = _tensor(original, dtype), _tensor(damaged, dtype)
    assert not checksum_matches(bad, checksum(good))
    assert not checksum_matches(bad, blocksum64_crc32(good))


# Recorded by the old checkpoint module's tensor_checksum: the old checkpoints' exact strings (old_checksums).
OLD_FORMAT = [
    (torch.arange(3000, dtype=torch.float32), "blocksum64-crc32:29b21c1c"),
    (torch.arange(1000, dtype=torch.int64).reshape(10, 100), "blocksum64-crc32:774b4dd0"),
    (torch.arange(7, dtype=torch.bfloat16), "blocksum64-crc32:7f7e53e4"),
    (torch.zeros(0), "blocksum64-crc32:00000000"),
    (torch.tensor(True), "blocksum64-crc32:a505df1b"),
]


@pytest.mark.fast
@pytest.mark.parametrize("tensor,recorded", OLD_FORMAT, ids=[s for _, s in OLD_FORMAT])
def test_an_old_format_checksum_still_verifies(tensor, recorded):
    assert blocksum64_crc32(tensor) == recorded and checksum_matches(tensor, recorded)
    assert tensor.numel() == 0 or not checksum_matches(tensor.logical_not().to(tensor.dtype), recorded)


@pytest.mark.fast
def test_the_format_and_what_does_not_match():
    t = torch.randn(5, 6)
    assert re.fullmatch(r"xxh3:[0-9a-f]{16}", checksum(t)) and checksum(torch.zeros(0)) == "xxh3:2d06800538d394c2"
    assert checksum(t[:, ::2]) == checksum(t[:, ::2].contiguous())  # the bytes in element order, however laid out
    for other in ["", "xxh3:", checksum(t).upper(), "crc32c:" + checksum(t)[5:13], checksum(t)[5:]]:
        assert not checksum_matches(t, other), other


# End to end: a checkpoint file damaged in the old format's blind spot is refused by the checkpoint reader.


def _train_state():
    torch.manual_seed(0)
    model = TiedMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    optimizer.zero_grad()
    model(torch.randn(4, 64)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def _save(folder, step, model, optimizer):
    progress = {"epoch": 0, "samples": 8 * step, "step": step}
    Path(folder).mkdir(exist_ok=True)  # as open_run makes it
    run = RunFolder(Path(folder), None, "ddp", {"global_batch": 8}, True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    return save_checkpoint(run, model=model, optimizer=optimizer, scheduler=scheduler, progress=progress, keep=10)


def _swap_words(path, key: str, first: int, second: int) -> None:
    """Swap two 8-byte words of tensor `key`'s data in the file (word indices from the tensor's start)."""
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    start = 8 + size + json.loads(data[8 : 8 + size])[key]["data_offsets"][0]
    a, b = (slice(start + 8 * w, start + 8 * w + 8) for w in (first, second))
    assert data[a] != data[b]
    data[a], data[b] = data[b], data[a]
    path.write_bytes(bytes(data))


@pytest.mark.fast
def test_a_checkpoint_with_two_words_swapped_in_one_tensor_is_refused_in_one_line(tmp_path, capsys, group1):
    model, optimizer = _train_state()
    good = _save(tmp_path, 10, model, optimizer)
    newest = _save(tmp_path, 20, model, optimizer)
    before = read_checkpoint(newest)[0]["model/hidden.weight"]
    _swap_words(newest, "model/hidden.weight", 3, 200)  # both in the tensor's first 4 KiB block
    with pytest.raises(RecipeError) as refused:
        read_checkpoint(newest)
    line = str(refused.value)
    assert "tensor model/hidden.weight does not match its checksum" in line and "\n" not in line
    with safe_open(str(newest), framework="pt") as f:  # the damaged tensor, read without any check
        assert checksum_matches(f.get_tensor("model/hidden.weight"), blocksum64_crc32(before)), "old: accepted"
    assert newest_good(tmp_path) == good and f"skipping {newest}" in capsys.readouterr().err


@pytest.mark.fast
def test_a_checkpoint_written_with_old_format_checksums_still_loads(tmp_path, group1):
    model, optimizer = _train_state()
    tensors, meta = read_checkpoint(_save(tmp_path / "new", 10, model, optimizer))
    old_meta = {k: v for k, v in meta.items() if k not in ("checksums", "header_checksum")}
    old = tmp_path / "step-000010.safetensors"
    with open(old, "wb") as f:
        write_fast(f, tensors, old_meta, checksum_of=blocksum64_crc32)
    with safe_open(str(old), framework="pt") as f:
        recorded = json.loads(f.metadata()["checksums"])
    assert all(s.startswith("blocksum64-crc32:") for s in recorded.values())
    loaded, _ = read_checkpoint(old)
    assert loaded.keys() == tensors.keys()
    for key in tensors:
        torch.testing.assert_close(loaded[key], tensors[key], rtol=0, atol=0)
