"""The models and data people really have, through the recipes: 2 CPU ranks against one process.

`python -m recipes check` runs a recipe under torchrun on 2 processes and as one process on the
same global batch, and compares the weights and the loss. Here it runs on a `transformers` GPT-2
and BERT built from tiny configs (no download) and a nanoGPT-style model, with dict and pair
batches and streaming data sets (tests/check_user.py), under the recipes that take them. (The
standalone copy of ddp trains a transformers GPT-2 bit for bit like the packaged recipe: tests/test_standalone.py.)
"""

import pytest

from helpers import REPO
from tools.check import check_recipe
from tools.registry import RECIPES

pytestmark = pytest.mark.e2e
CASES = [  # recipe, model, data, options
    ("ddp_amp", "check_user:gpt2", "check_user:lm_stream", ["--accum", "2"]),  # own loss, dicts, a sized stream
    ("ddp_amp", "check_user:nano", "check_user:pair_stream", ["--accum", "2", "--precision", "bf16"]),  # unsized
    ("fsdp", "check_user:nano", "check_user:pair_stream", []),
    ("fsdp", "check_user:bert", "check_user:classify", []),  # the root keeps parameters of its own
    ("fsdp", "check_user:gpt2", "check_user:lm_stream", ["--accum", "2", "--clip", "1.0"]),
]  # ddp with each model and data: tests/test_check.py, through the `check` command


@pytest.mark.parametrize("recipe,model,data,options", CASES, ids=[f"{c[0]}-{c[1][11:]}" for c in CASES])
def test_two_ranks_train_like_one_process(recipe, model, data, options, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{REPO / 'tests'}:{REPO}")  # the user's module, for every launched run
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    report = check_recipe(RECIPES[recipe], model=model, data=data, options=tuple(options), steps=3, batch_size=4)
    assert report.equivalent, report.text
