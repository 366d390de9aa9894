"""Layer 2: pipeline, tensor parallel, FSDP and FSDP x TP on 2 gloo ranks give the parameters one
process gets training the tiny GPT on the same global batches.

Each test runs the recipe's own train() (data loading, schedule, optimizer, LR schedule, the
gathered safetensors file) and compares the file rank 0 wrote with plain single-process
training. Tolerance: atol 2e-5, rtol 1e-4 after 3 AdamW steps at lr 1e-3. The parallel runs
add the same numbers in another order (micro-batch sums, sharded matmuls, reduce-scatter), and
Adam's step divides by sqrt(v), which magnifies such float32 rounding for near-zero
gradients; a real mistake (a missing 1/M scale, a lost shard, a wrong micro-batch) is off by
1e-3 or more.
"""
import pytest
from mp_reference import assert_same_weights, reference, run_recipe

from core.config import TrainConfig
from world import GlooWorld

TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def world2():
    with GlooWorld(2, timeout_s=120) as world:
        yield world


def _cfg(tmp_path, **changes) -> TrainConfig:
    base = dict(model="gpt", data="text", epochs=1, max_steps=3, batch_size=8, lr=1e-3, log_every=1,
                out=str(tmp_path))
    return TrainConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def one_share(tmp_path_factory):
    """Reference for the recipes whose ranks share one batch (pipeline, tensor parallel, dp=1)."""
    return reference(_cfg(tmp_path_factory.mktemp("ref")), replicas=1)


@pytest.mark.parametrize("schedule, microbatches", [("1f1b", 4), ("gpipe", 2), ("interleaved1f1b", 4)])
def test_pipeline_equals_single_process(world2, one_share, tmp_path, schedule, microbatches):
    options = dict(schedule=schedule, microbatches=microbatches, pp=2, balance="params")
    summaries = world2.run(run_recipe, "pipeline", _cfg(tmp_path), options)
    assert summaries[0]["pp"] == 2 and summaries[0]["steps"] == 3
    assert_same_weights(summaries[0], one_share, **TOL)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_equals_single_process(world2, one_share, tmp_path, sequence_parallel):
    summaries = world2.run(run_recipe, "tensor_parallel", _cfg(tmp_path), dict(sequence_parallel=sequence_parallel))
    assert_same_weights(summaries[0], one_share, **TOL)


def test_fsdp_equals_single_process(world2, tmp_path):
    cfg = _cfg(tmp_path)
    summaries = world2.run(run_recipe, "fsdp", cfg, {})
    assert summaries[0]["global_batch"] == 2 * cfg.batch_size
    assert_same_weights(summaries[0], reference(cfg, replicas=2), **TOL)


def test_fsdp_tp_on_two_ranks_equals_single_process(world2, one_share, tmp_path):
    """tp=2 x dp=1: the 2-D code path (two meshes, DTensor shards wrapped by fully_shard)."""
    summaries = world2.run(run_recipe, "fsdp_tp", _cfg(tmp_path), dict(tp=2))
    assert_same_weights(summaries[0], one_share, **TOL)


def test_ranks_agree_on_the_reported_loss(world2, tmp_path):
    """The loss comes from the last stage, reduced over ranks: both ranks return the same summary."""
    first, second = world2.run(run_recipe, "pipeline", _cfg(tmp_path, max_steps=2),
                               dict(schedule="1f1b", microbatches=2, pp=2, balance="time"))
    assert first["train_loss"] == second["train_loss"] and first["val_loss"] == second["val_loss"]
