"""`python -m recipes check NAME`: is a model safe to train distributed?

Layer 1: the probes on small models in this process (each cause found and named, nothing found
on the built-in models) and the weight comparison on made-up tensors. Layer 3: the command itself,
which runs the recipe under torchrun and as one process: it passes on the built-in models and
fails, exit status 1, naming the cause, on a model with an unused parameter and one with BatchNorm.
"""
import sys

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tools.check import REL_TOL, check_recipe, compare_weights, probe, sample_batch
from core.config import RecipeError
from core.models import build_model
from helpers import recipes_cli, user_env
from tools.registry import RECIPES

USER_MODELS = '''
from torch import nn


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.spare = nn.Linear(32, 10)  # forward() never calls it

    def forward(self, x):
        return self.net(x)


def unused():
    return Unused()


def batchnorm():
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


def dropout():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 10))
'''


class Drifting(nn.Module):
    """Gives another answer every call with the same seed: state that changes outside the RNG."""

    calls = 0  # on the class: a copy of the model shares it

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x):
        type(self).calls += 1
        return self.linear(x) * (1 + 1e-3 * self.calls)


def _user_models(tmp_path):
    (tmp_path / "usermodels.py").write_text(USER_MODELS)
    sys.path.insert(0, str(tmp_path))
    import usermodels

    sys.path.remove(str(tmp_path))
    return usermodels


@pytest.fixture(scope="module")
def digits_batch():
    return sample_batch("digits", size=8)


@pytest.mark.parametrize("model,data", [("mlp", "digits"), ("cnn", "digits"), ("gpt", "text")])
def test_probes_find_nothing_in_the_built_in_models(model, data):
    torch.manual_seed(0)
    assert probe(build_model(model), sample_batch(data, size=4)) == []


@pytest.mark.parametrize("factory,cause,names", [
    ("unused", "unused parameters", "spare.weight, spare.bias"),
    ("batchnorm", "BatchNorm without SyncBatchNorm", "1 (BatchNorm1d)"),
    ("dropout", "dropout or other randomness not seeded per rank", "dropout (2)"),
])
def test_probes_name_the_cause_and_the_layer(tmp_path, digits_batch, factory, cause, names):
    findings = probe(getattr(_user_models(tmp_path), factory)(), digits_batch)
    assert [f.cause for f in findings] == [cause]
    assert names in findings[0].detail


def test_probes_see_a_layer_that_is_not_deterministic(digits_batch):
    assert [f.cause for f in probe(Drifting(), digits_batch)] == ["non-deterministic layers"]


def test_weights_are_compared_against_how_far_training_moved_them(tmp_path):
    gen = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(1000, generator=gen), "b": torch.zeros(10)}
    single = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in start.items()}
    noisy = {"w": single["w"].clone(), "b": single["b"] + torch.tensor([1e-5] + [0.0] * 9)}  # one element off
    broken = {k: v + 3e-4 * torch.randn(v.shape, generator=gen) for k, v in single.items()}  # every element off
    paths = {}
    for name, tensors in (("start", start), ("single", single), ("noisy", noisy), ("broken", broken)):
        paths[name] = tmp_path / f"{name}.safetensors"
        save_file(tensors, paths[name])
    noise = compare_weights(paths["noisy"], paths["single"], paths["start"])
    assert noise.where == "b" and noise.max_diff == pytest.approx(1e-5, rel=1e-2) and noise.relative < REL_TOL
    assert compare_weights(paths["broken"], paths["single"], paths["start"]).relative > 10 * REL_TOL
    assert compare_weights(paths["single"], paths["single"], paths["start"]).relative == 0.0


# --- the command, end to end --------------------------------------------------------------------------


def _check(*args, tmp_path):
    """`python -m recipes check ...` from a folder holding the user's own models, as a user runs it."""
    (tmp_path / "usermodels.py").write_text(USER_MODELS)
    return recipes_cli("check", *args, cwd=tmp_path, env=user_env(PYTHONPATH=str(tmp_path)), check=False,
                       timeout=420)


@pytest.mark.parametrize("args", [["ddp"], ["ddp", "--model", "cnn"], ["fsdp"]],
                         ids=["ddp-mlp", "ddp-cnn", "fsdp-gpt"])
def test_check_passes_on_the_built_in_models(args, tmp_path):
    proc = _check(*args, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equivalent: yes" in proc.stdout
    assert "largest parameter difference" in proc.stdout and "training loss difference" in proc.stdout
    assert "tolerance" in proc.stdout


def test_check_fails_on_an_unused_parameter_and_names_it(tmp_path):
    proc = _check("ddp", "--model", "usermodels:unused", tmp_path=tmp_path)
    assert proc.returncode == 1
    assert "equivalent: NO" in proc.stdout
    assert "likely cause: unused parameters: spare.weight, spare.bias" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")


def test_check_fails_on_batchnorm_and_names_it(tmp_path):
    proc = _check("ddp", "--model", "usermodels:batchnorm", tmp_path=tmp_path)
    assert proc.returncode == 1
    assert "weights apart / moved by training" in proc.stdout and "OUTSIDE" in proc.stdout
    assert "likely cause: BatchNorm without SyncBatchNorm: 1 (BatchNorm1d)" in proc.stdout


def test_a_model_that_cannot_train_on_the_data_fails_before_any_launch():
    with pytest.raises(RecipeError, match=r"--model mlp --data text: one training step fails \(RuntimeError"):
        check_recipe(RECIPES["ddp"], model="mlp", data="text")
