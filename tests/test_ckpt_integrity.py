"""Checkpoint integrity (issue 14.5, 11.11; xxh3 in 20.8), another world size (14.2), recipe and
precision compatibility (14.7), the pre-check (11.2) and stale temporaries (11.4)."""

import json
import struct
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

import core.plugins.checks  # noqa: F401 - its SEAMS["read_checks"]: a diverged state's values, the model's shapes
from core.kernel.job import RecipeError, RunFolder
from core.kernel.replica import load_checkpoint, save_checkpoint
from core.kernel.store import check_continues, checksum, from_rank0, newest_good, read_checkpoint, write_tensors
from core.plugins.lock import remove_stale_temporaries
from tiny import TiedMLP
from world import GlooWorld

CONFIG = {"recipe": "ddp", "world_size": 1, "global_batch": 8, "batch_size": 8, "model": "tiny:tied"}


def _run(folder, resume_from=None, **config) -> RunFolder:
    return RunFolder(Path(folder), resume_from, "ddp", CONFIG | config, True)


def check_resume(path, *, model, recipe: str, precision: str, world_size: int, global_batch: int) -> dict:
    """What the pre-check checks of a one-file checkpoint: whole, this model, and continuable in this job."""
    _, meta = read_checkpoint(path, model)
    batch = global_batch // world_size
    config = CONFIG | {"recipe": recipe, "precision": precision, "global_batch": global_batch, "batch_size": batch}
    check_continues(path, meta, config)
    return meta


def _train_state(seed=0, steps=3):
    torch.manual_seed(seed)
    model = TiedMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 64)).square().mean().backward()
        optimizer.step()
    return model, optimizer


def _progress(step, **extra):
    return {"epoch": 0, "samples": 8 * step, "step": step, **extra}


def _save(run_dir, step, model, optimizer, **config):
    Path(run_dir).mkdir(parents=True, exist_ok=True)  # as open_run makes it
    state = dict(model=model, optimizer=optimizer, scheduler=_scheduler(optimizer))
    return save_checkpoint(_run(run_dir, **config), **state, progress=_progress(step), keep=10)


def _scheduler(optimizer):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)


def _header(path) -> dict:
    data = path.read_bytes()
    return json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])


def _data_start(data: bytes, key: str) -> int:
    (size,) = struct.unpack("<Q", data[:8])
    return 8 + size + json.loads(data[8 : 8 + size])[key]["data_offsets"][0]


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[_data_start(data, "model/hidden.weight") + 3] ^= 0x40  # a float's high byte: the value off by a lot
    path.write_bytes(bytes(data))


def _nan_bytes(path):
    data = bytearray(path.read_bytes())
    start = _data_start(data, "model/hidden.weight")
    data[start : start + 4] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(data))


def _edit_progress(path):
    data = path.read_bytes()
    assert data.count(b'\\"step\\": 20') == 1
    path.write_bytes(data.replace(b'\\"step\\": 20', b'\\"step\\": 29'))  # same length: still parses


def _saved_nan_weight(path):
    model, optimizer = _train_state()
    with torch.no_grad():
        model.hidden.weight[0, 0] = float("nan")
    _save(path.parent.parent, 20, model, optimizer)  # honest checksums over a diverged state


def _saved_negative_exp_avg_sq(path):
    model, optimizer = _train_state()
    optimizer.state[model.hidden.weight]["exp_avg_sq"][0, 0] = -1.0
    _save(path.parent.parent, 20, model, optimizer)


DAMAGE = [
    (_flip_byte, "tensor model/hidden.weight does not match its checksum"),
    (_nan_bytes, "tensor model/hidden.weight does not match its checksum"),
    (_edit_progress, "the header does not match its checksum"),
    (_saved_nan_weight, "tensor model/hidden.weight holds a non-finite value"),
    (_saved_negative_exp_avg_sq, "exp_avg_sq holds a negative value"),
]


