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
# (test_standalone, test_run, test_ckpt: today's CPU seconds scaled to the old numbers, after their launches shared.)
SECONDS = {
    "test_multinode": 145, "test_launchers": 126, "test_standalone": 106, "test_check": 63, "test_run": 90,
    "test_ckpt": 44, "test_cli": 49, "test_amp_accum_clip": 45, "test_plan": 43,
    "test_model_parallel": 39, "test_finetune": 31, "test_dcp": 30, "test_right": 30, "test_monitoring": 25,
    "test_precheck": 23, "test_model_parallel_2d": 16, "test_dist": 14, "test_model_parallel_e2e": 13,
    "test_ckpt_integrity": 12, "test_options": 12, "test_comm_tuning": 10, "test_golden": 10,
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
    with GlooWorld(2) as world:
        yield world


@pytest.fixture(scope="module")
def world1():
    """A world of one: the same code paths as world2, without a second process."""
    with GlooWorld(1) as world:
        yield world
