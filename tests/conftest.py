"""Shared fixtures and the test layers.

Layers (pytest markers, fastest first): `fast` (pure functions, no process group),
`world` (a gloo world started once per module), `e2e` (the launchers and `python -m recipes`
as real processes). A test marked with none of them counts as e2e. `slow` marks tests that
start more processes than this 2-core machine has cores.

    pytest -m fast          # the developer's loop, under a minute
    pytest                  # everything (CI)
"""

import pytest

from world import GlooWorld

LAYERS = ("fast", "world", "e2e")


# Seconds each file takes alone (pytest --durations, 2-core machine). Only the order uses them: the longest
# files start first, so that under `-n 2 --dist loadfile` the short ones fill the end and neither worker
# waits alone for a long file at the end (longest-first scheduling). A stale number only schedules worse.
# (A full run's --durations on a quiet machine, 2026-12-07: every file of 6 s or more is listed.)
SECONDS = {
    "test_launchers": 122, "test_multinode": 102, "test_standalone": 100, "test_check": 89, "test_model_parallel": 61,
    "test_cli": 60, "test_plan": 60, "test_amp_accum_clip": 52, "test_run": 51, "test_train_longer": 51,
    "test_right": 42, "test_ckpt": 39, "test_shard_ckpt": 34, "test_options": 24, "test_finetune": 23,
    "test_golden": 18, "test_monitoring": 17, "test_model_parallel_e2e": 17, "test_model_parallel_2d": 17,
    "test_dist": 16, "test_ckpt_integrity": 15, "test_precheck": 14, "test_comm_tuning": 11, "test_tp_plan": 9,
    "test_loss_contract": 8, "test_ddp_equivalence": 7, "test_ckpt_async": 6, "test_bitwise4": 6, "test_any_model": 6,
    "test_slurm": 6,
}  # fmt: skip


def pytest_configure(config):
    # xdist's loadfile otherwise hands out the files with the most tests first (--loadscope-reorder, its default),
    # whatever the order below: test_multinode's 11 tests and 145 s would start in the second half
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(layer) for layer in LAYERS):
            item.add_marker(pytest.mark.e2e)
    items.sort(key=lambda item: -SECONDS.get(item.path.stem, 0))  # stable: a file's tests keep their order


@pytest.fixture(scope="module")
def world2():
    """Two gloo ranks for the whole module: start once, run many checks on it."""
    with GlooWorld(2, timeout_s=120) as world:  # a sharded step on a busy 2-core machine
        yield world


@pytest.fixture(scope="module")
def world1():
    """A world of one: the same code paths as world2, without a second process."""
    with GlooWorld(1, timeout_s=120) as world:
        yield world


@pytest.fixture
def group1():
    """A process group of one in this process (the kernel's checkpoint calls are collectives), left as it was found."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
