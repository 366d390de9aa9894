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
# (A full run's --durations, divided by the load other jobs put on the machine; every file over 10 s is listed.)
SECONDS = {
    "test_launchers": 180, "test_standalone": 125, "test_run": 113, "test_check": 109, "test_multinode": 107,
    "test_plan": 68, "test_amp_accum_clip": 61, "test_train_longer": 60, "test_cli": 50, "test_shard_ckpt": 48,
    "test_ckpt": 48, "test_model_parallel": 44, "test_right": 41, "test_precheck": 35, "test_dist": 34,
    "test_finetune": 30, "test_slurm": 29, "test_monitoring": 23, "test_any_model": 20,
    "test_options": 20, "test_model_parallel_2d": 19, "test_bitwise4": 18, "test_golden": 17, "test_ckpt_async": 17,
    "test_model_parallel_e2e": 16, "test_comm_tuning": 16, "test_ckpt_integrity": 15, "test_tp_plan": 14,
    "test_copy_out": 13, "test_loss_contract": 11, "test_ddp_equivalence": 10,
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
