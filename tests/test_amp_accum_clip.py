"""Mixed precision, loss scaling, gradient accumulation and clipping (core.amp, core.accum, the ddp_amp recipe).

Layer 2 checks run in one gloo world of 4 ranks; a world of N <= 4 is a subgroup of it
(DDP takes `process_group=`), so every N is checked without starting another world.
"""

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from core.accum import make_loaders, micro_batch_groups, step_amp
from core.amp import grad_sync
from core.exact_loss import make_exact_loss
from core.grads import clip_grad_norm
from core.kernel.job import RecipeError, RunFolder
from core.kernel.replica import load_checkpoint, save_checkpoint
from core.kernel.step import step_plain
from core.kernel.train import Topology
from core.plugins.loss import ChosenLoss
from core.schedules import clip_over_stages
from core.zoo import quick_digits as digits
from helpers import REPO, in_one_interpreter, recipes_cli, run, user_env
from world import GlooWorld

CPU = torch.device("cpu")


def make_scaler(precision: str, *, device: torch.device, **options) -> torch.amp.GradScaler:
    """ddp_amp's GradScaler line (test_scaler_enabled_only_for_fp16 holds the recipe to it), with test options."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16", **options)


_GROUPS: dict[int, object] = {}  # per worker process: subgroups of the first N ranks


@pytest.fixture(scope="module")
def world4():
    with GlooWorld(4, timeout_s=90) as world:
        yield world


def _group(n: int):
    """The subgroup of ranks 0..n-1; every rank creates every group, in the same order, once."""
    if not _GROUPS:
        for size in range(1, 5):
            _GROUPS[size] = dist.new_group(list(range(size)))
    return _GROUPS[n]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(seed: int, n: int):
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(n, 8, generator=gen), torch.randint(3, (n,), generator=gen)


def _micro_batches(x, y, *, rank: int, world: int, sizes: list[int]):
    """Rank `rank`'s K micro-batches: micro-batch j of every rank has sizes[j] samples."""
    out, start = [], 0
    for size in sizes:
        lo = start + rank * size
        out.append((x[lo : lo + size], y[lo : lo + size]))
        start += world * size
    return out


def _ce(model: nn.Module):
    """--loss ce for step_amp (every counted target of the global batch weighs the same)."""
    plain = getattr(model, "module", model)
    return make_exact_loss(ChosenLoss(spec="ce"), model=plain)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits, targets)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


# 1. K micro-batches on N ranks == one step on the whole global batch.