@pytest.mark.fast
@pytest.mark.parametrize("damage,words", DAMAGE, ids=[d.__name__.strip("_") for d, _ in DAMAGE])
def test_damaged_checkpoint_is_refused_in_one_line_and_auto_takes_the_one_before(
    tmp_path, capsys, group1, damage, words
):
    folder = tmp_path / "ddp-1"
    model, optimizer = _train_state()
    good = _save(folder, 10, model, optimizer)
    newest = _save(folder, 20, model, optimizer)
    damage(newest)
    with pytest.raises(RecipeError) as refused:
        read_checkpoint(newest)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(RecipeError, match=words):
        check_resume(newest, model=model, recipe="ddp", precision="fp32", world_size=1, global_batch=8)
    assert newest_good(folder) == good
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"skipping {newest}" in lines[0] and "trying the one before" in lines[0]
    good.write_bytes(good.read_bytes()[:100])  # the only one left is damaged too: none is taken
    assert newest_good(folder) is None
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"warning: --resume auto: skipping {good}, damaged")


@pytest.mark.fast
def test_every_tensor_and_the_header_carry_checksums_that_hold(tmp_path, group1):
    model, optimizer = _train_state()
    path = _save(tmp_path, 1, model, optimizer)
    header = _header(path)
    sums = json.loads(header["__metadata__"]["checksums"])
    tensors, _ = read_checkpoint(path)
    assert sums.keys() == tensors.keys() and all(sums[k] == checksum(t) for k, t in tensors.items())
    assert header["__metadata__"]["header_checksum"].startswith("crc32:") and all(
        s.startswith("xxh3:") for s in sums.values()
    )


def _save_in_world(topo, folder):
    model, optimizer = _train_state(seed=0)
    torch.manual_seed(100 + topo.rank)  # each rank's generator differs: the checkpoint holds both
    run = RunFolder(Path(folder), None, "ddp", CONFIG | {"world_size": 2, "global_batch": 16}, topo.rank == 0)
    save_checkpoint(
        run, model=model, optimizer=optimizer, scheduler=_scheduler(optimizer), progress=_progress(7), keep=2
    )
    return torch.rand(1).item()  # what rank r's generator gives next


@pytest.fixture(scope="module")
def world2_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("world2")
    with GlooWorld(2) as world:
        next_draws = world.run(_save_in_world, str(folder))
    return folder / "ckpt" / "step-000007.safetensors", next_draws


def _load_as(topo, path, seed):
    model, optimizer = _train_state(seed=5)
    torch.manual_seed(seed + topo.rank)
    seeded = torch.get_rng_state()
    run = RunFolder(Path(path).parent.parent, Path(path), "ddp", CONFIG, topo.rank == 0)
    progress = load_checkpoint(run, model=model, optimizer=optimizer, scheduler=_scheduler(optimizer))
    restored = torch.equal(torch.get_rng_state(), seeded)
    return progress, model.state_dict(), torch.rand(1).item(), restored


