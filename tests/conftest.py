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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(layer) for layer in LAYERS):
            item.add_marker(pytest.mark.e2e)


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