def accumulate_on_subworld(topo, seed, world, sizes, steps):
    if topo.rank >= world:
        _group(world)  # every rank takes part in creating groups, then ranks outside it sit this one out
        return None
    model = DistributedDataParallel(_model(seed), process_group=_group(world))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(steps):
        x, y = _data(seed + step, world * sum(sizes))
        step_amp(
            model,
            _micro_batches(x, y, rank=topo.rank, world=world, sizes=sizes),
            optimizer=optimizer,
            loss_fn=_ce(model),
            sync=grad_sync,
            dp_group=_group(world),
        )
        grads.append(_grads(model))
    return grads, [p.detach().clone() for p in model.parameters()]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.integers(1, 4), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_accumulation_equals_one_global_batch(world4, world, sizes):
    """K = len(sizes) micro-batches per rank (sizes may differ: the last of an epoch is often short)."""
    seed, steps = 5, 2
    reference = _model(seed)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for step in range(steps):
        batch = _data(seed + step, world * sum(sizes))
        step_plain(reference, batch, optimizer=optimizer, loss_fn=ChosenLoss(spec="ce"))
        expected.append(_grads(reference))
    for result in world4.run(accumulate_on_subworld, seed, world, sizes, steps)[:world]:
        grads, params = result
        # fp32 sums in another order (per micro-batch, then over ranks): equal to ~1e-7 relative.
        for got, want in zip([g for step in grads for g in step], [g for step in expected for g in step]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(params, reference.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


# 2. Exactly one all-reduce per optimizer step under no_sync (counted by a comm hook).


def _counting_hook(state, bucket):
    state["calls"] += 1
    return default_hooks.allreduce_hook(state["group"], bucket)


def count_allreduces(topo, *, use_no_sync: bool, k: int, steps: int):
    group = _group(2)
    if topo.rank >= 2:
        return None
    model = DistributedDataParallel(_model(1), process_group=group)
    state = {"calls": 0, "group": group}
    model.register_comm_hook(state, _counting_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def always_sync(model, *, enabled):
        return grad_sync(model, enabled=True)

    for step in range(steps):
        x, y = _data(step, 2 * 3 * k)
        step_amp(
            model,
            _micro_batches(x, y, rank=topo.rank, world=2, sizes=[3] * k),
            optimizer=optimizer,
            loss_fn=_ce(model),
            sync=grad_sync if use_no_sync else always_sync,
            dp_group=group,
        )
    return state["calls"], [p.detach().clone() for p in model.parameters()]


def test_no_sync_all_reduces_once_per_optimizer_step(world4):
    k, steps = 4, 3  # the model is far below DDP's first bucket size: one bucket, one all-reduce per sync
    with_no_sync = world4.run(count_allreduces, use_no_sync=True, k=k, steps=steps)[:2]
    every_time = world4.run(count_allreduces, use_no_sync=False, k=k, steps=steps)[:2]
    assert [calls for calls, _ in with_no_sync] == [steps, steps]
    assert [calls for calls, _ in every_time] == [k * steps, k * steps]
    for got, want in zip(with_no_sync[0][1], every_time[0][1]):  # the same step either way
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# 3. Dynamic loss scaling: an inf gradient skips the step and backs the scale off.


def scaler_skips_inf(topo, *, inf_rank: int):
    group = _group(2)
    if topo.rank >= 2:
        return None
    model = DistributedDataParallel(_model(2), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # fp16 autocast and GradScaler run on CPU too: the recipe refuses fp16 there only because it is slow.
    scaler = make_scaler("fp16", device=CPU, init_scale=2.0**10, growth_interval=2)
    x, y = _data(0, 4)
    if topo.rank == inf_rank:
        x[0, 0] = float("inf")  # one bad sample on one rank: the all-reduce carries it to every rank
    before = [p.detach().clone() for p in model.parameters()]
    fp16 = dict(optimizer=optimizer, loss_fn=_ce(model), precision="fp16", scaler=scaler, dp_group=group)
    _, bad = step_amp(model, [(x, y)], **fp16)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    scales = [scaler.get_scale()]
    clean = []
    for step in range(2):
        x, y = _data(step + 1, 4)
        clean.append(step_amp(model, [(x, y)], **fp16, clip=1.0)[1])
        scales.append(scaler.get_scale())
    moved = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return bad, unchanged, scales, clean, moved


def test_grad_scaler_skips_inf_step_and_backs_off(world4):
    for bad, unchanged, scales, clean, moved in world4.run(scaler_skips_inf, inf_rank=1)[:2]:
        assert bad.skipped and bad.scale == 2.0**10 and not math.isfinite(bad.grad_norm)
        assert unchanged  # on both ranks, though only rank 1 saw the inf
        assert scales == [2.0**9, 2.0**9, 2.0**10]  # backed off, then grew after growth_interval=2 clean steps
        assert not any(s.skipped for s in clean) and moved


def fp32_nan_step(topo):
    if topo.rank >= 1:
        return None
    model = _model(3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = _data(0, 4)
    x[1] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    _, stats = step_amp(
        model,
        [(x, y)],
        optimizer=optimizer,
        loss_fn=_ce(model),
        precision="bf16",
        scaler=make_scaler("bf16", device=CPU),
    )
    return stats, all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bf16_nan_step_is_skipped_not_trained_on(world4):
    stats, unchanged = world4.run(fp32_nan_step)[0]
    assert stats.skipped and stats.scale == 1.0 and unchanged


# 4. Clipping: the total norm over all ranks, whatever the parameter layout.


def _reference_clipped(seed, n, max_norm):
    model = _model(seed)
    cross_entropy(model(_data(seed, n)[0]), _data(seed, n)[1]).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm, _grads(model)


def clip_ddp(topo, seed, world, max_norm):
    if topo.rank >= world:
        _group(world)
        return None
    model = DistributedDataParallel(_model(seed), process_group=_group(world))
    x, y = _data(seed, 6 * world)
    micro_batches = _micro_batches(x, y, rank=topo.rank, world=world, sizes=[2, 4])
    frozen = torch.optim.SGD(model.parameters(), lr=0.0)  # the step leaves the weights: the clipped grads are read
    _, stats = step_amp(
        model, micro_batches, optimizer=frozen, loss_fn=_ce(model), clip=max_norm, dp_group=_group(world)
    )
    return torch.tensor(stats.grad_norm), _grads(model)


@pytest.mark.parametrize("world", [2, 3])
def test_clip_across_ddp_ranks_equals_single_process(world4, world):
    seed, max_norm = 4, 0.05
    ref_norm, ref_grads = _reference_clipped(seed, 6 * world, max_norm)
    assert ref_norm > max_norm  # so clipping really scales
    for norm, grads in world4.run(clip_ddp, seed, world, max_norm)[:world]:
        torch.testing.assert_close(norm, ref_norm.float(), rtol=1e-5, atol=0)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def clip_disjoint_shards(topo, seed, max_norm):
    """Each rank owns every 4th parameter, as pipeline stages own their layers (core.schedules.clip_over_stages)."""
    model = _model(seed)
    cross_entropy(model(_data(seed, 12)[0]), _data(seed, 12)[1]).backward()
    mine = list(model.parameters())[topo.rank :: topo.world_size]
    norm = clip_over_stages(mine, max_norm, group=dist.group.WORLD)
    return norm, {i: p.grad for i, p in enumerate(model.parameters()) if i % topo.world_size == topo.rank}


def test_clip_over_disjoint_shards_equals_whole_model(world4):
    seed, max_norm = 6, 0.05
    ref_norm, ref_grads = _reference_clipped(seed, 12, max_norm)
    for norm, owned in world4.run(clip_disjoint_shards, seed, max_norm):
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        for index, grad in owned.items():
            torch.testing.assert_close(grad, ref_grads[index], rtol=1e-5, atol=1e-7)


def clip_dtensor_shards(topo, seed, max_norm):
    """Gradients as DTensors sharded on dim 0 (the layout fully_shard leaves): full_tensor() reduces the norm."""
    mesh = init_device_mesh("cpu", (topo.world_size,))
    model = _model(seed)
    cross_entropy(model(_data(seed, 12)[0]), _data(seed, 12)[1]).backward()
    params = []
    for p in model.parameters():
        sharded = nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
        sharded.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
        params.append(sharded)
    norm = clip_grad_norm(params, max_norm)
    return norm, [p.grad.full_tensor() for p in params]


def test_clip_over_dtensor_shards_equals_whole_model(world4):
    seed, max_norm = 7, 0.05
    ref_norm, ref_grads = _reference_clipped(seed, 12, max_norm)
    for norm, grads in world4.run(clip_dtensor_shards, seed, max_norm):
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


# Layer 1: pure functions.


def test_micro_batch_groups_drop_the_incomplete_tail():
    loader = [(torch.full((2,), i), torch.full((2,), i)) for i in range(10)]
    groups = list(micro_batch_groups(loader, 4, device=CPU))
    assert len(groups) == 10 // 4
    assert [int(x[0]) for group in groups for x, _ in group] == list(range(8))


def test_scaler_enabled_only_for_fp16():
    recipe = (REPO / "recipes" / "ddp_amp.py").read_text()
    assert 'torch.amp.GradScaler(topo.device.type, enabled=cfg.precision == "fp16")' in recipe
    assert make_scaler("fp16", device=CPU).is_enabled()
    assert not make_scaler("bf16", device=CPU).is_enabled()
    assert not make_scaler("fp32", device=CPU).is_enabled()


# Layer 3: the recipe as a user runs it.


def nan_digits():
    """digits with every 200th training image made of NaNs: a loss that goes non-finite mid-run."""
    train, val = digits()
    inputs, targets = train.tensors
    inputs = inputs.clone()
    inputs[::200] = float("nan")
    return torch.utils.data.TensorDataset(inputs, targets), val


def _summary(run_dir) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r["kind"] == "summary")


@pytest.mark.skipif(sys.platform != "linux", reason="the launcher is a bash script run with torchrun")
def test_launcher_bf16_accum_clip_reaches_accuracy(tmp_path):
    run(
        [
            "./launch_single_node.sh",
            "ddp_amp",
            "--precision",
            "bf16",
            "--accum",
            "4",
            "--clip",
            "1.0",
            "--out",
            str(tmp_path),
        ],
        env=user_env(NPROC_PER_NODE="2"),
        timeout=240,
    )
    (run_dir,) = tmp_path.iterdir()
    summary = _summary(run_dir)
    assert summary["val_acc"] >= 0.95, summary  # ddp reaches the same bar on the same data
    assert summary["global_batch"] == 32 * 2 * 4 and summary["world_size"] == 2 and summary["skipped_steps"] == 0
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["precision"], config["accum"], config["clip"]) == ("bf16", 4, 1.0)


def test_nonfinite_loss_stops_the_run_naming_the_step(tmp_path):
    args = ["run", "ddp_amp", "--data", "test_amp_accum_clip:nan_digits", "--epochs", "1", "--out", str(tmp_path)]
    env = user_env(PYTHONPATH=str(REPO / "tests"))
    proc = recipes_cli(*args, env=env, check=False, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step ") and "not finite" in last and "--on-nonfinite skip" in last, proc.stderr

    proc = recipes_cli(*args, "--on-nonfinite", "skip", env=env, timeout=120)
    summary = _summary(max(tmp_path.iterdir()))
    assert 0 < summary["skipped_steps"] < summary["steps"] == math.ceil(len(digits()[0]) / 32), summary


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """`python -m recipes run ddp_amp ...` of the refusals below, each in a folder of its own (its --out), one after
    another in one interpreter (tests/cli_cases.py): {case: what it returned}."""
    cases = {
        "fp16": (["--precision", "fp16", "--dry-run"], {"CUDA_VISIBLE_DEVICES": ""}),
        "static graph": (["--accum", "2", "--static-graph"], {}),
        "accum": (["--accum", "100", "--batch-size", "64"], {}),
        "one sample": (["--data", "test_amp_accum_clip:one_sample", "--accum", "2"], {}),
    }
    listed = []
    for key, (args, env) in cases.items():
        out = tmp_path_factory.mktemp(key.replace(" ", "-"))
        listed.append({"args": ["run", "ddp_amp", *args, "--out", str(out)], "cwd": str(out), "env": env})
    said = in_one_interpreter(listed, env=user_env(PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)])))
    return dict(zip(cases, said, strict=True))


def test_fp16_on_cpu_names_bf16(refused):
    proc = refused["fp16"]
    assert proc.returncode != 0 and "--precision bf16" in proc.stderr.strip().splitlines()[-1]


def test_static_graph_with_accumulation_is_refused(refused):
    proc = refused["static graph"]
    assert proc.returncode != 0 and "--static-graph with --accum 2" in proc.stderr.strip().splitlines()[-1]


def test_accum_larger_than_an_epoch_is_refused(refused):
    proc = refused["accum"]
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and line.startswith("error: --batch-size 64 x --accum 100: the training set"), line
    assert line.endswith("not one optimizer step; use --accum 22 or less")


def test_a_data_set_smaller_than_one_batch_advises_what_fits(refused):
    proc = refused["one sample"]
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "(1 samples) gives each of 1 rank(s) 1, not one optimizer step" in line, proc.stderr
    assert line.endswith("use --batch-size 1 or less")
    on_two = Topology(0, 2, CPU)  # on 2 ranks the one sample is dropped
    with pytest.raises(RecipeError) as refused:
        cfg = argparse.Namespace(batch_size=32, seed=0, accum=2, epochs=1, max_steps=0)
        make_loaders(cfg, on_two, one_sample()[0], None, None)
    line = str(refused.value)
    assert "--batch-size 32 x --accum 2: the training set (1 samples) gives each of 2 rank(s) 0" in line
    assert line.endswith("not one optimizer step; use fewer ranks")
    assert "--accum 0" not in line


def one_sample():
    inputs, targets = torch.rand(1, 64), torch.zeros(1, dtype=torch.int64)
    return torch.utils.data.TensorDataset(inputs, targets), None


def test_scaler_state_round_trips_through_a_checkpoint(tmp_path):
    """A resumed fp16 run carries on with the scale (and the growth count) it had."""
    torch.manual_seed(0)
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler("fp16", device=CPU, init_scale=2.0**12, growth_interval=3)
    x, y = _data(0, 4)
    x[0, 0] = float("inf")
    fp16 = dict(optimizer=optimizer, loss_fn=_ce(model), precision="fp16", scaler=scaler)
    step_amp(model, [(x, y)], **fp16)
    step_amp(model, [_data(1, 4)], **fp16)
    run = RunFolder(tmp_path, None, "ddp_amp", {"global_batch": 4, "world_size": 1}, True)
    state = dict(optimizer=optimizer, scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4))
    progress = {"epoch": 0, "samples": 8, "step": 2, "scaler": scaler.state_dict()}  # as ddp_amp saves fp16's
    fresh, other = make_scaler("fp16", device=CPU), _model(1)
    optimizer2 = torch.optim.SGD(other.parameters(), lr=0.1)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        path = save_checkpoint(run, model=model, **state, progress=progress, keep=2)
        resumed = RunFolder(tmp_path, path, "ddp_amp", run.config, True)
        scheduler2 = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer2, T_max=4)
        start = load_checkpoint(resumed, model=other, optimizer=optimizer2, scheduler=scheduler2)
    finally:
        torch.distributed.destroy_process_group()
    fresh.load_state_dict(start["scaler"])  # as ddp_amp loads it
    assert fresh.state_dict() == scaler.state_dict() and fresh.get_scale() == 2.0**11