@pytest.mark.world
@pytest.mark.parametrize("new_world", [1, 4])
def test_world2_checkpoint_continues_at_another_world_size(world2_checkpoint, new_world):
    path, next_draws = world2_checkpoint
    tensors, meta = read_checkpoint(path)
    assert meta["world_size"] == "2" and meta["global_batch"] == "16"
    expected = TiedMLP()
    expected.load_state_dict({k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")})
    with GlooWorld(new_world) as world:
        loaded = world.run(_load_as, str(path), 1000)
    for rank, (progress, state, draw, kept_seed) in enumerate(loaded):
        assert progress["samples"] == 56 and progress["step"] == 7
        assert all(torch.equal(a, b) for a, b in zip(state.values(), expected.state_dict().values()))
        if rank < 2:  # the saved rank's generator continues; a new rank keeps its seeded one, silently
            assert draw == next_draws[rank]
        else:
            assert kept_seed
    config = CONFIG | {"global_batch": 16, "batch_size": 16 // new_world}
    check_continues(path, meta, config)
    # Per rank skip samples // W': DistributedSampler then hands out exactly the rest of the global order.
    data, epoch_order = range(64), lambda w, r: list(DistributedSampler(range(64), w, r, seed=3))
    consumed = {i for r in range(2) for i in epoch_order(2, r)[: progress["samples"] // 2]}
    rest = [i for r in range(new_world) for i in epoch_order(new_world, r)[progress["samples"] // new_world :]]
    assert len(rest) == len(set(rest)) and consumed.isdisjoint(rest) and consumed | set(rest) == set(data)


@pytest.mark.fast
@pytest.mark.parametrize(
    "batch_size,world,accum,fix",
    [
        (8, 1, 1, "use --batch-size 16"),
        (8, 4, 1, "use --batch-size 4"),
        (3, 3, 1, "use a number of ranks that divides 16"),
    ],
)
def test_another_global_batch_is_refused_with_the_numbers(tmp_path, batch_size, world, accum, fix):
    meta = {"world_size": "2", "global_batch": "16", "progress": json.dumps(_progress(7))}
    global_batch = batch_size * world * accum
    config = CONFIG | {"global_batch": global_batch, "batch_size": batch_size, "accum": accum}
    with pytest.raises(RecipeError) as refused:
        check_continues(tmp_path / "c", meta, config)
    line = str(refused.value)
    assert "global batch 16" in line and f"is {global_batch}" in line and fix in line and "\n" not in line


def _meta(recipe, precision="fp32", scaler=None):
    config = {"recipe": recipe} | ({"precision": precision} if recipe != "ddp" else {})  # ddp takes no --precision
    return {"recipe": recipe, "config": json.dumps(config), "scaler": json.dumps(scaler)}


def _compatible(path, saved, *, recipe, precision):
    config = CONFIG | {"recipe": recipe} | ({"precision": precision} if recipe != "ddp" else {})
    check_continues(path, saved, config)


@pytest.mark.fast
@pytest.mark.parametrize(
    "saved,recipe,precision",
    [
        (_meta("ddp"), "ddp_amp", "fp32"),  # ddp trains in fp32, --accum 1, no --clip: ddp_amp's defaults
        (_meta("ddp_amp", "fp16", {"scale": 1024.0}), "ddp_amp", "fp16"),
        (_meta("fsdp"), "fsdp", "fp32"),
    ],
)
def test_compatible_resumes_are_allowed(tmp_path, saved, recipe, precision):
    _compatible(tmp_path / "c", saved, recipe=recipe, precision=precision)


@pytest.mark.fast
@pytest.mark.parametrize(
    "saved,recipe,precision,words",
    [
        (
            _meta("ddp_amp", "fp16", {"scale": 1024.0}),
            "ddp_amp",
            "bf16",
            "trained in fp16 and this run asks for --precision bf16",
        ),
        (_meta("ddp_amp", "fp16", {"scale": 1024.0}), "ddp", "fp32", "resume with --precision fp16"),
        (_meta("ddp_amp", "bf16"), "ddp_amp", "fp16", "trained in bf16 and this run asks for --precision fp16"),
        (_meta("fsdp"), "ddp", "fp32", "a checkpoint of recipe fsdp, and this run is ddp"),
        (  # 27.7: ddp takes no --precision; its checkpoints are fp32 ones
            _meta("ddp"),
            "ddp_amp",
            "bf16",
            "other options (--precision fp32 -> bf16) would train another run; resume with --precision fp32",
        ),
        (
            _meta("ddp_amp", "bf16"),
            "ddp",
            "fp32",
            "(--precision bf16 -> fp32) would train another run; resume with ddp_amp --precision bf16",
        ),
        (_meta("ddp"), "tensor_parallel", "fp32", "resume it with ddp"),
    ],
)
def test_incompatible_resumes_are_refused_naming_both_sides(tmp_path, saved, recipe, precision, words):
    with pytest.raises(RecipeError) as refused:
        _compatible(tmp_path / "c", saved, recipe=recipe, precision=precision)
    assert words in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.fast
def test_check_resume_refuses_before_any_group_and_writes_nothing(tmp_path, group1):
    model, optimizer = _train_state()
    path = _save(tmp_path, 3, model, optimizer)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    meta = check_resume(path, model=model, recipe="ddp_amp", precision="fp32", world_size=2, global_batch=8)
    assert json.loads(meta["progress"])["step"] == 3
    with pytest.raises(RecipeError, match="global batch 8 .* is 16; use --batch-size 4"):
        check_resume(path, model=model, recipe="ddp", precision="fp32", world_size=2, global_batch=16)
    with pytest.raises(RecipeError, match="this run is fsdp"):
        check_resume(path, model=model, recipe="fsdp", precision="fp32", world_size=1, global_batch=8)
    other = TiedMLP()
    other.register_buffer("extra", torch.zeros(1))
    with pytest.raises(RecipeError, match="holds another model"):
        check_resume(path, model=other, recipe="ddp", precision="fp32", world_size=1, global_batch=8)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before


@pytest.mark.fast
def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    run_dir = tmp_path / "ddp-1"
    (run_dir / "ckpt").mkdir(parents=True)
    stale = [run_dir / ".config.json.tmp-4242", run_dir / "ckpt" / ".step-000009.safetensors.tmp-17"]
    kept = [
        run_dir / ".lock",
        run_dir / "config.json",
        run_dir / "notes.tmp-12",
        run_dir / ".x.tmp-abc",
        run_dir / "ckpt" / "step-000008.safetensors",
        run_dir / "ckpt" / "step-000009.safetensors.tmp-17",
        tmp_path / ".other.tmp-5",
    ]
    for path in stale + kept:
        path.write_bytes(b"x")
    (run_dir / "ckpt" / ".dir.tmp-3").mkdir()  # a folder of that name is not ours to delete
    assert sorted(remove_stale_temporaries(run_dir)) == sorted(stale)
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
    assert (run_dir / "ckpt" / ".dir.tmp-3").is_dir()


def test_from_rank0_gives_every_rank_its_value_and_its_error_as_one_line(tmp_path, group1):
    """Rank 0's decision on every rank; its RecipeError or OSError raised as one RecipeError line (none waits)."""
    assert from_rank0(True, lambda: {"folder": 1}) == {"folder": 1}
    with pytest.raises(RecipeError, match="^refused$"):
        from_rank0(True, lambda: _raise(RecipeError("refused")))
    with pytest.raises(RecipeError, match=f"{tmp_path / 'none'}: .*; check the folder"):
        from_rank0(True, lambda: (tmp_path / "none").read_bytes())


def _raise(err):
    raise err


def test_an_older_file_with_the_optimizers_scalars_in_json_still_loads(tmp_path, group1):
    """A non-tensor optimizer value, once kept in the header's "scalars", loads as it was saved."""
    model, optimizer = _train_state()
    tensors, meta = read_checkpoint(_save(tmp_path, 1, model, optimizer))
    step = float(tensors.pop("optim/0/step"))
    saved = json.loads(meta["optimizer"]) | {"scalars": {"0/step": step}}
    meta = {k: v for k, v in meta.items() if k not in ("checksums", "header_checksum")} | {"optimizer": saved}
    write_tensors(path := tmp_path / "ckpt" / "step-000001.safetensors", tensors, meta)
    fresh, fresh_optimizer = _train_state(steps=0)
    load_checkpoint(_run(tmp_path, path), model=fresh, optimizer=fresh_optimizer, scheduler=_scheduler(fresh_optimizer))
    loaded, trained = fresh_optimizer.state_dict()["state"][0], optimizer.state_dict()["state"][0]
    assert loaded["step"] == step and torch.equal(loaded["exp_avg"], trained["exp_avg"])
