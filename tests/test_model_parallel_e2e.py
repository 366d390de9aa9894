"""Layer 3: a model-parallel recipe as a user runs it, through launch_single_node.sh on 2 CPU processes (the
pre-check, torchrun, the loopback store, main): the loss falls, and rank 0's model.safetensors loads into the
plain GPT. One launch: what it proves is the same for every recipe, whose train() the world tests run
(tests/test_model_parallel.py), main() in one process too (tests/test_options.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from core.gpt import gpt
from helpers import REPO, run, user_env


@pytest.mark.e2e
@pytest.mark.parametrize(
    "recipe, options",
    [("fsdp", ["--ckpt-every", "20"])],
)
def test_recipe_trains_the_gpt_on_two_processes(tmp_path, recipe, options):
    proc = run(
        [
            str(REPO / "launch_single_node.sh"),
            recipe,
            *options,
            "--max-steps",
            "25",
            "--log-every",
            "5",
            "--out",
            str(tmp_path),
        ],
        env=user_env(NPROC_PER_NODE="2"),
        timeout=240,
    )
    assert "summary " in proc.stdout
    (run_dir,) = tmp_path.iterdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.5, losses  # from ~4.8 (chance) down
    assert json.loads((run_dir / "config.json").read_text())["world_size"] == 2
    saved = sorted({p.name.removesuffix(".safetensors") for p in (run_dir / "ckpt").iterdir()})  # folder and file
    assert saved == ["step-000020", "step-000025"]  # every rank's shard, and the seal; the last step's (issue 36)
    assert len(list((run_dir / "ckpt" / "step-000020").glob("shard-*.safetensors"))) == 2
    model = gpt()
    model.load_state_dict(load_file(run_dir / "model.safetensors"))  # strict: every key, every shape
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.int64))).all()