def _amp_run(out, *args):
    command = [
        sys.executable,
        "-m",
        "recipes",
        "run",
        "ddp_amp",
        "--model",
        "tiny:mlp",
        "--precision",
        "bf16",
        "--accum",
        "4",
        "--batch-size",
        "100",
        "--clip",
        "0.5",
        "--max-steps",
        "7",
        "--out",
        str(out),
        *args,
    ]
    run(command, cwd=out, env=user_env(PYTHONPATH=str(REPO / "tests")), timeout=120)


@pytest.fixture(scope="module")
def amp_finished(tmp_path_factory):
    """7 steps, one process: 15 micro-batches an epoch make 3 steps of 4 and a dropped tail of 3."""
    out = tmp_path_factory.mktemp("amp")
    _amp_run(out, "--ckpt-every", "1", "--keep", "100")
    return out / "ddp_amp-1"


@pytest.mark.parametrize("stop", [2, 3, 4])  # mid-epoch, the epoch's last step (before the tail), the next epoch
def test_resume_with_accumulation_is_bitwise_exact(amp_finished, tmp_path, stop):
    moved = tmp_path / f"step-{stop:06d}.safetensors"
    moved.write_bytes((amp_finished / "ckpt" / moved.name).read_bytes())
    _amp_run(tmp_path, "--resume", str(moved))
    resumed, finished = (
        load_file(tmp_path / "ddp_amp-1" / "model.safetensors"),
        load_file(amp_finished / "model.safetensors"),
    )
    assert resumed.keys() == finished.keys() and all(torch.equal(resumed[k], finished[k]) for k in finished)


def test_bench_prints_both_ratios():
    proc = run(
        [sys.executable, "bench/bench_amp_accum.py", "--model", "tiny:mlp", "--rounds", "1", "--steps", "1"],
        env=user_env(PYTHONPATH=str(REPO / "tests")),
        timeout=120,
    )
    assert "no_sync / sync-every-micro-batch = " in proc.stdout and "bf16 / fp32 = " in proc.stdout, proc.stdout
