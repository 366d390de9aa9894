"""Golden losses (issue 27.5): each recipe's first steps on the built-in model and data, kept in tests/golden/.

A change of numbers, from a code change or a torch upgrade, shows as a failing test and then as a diff of the
files, as torchtitan's loss comparison and Megatron's golden values do. Each recipe runs its own train() with its
defaults (the built-in model and data: mlp on digits for the ddp family and dp, the GPT on text for the others)
for STEPS steps of its default batch on 2 gloo ranks (dp and pipeline_naive: their one process), and its training
records (loss, accuracy, gradient norm: already reduced over the ranks) are compared with the file's.

Exact (bit for bit) with the torch version the file records, on a CPU like the one that wrote the files; within
CPU_TOLERANCE (relative) on a CPU whose vector width makes torch and MKL choose other kernels (the files were written
where AVX2's were taken: on an AVX-512 Xeon the unchanged code of 832e575 misses them by 1 to 2 float32 ulp); within
TOLERANCE with another torch.
The file also records a digest of the training set: the built-in `text` is read from this Python's own
stdlib sources, which differ between Python releases, and a run on other data is another run (skipped, saying so).
To rewrite the files on purpose, after a change that is meant to change the numbers:

    TDR_GOLDEN=rewrite pytest tests/test_golden.py
"""

import hashlib
import importlib
import json
import os
import platform
from pathlib import Path

import pytest
import torch

from tools.registry import RECIPES
from world import GlooWorld

GOLDEN = Path(__file__).parent / "golden"
REWRITE = os.environ.get("TDR_GOLDEN") == "rewrite"
STEPS = 4
ONE_PROCESS = ("dp", "pipeline_naive")
KEYS = ("loss", "acc", "grad_norm")  # per training record
TOLERANCE = 1e-4  # relative, with another torch than the file's: kernels may add in another order
CPU_TOLERANCE = 1e-6  # relative, the same torch on another CPU: float32 sums rounded otherwise, a few ulp


@pytest.fixture(scope="module")
def worlds():
    with GlooWorld(2, timeout_s=180) as two, GlooWorld(1, timeout_s=180) as one:
        yield {2: two, 1: one}


def data_digest(spec: str) -> str:
    """sha256 of the training set's samples' bytes: which data the records are of (a map-style set, as built in)."""
    from helpers import build_data

    train_set = build_data(spec)[0]
    digest = hashlib.sha256(str(len(train_set)).encode())
    for i in range(len(train_set)):
        for tensor in train_set[i]:
            digest.update(torch.as_tensor(tensor).numpy().tobytes())
    return digest.hexdigest()


def first_steps(topo, recipe: str, out: str) -> dict:
    module = importlib.import_module(f"recipes.{recipe}")
    cfg = module.Config(out=out, epochs=1, max_steps=STEPS, log_every=1)  # the recipe's defaults otherwise
    summary = module.train(cfg, topo)
    lines = (Path(summary["weights"]).parent / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    return {
        "recipe": recipe,
        "model": cfg.model,
        "data": cfg.data,
        "world_size": topo.world_size,
        "batch_size": cfg.batch_size,
        "data_digest": data_digest(cfg.data),
        "python": platform.python_version(),
        "steps": [{"step": r["step"], **{k: r[k] for k in KEYS if k in r}} for r in records],
    }


@pytest.mark.world
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_first_losses_are_the_golden_ones(worlds, tmp_path, recipe):
    got = worlds[1 if recipe in ONE_PROCESS else 2].run(first_steps, recipe, str(tmp_path))[0]
    got["torch"] = torch.__version__.split("+")[0]
    path = GOLDEN / f"{recipe}.json"
    if REWRITE:
        path.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"rewrote {path}")
    want = json.loads(path.read_text())
    if got["data_digest"] != want["data_digest"]:
        pytest.skip(
            f"{recipe}: its built-in data ({got['data']}) differs here (Python {got['python']}; the file was written "
            f"with Python {want['python']}, whose stdlib sources the text corpus reads): other data, other losses"
        )
    same = ("torch", "python")  # compared below: another torch within TOLERANCE; the Python only through the data
    assert {k: v for k, v in got.items() if k not in (*same, "steps")} == {
        k: v for k, v in want.items() if k not in (*same, "steps")
    }, "another run than the golden file's: rewrite it (TDR_GOLDEN=rewrite)"
    assert [s["step"] for s in got["steps"]] == [s["step"] for s in want["steps"]] == list(range(1, STEPS + 1))
    if got["torch"] == want["torch"] and got["steps"] != want["steps"]:  # the pinned torch on another CPU?
        # Bit for bit on a CPU like the one that wrote the files; torch and MKL pick their kernels by the CPU's vector
        # width (AVX2, AVX-512), and another one adds float32 sums in another order: the same run to CPU_TOLERANCE.
        for g, w in zip(got["steps"], want["steps"]):
            assert g == pytest.approx(w, rel=CPU_TOLERANCE), f"{recipe}: the first losses changed; if meant, rewrite"
    else:
        for g, w in zip(got["steps"], want["steps"]):
            assert g == pytest.approx(w, rel=TOLERANCE), f"torch {got['torch']} against the file's {want['torch']}"
