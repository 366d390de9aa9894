"""Where users already work (issue 21), end to end through `python -m recipes run`: a new run from a run's Hugging
Face folder (--init-from), the folder loaded back with from_pretrained, TensorBoard and W&B (offline) logs that go
on across a resume, and weights that do not fit refused before anything starts. The example of docs/fine-tuning.md
(and the README's) is this one."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, in_one_interpreter, recipes_cli, unfinished, user_env

pytestmark = pytest.mark.e2e
EXAMPLE = ["--model", "tiny_gpt2:model", "--data", "tiny_gpt2:data", "--batch-size", "8", "--log-every", "2"]


def _env(**extra):
    paths = [str(REPO / "docs" / "examples"), str(REPO), str(REPO / "tests")]
    return user_env(PYTHONPATH=os.pathsep.join(paths), WANDB_MODE="offline", WANDB_SILENT="true", **extra)


def _run(cwd, *args, check=True):
    return recipes_cli("run", "ddp_amp", *EXAMPLE, *args, cwd=cwd, env=_env(), check=check, timeout=240)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A transformers GPT-2 trained a few steps: its run folder holds model.safetensors and hf/."""
    cwd = tmp_path_factory.mktemp("pretrain")
    _run(cwd, "--max-steps", "6", "--precision", "bf16")
    return cwd / "runs" / "ddp_amp-1"


def test_the_hf_folder_loads_with_from_pretrained_to_the_trained_weights(pretrained):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pretrained / "hf")
    saved = load_file(pretrained / "model.safetensors")
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied weights stay tied


@pytest.fixture(scope="module")
def from_pretrained(pretrained, tmp_path_factory) -> dict[str, tuple]:
    """Two runs that start from the pretrained run's hf/ folder, each in a folder of its own, one after the other in
    one interpreter (tests/cli_cases.py): the example's model with --epochs 0, and the built-in MLP that it does not
    fit: {case: (what it returned, its folder)}."""
    folders = {key: tmp_path_factory.mktemp(key) for key in ("starts", "does-not-fit")}
    init = ["--init-from", str(pretrained / "hf")]
    args = {
        "starts": ["run", "ddp_amp", *EXAMPLE, *init, "--epochs", "0"],
        "does-not-fit": ["run", "ddp_amp", "--model", "mlp", *init],
    }
    cases = [{"args": [*args[k], "--out", str(f / "runs")], "cwd": str(f)} for k, f in folders.items()]
    said = in_one_interpreter(cases, env=_env())
    return {key: (proc, folders[key]) for key, proc in zip(folders, said, strict=True)}


def test_a_new_run_starts_from_the_weights_and_records_where_they_came_from(pretrained, from_pretrained):
    """--epochs 0 trains nothing: the weights it writes are the ones it started from, bit for bit."""
    proc, folder = from_pretrained["starts"]
    assert proc.returncode == 0, proc.stderr
    run_dir = folder / "runs" / "ddp_amp-1"
    started, loaded = load_file(run_dir / "model.safetensors"), load_file(pretrained / "model.safetensors")
    assert started.keys() == loaded.keys() and all(torch.equal(started[k], loaded[k]) for k in loaded)
    assert json.loads((run_dir / "config.json").read_text())["init_from"] == str(pretrained / "hf")
    assert _records(run_dir)[-1]["init_from"] == str(pretrained / "hf") and "init_from=" in proc.stdout


def test_weights_that_do_not_fit_are_one_line_before_anything_starts(pretrained, from_pretrained):
    proc, folder = from_pretrained["does-not-fit"]
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert last.startswith(f"error: --init-from {pretrained / 'hf'} holds another model (missing keys: blocks.")
    assert not (folder / "runs").exists()


def test_tensorboard_and_wandb_continue_across_a_resume(pretrained, tmp_path):
    """A run logged to both, then resumed from its step-4 checkpoint into the same folder: one W&B run id for
    both jobs, and TensorBoard's curve has every step once (the resumed job's steps 5..8 replace the first's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["--max-steps", "8", "--ckpt-every", "4", "--log-to", "tensorboard,wandb", "--init-from", str(pretrained)]
    _run(tmp_path, *args)
    run_dir = tmp_path / "runs" / "ddp_amp-1"
    first_id = json.loads((run_dir / "wandb-run.json").read_text())["wandb_run_id"]
    unfinished(run_dir)  # as if the job had died after step 4: a finished run, resumed, trains nothing
    _run(tmp_path, *args, "--resume", str(run_dir / "ckpt" / "step-000004.safetensors"))
    assert json.loads((run_dir / "wandb-run.json").read_text())["wandb_run_id"] == first_id
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(p.name.endswith(first_id) for p in offline), offline
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8]
    assert [r["kind"] for r in _records(run_dir)].count("resume") == 1


def test_a_tracker_that_is_not_installed_is_one_line_before_launch(tmp_path):
    """The package named by --log-to is looked for when the options are read: nothing starts without it."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")  # as if not installed
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env["PYTHONPATH"]])
    proc = recipes_cli(
        "run", "ddp_amp", "--log-to", "wandb", "--out", str(tmp_path / "runs"), cwd=tmp_path, env=env, check=False
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "pip install -e '.[wandb]'" in proc.stderr.strip().splitlines()[-1] and not (tmp_path / "runs").exists()
