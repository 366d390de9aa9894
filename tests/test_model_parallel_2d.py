"""Layer 2 on 4 gloo ranks: the 2-D meshes. pipeline with pp=2 x dp=2 and fsdp_tp with dp=2 x tp=2
give the parameters one process gets on the same global batches (each step: both data shares).
Tolerance as in test_model_parallel.py: atol 5e-5, rtol 1e-4 after 3 AdamW steps at lr 1e-3."""

import pytest

from mp_reference import assert_same_weights, config, reference, run_recipe
from world import GlooWorld

TOL = dict(atol=5e-5, rtol=1e-4)
pytestmark = [pytest.mark.world, pytest.mark.slow]  # 4 processes on a 2-core machine


@pytest.fixture(scope="module")
def world4():
    with GlooWorld(4, timeout_s=180) as world:
        yield world


@pytest.fixture(scope="module")
def two_shares():
    return reference(config("fsdp"), replicas=2)


def test_pipeline_times_data_parallel(world4, two_shares, tmp_path):
    summaries = world4.run(run_recipe, "pipeline", config("pipeline", out=str(tmp_path), microbatches=4, pp=2))
    assert (summaries[0]["pp"], summaries[0]["dp"], summaries[0]["global_batch"]) == (2, 2, 16)
    assert_same_weights(summaries[0], two_shares, **TOL)


def test_fsdp_times_tensor_parallel(world4, two_shares, tmp_path):
    summaries = world4.run(run_recipe, "fsdp_tp", config("fsdp_tp", out=str(tmp_path), tp=2))
    assert (summaries[0]["tp"], summaries[0]["dp"]) == (2, 2)
    assert_same_weights(summaries[0], two_shares, **TOL)


def test_fsdp_tp_recipe_with_accumulation_and_clip(world4, tmp_path):
    """dp=2 x tp=2, the recipe's whole step: K=2 micro-batches of 4 a group, a clip that bites."""
    cfg = config("fsdp_tp", out=str(tmp_path), tp=2, accum=2, clip=0.05, batch_size=4)
    summaries = world4.run(run_recipe, "fsdp_tp", cfg)
    assert summaries[0]["global_batch"] == 16
    assert_same_weights(summaries[0], reference(cfg, replicas=2), **TOL)


def pipeline_dp_accum_clip(topo):
    """pp=2 x dp=2: each replica accumulates K=2 batches of its half through 2 stages; the clip's norm is taken
    over the pp group only (after the dp average the replicas hold equal gradients: counting them would double it)."""
    import torch
    from test_model_parallel import CLIP, _one_process, _tiny_gpt, _token_batches
    from torch.distributed.pipelining import PipelineStage

    from core import schedules
    from core.mesh import build_mesh

    batches = _token_batches(size=16, padded=True)  # each replica's count differs: the global count weighs
    expected, _ = _one_process(batches, k=1)
    mesh = build_mesh(topo, {"dp": 2, "pp": 2})
    dp_rank, pp_rank = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    stage = schedules.split_pipeline(_tiny_gpt(), num_stages=2, stage_index=pp_rank)
    stages = [PipelineStage(stage, pp_rank, 2, topo.device, group=mesh["pp"].get_group())]
    loss_fn = schedules.TokenLoss()
    sched = schedules.build_schedule("1f1b", stages, microbatches=4, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    for x, y in batches:
        x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        schedules.step_pipeline(
            sched,
            (x, y),
            loss_fn=loss_fn,
            optimizer=optimizer,
            holds_last=pp_rank == 1,
            dp_group=mesh["dp"].get_group(),
            clip=CLIP,
            pp_group=mesh["pp"].get_group(),
        )
    full = schedules.gather_state_dict([stage])
    return {k: (full[k], v) for k, v in expected.items()} if full else None


def test_pipeline_times_data_parallel_accumulation_and_clip(world4):
    from test_model_parallel import _assert_pairs

    pairs = world4.run(pipeline_dp_accum_clip)[0]
    _assert_pairs(pairs, **TOL)


def fsdp_tp_accum_clip(topo):
    """dp=2 x tp=2: TP inside a pair, fully_shard across pairs, K=2 micro-batches under fsdp_sync, the clip's
    norm over the 2-D DTensor shards."""
    import torch
    from test_model_parallel import CLIP, _one_process, _split_tp, _tiny_gpt, _token_batches, accumulate

    from core import grads
    from core.exact_loss import make_exact_loss
    from core.kernel.loss import Loss
    from core.mesh import build_mesh
    from core.shard import fsdp_sync
    from mp_reference import apply_fsdp, full_state_dict

    batches = _token_batches(size=16)
    expected, expected_norms = _one_process(batches, k=1)
    mesh = build_mesh(topo, {"dp": 2, "tp": 2})
    model = apply_fsdp(_split_tp(_tiny_gpt(), mesh["tp"]), mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = make_exact_loss(Loss(), model=model)
    norms, dp_rank = [], mesh["dp"].get_local_rank()
    for x, y in batches:
        x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        optimizer.zero_grad(set_to_none=True)  # step_amp's fp32 path with grads.clip_grad_norm: the TP layers'
        micro = list(zip(x.chunk(2), y.chunk(2)))  # grads live on the dp x tp mesh, the others on dp's
        accumulate(model, micro, loss_fn, dp_group=mesh["dp"].get_group(), sync=fsdp_sync)
        norms.append(float(grads.clip_grad_norm(model.parameters(), CLIP)))
        optimizer.step()
    full = full_state_dict(model)
    return norms, expected_norms, {k: (full[k], v) for k, v in expected.items()} if full else None


def test_fsdp_tp_accumulation_and_clip(world4):
    from test_model_parallel import _assert_pairs

    norms, expected_norms, pairs = world4.run(fsdp_tp_accum_clip)[0]
    assert norms == pytest.approx(expected_norms, rel=1e-5)
    _assert_pairs(pairs, **TOL)
