"""Factories are called once, before any process starts: every bad one is refused in one line naming it."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from core.kernel.job import RecipeError
from core.plugins.factories import data_from_spec, model_from_spec
from tools.precheck import check_data, check_model


def check_data_factory(spec: str) -> dict:
    return check_data(spec, streams=True, recipe="ddp_amp")


def check_model_factory(spec: str):
    return check_model(spec)


FACTORIES = """
import torch
from torch.utils.data import IterableDataset, TensorDataset

class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n
    def __iter__(self):
        return ({"input_ids": torch.tensor([i, i]), "labels": torch.tensor(i)} for i in range(self.n))

def model_needs_args(width):
    return torch.nn.Linear(width, 2)
def model_raises():
    raise ValueError("no such\\ncheckpoint")
def model_wrong():
    return "a string"
def model_ok():
    return torch.nn.Linear(4, 2)

def data_needs_args(path, *, split="train"):
    return None
def data_raises():
    return {}["missing"]
def data_wrong():
    return TensorDataset(torch.zeros(3, 2))
def data_wrong_train():
    return 5, None
def data_generator():
    return (x for x in range(4)), None
def data_empty():
    return TensorDataset(torch.zeros(0, 2), torch.zeros(0)), None
def data_empty_stream():
    return Stream(0), None
def data_bad_sample():
    return ["text"] * 4, None
def data_ragged():
    return [(torch.zeros(i + 1), torch.tensor(0)) for i in range(4)], None
def data_bad_collate():
    return [(torch.zeros(2), torch.tensor(0))], None, "pad"
def _broken_collate(samples):
    raise RuntimeError("collate broke")
def data_collate_raises():
    return [(torch.zeros(2), torch.tensor(0))] * 2, None, _broken_collate
def data_stream():
    return Stream(10), Stream(3)
def data_with_collate():
    ragged = [(torch.zeros(i + 1), torch.tensor(0)) for i in range(4)]
    return ragged, None, lambda samples: torch.nn.utils.rnn.pad_sequence([x for x, _ in samples])
"""


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    folder = tmp_path_factory.mktemp("factories")
    (folder / "fx.py").write_text(FACTORIES)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


def refused(check, spec: str) -> str:
    with pytest.raises(RecipeError) as caught:
        check(spec)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(("--model " + spec, "--data " + spec)), message
    return message


@pytest.mark.fast
@pytest.mark.parametrize(
    "name,words",
    [
        ("model_needs_args", "needs arguments (width)"),
        ("model_raises", "raised ValueError: no such checkpoint"),
        ("model_wrong", "returned str, not an nn.Module"),
    ],
)
def test_a_bad_model_factory_is_one_line(factories, name, words):
    assert words in refused(check_model_factory, f"fx:{name}")


@pytest.mark.fast
@pytest.mark.parametrize(
    "name,words",
    [
        ("data_needs_args", "needs arguments (path)"),
        ("data_raises", "raised KeyError: 'missing'"),
        ("data_wrong", "must return (train, val) or (train, val, collate_fn); it returned TensorDataset"),
        ("data_wrong_train", "its train is of type int, not a data set"),
        ("data_generator", "its train is of type generator, not a data set"),
        ("data_empty", "the training set is empty"),
        ("data_empty_stream", "the training set is empty"),
        ("data_bad_sample", "a training sample is of type str"),
        ("data_ragged", "collating 2 training samples raised RuntimeError"),
        ("data_bad_collate", "its collate_fn is of type str, not a function"),
        (
            "data_collate_raises",
            "the factory's collate_fn raised RuntimeError: collate broke on 2 training samples; fix",
        ),
    ],
)
def test_a_bad_data_factory_is_one_line(factories, name, words):
    assert words in refused(check_data_factory, f"fx:{name}")


@pytest.mark.fast
def test_good_factories_are_accepted_and_build_the_same_things(factories):
    model = check_model_factory("fx:model_ok")
    assert isinstance(model, torch.nn.Linear) and sum(p.numel() for p in model.parameters()) == 10
    stream = check_data_factory("fx:data_stream")
    assert stream["stream"] is True and stream["collate"] is None
    assert callable(check_data_factory("fx:data_with_collate")["collate"])
    found = check_data_factory("digits")
    assert len(found["train"]) == 1438 and len(found["val"]) == 359 and not found["stream"]
    train, val, collate = data_from_spec(SimpleNamespace(data="digits", seed=0))  # the run's (the plug-in's)
    assert len(train) == 1438 and len(val) == 359 and collate is None
    assert model_from_spec(SimpleNamespace(model="fx:model_ok")).out_features == 2


@pytest.mark.fast
def test_a_stream_is_refused_by_a_recipe_that_reads_none_naming_those_that_do(factories):
    with pytest.raises(RecipeError) as refused:
        check_data("fx:data_stream", streams=False, recipe="ddp")
    assert "its train set is a stream (an IterableDataset); ddp reads map-style data sets" in str(refused.value)
    assert "ddp_amp" in str(refused.value)


@pytest.mark.e2e
def test_the_cli_pre_check_refuses_a_bad_factory_before_anything_is_created(factories, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), str(factories)]))
    out = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, "-m", "recipes", "run", "ddp", "--data", "fx:data_wrong", "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "error: --data fx:data_wrong: the factory must return (train, val) or (train, val, collate_fn); "
        "it returned TensorDataset"
    ], done.stderr
    assert not out.exists(), "nothing is created"


def _shuffled_split():
    """A user's data factory as many are written: Python's and numpy's global generators pick the split."""
    import random

    import numpy as np

    order = list(range(20))
    random.shuffle(order)
    noise = np.random.rand(20)
    return order[:15], (order[15:], noise.tolist())


@pytest.mark.fast
def test_the_seed_makes_a_factory_that_shuffles_with_random_or_numpy_the_same_on_every_rank(monkeypatch):
    """review4: --seed seeded torch only, so a factory that shuffled with `random` gave each rank another split (a
    sample trained on one rank was validated on another). Every recipe seeds torch before it builds; the factories
    plug-in seeds Python's and numpy's generators before it calls a data factory."""
    import ast
    from types import SimpleNamespace

    from core.plugins import factories
    from tools.registry import RECIPES

    monkeypatch.setitem(factories.DATASETS, "shuffled", _shuffled_split)
    first = factories.data_from_spec(SimpleNamespace(data="shuffled", seed=3))
    assert (
        factories.data_from_spec(SimpleNamespace(data="shuffled", seed=3)) == first
    )  # every rank, each its own process
    assert factories.data_from_spec(SimpleNamespace(data="shuffled", seed=4)) != first
    for name, recipe in RECIPES.items():
        source = Path(sys.modules[recipe.load().__name__].__file__).read_text()
        calls = [ast.unparse(n.func) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
        seed = "torch.manual_seed"  # cfg.seed, before anything is built
        build = next(call for call in ("build_data", "build_text") if call in calls)  # the GPT recipes: build_text
        assert seed in calls and calls.index(seed) < calls.index(build), name
