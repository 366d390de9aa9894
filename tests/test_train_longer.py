"""Issue 36.1, train longer: a finished run resumed with a larger --max-steps or --epochs goes on from its last state.

Each behaviour end to end, on one process (tests/cli_cases.py: several `python -m recipes` in one interpreter) unless
it needs ranks: the final checkpoint and --keep; the cosine recomputed over the new total (logged rates against the
formula) while a run that is not extended keeps its rates (tests/golden, tests/test_right.py); the records (an
`extend` record, both summaries, readers take the last); interruptions (bit for bit); only finished runs extend;
the pre-check agrees; the other recipes (fsdp with its sharded checkpoints) and the standalone copy do it too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.kernel.job import RecipeError
from helpers import REPO, in_one_interpreter, run, torchrun, unfinished, user_env
from tools.check import run_summary
from tools.precheck import precheck
from tools.registry import RECIPES

PATHS = os.pathsep.join([str(REPO), str(REPO / "tests")])  # this checkout's core/, and tests/tiny.py
ENV = user_env(PYTHONPATH=PATHS)
TINY = ["--model", "tiny:mlp", "--log-every", "1"]
LR = 1e-3  # the default --lr


def _cases(*runs: tuple[str, list[str]], recipe: str = "ddp") -> list:
    """Each (folder, args) as `python -m recipes run RECIPE ARGS` in that folder, one after another."""
    cases = [{"args": ["run", recipe, *args], "cwd": str(cwd)} for cwd, args in runs]
    return in_one_interpreter(cases, env=ENV, timeout=400)


def _ok(proc) -> str:
    assert proc.returncode == 0, f"--stdout--\n{proc.stdout}\n--stderr--\n{proc.stderr}"
    return proc.stdout


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _ckpts(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "ckpt").iterdir())


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def _same_tensors(a: Path, b: Path) -> bool:
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _cosine(step: int, total: int) -> float:
    return LR * (1 + math.cos(math.pi * step / total)) / 2  # eta_min 0


def _copy(run_dir: Path, to: Path) -> Path:
    """A copy of a run's output folder (OUT/ddp-1 under `to`), to extend or resume without touching the original."""
    return Path(shutil.copytree(run_dir, to / run_dir.name))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A ddp run of 6 steps, no checkpoint during training (--ckpt-every 0), one train record a step."""
    out = tmp_path_factory.mktemp("finished")
    _ok(_cases((out, [*TINY, "--max-steps", "6", "--ckpt-every", "0", "--out", str(out)]))[0])
    return out / "ddp-1"


@pytest.fixture(scope="module")
def extended(finished, tmp_path_factory) -> dict[str, Path]:
    """Three copies of the finished run extended to 10 steps: `auto` (--resume auto, --keep 1), `path` (--resume of
    its checkpoint) and `every2` (--ckpt-every 2 --keep 10, for the interruptions)."""
    base = tmp_path_factory.mktemp("extended")
    runs = {name: _copy(finished, base / name) for name in ("auto", "path", "every2")}
    ckpt = str(runs["path"] / "ckpt" / "step-000006.safetensors")
    longer = [*TINY, "--max-steps", "10"]
    procs = _cases(
        (base, [*longer, "--ckpt-every", "0", "--keep", "1", "--resume", "auto", "--out", str(runs["auto"].parent)]),
        (base, [*longer, "--ckpt-every", "0", "--resume", ckpt, "--out", str(runs["path"].parent)]),
        (base, [*longer, "--ckpt-every", "2", "--keep", "10", "--resume", "auto", "--out", str(runs["every2"].parent)]),
    )
    for proc in procs:
        _ok(proc)
    return runs


# 1. A final checkpoint, --keep honoured; --ckpt-every 0 still writes none during training.


def test_every_run_ends_with_a_checkpoint_at_its_last_step(finished, tmp_path):
    assert _ckpts(finished) == ["step-000006.safetensors"]  # --ckpt-every 0: the end's alone
    procs = _cases(
        (tmp_path, [*TINY, "--max-steps", "7", "--ckpt-every", "3", "--keep", "2", "--out", str(tmp_path / "a")]),
        (tmp_path, [*TINY, "--max-steps", "6", "--ckpt-every", "3", "--keep", "5", "--out", str(tmp_path / "b")]),
    )
    for proc in procs:
        _ok(proc)
    assert _ckpts(tmp_path / "a" / "ddp-1") == ["step-000006.safetensors", "step-000007.safetensors"]  # --keep 2
    assert _ckpts(tmp_path / "b" / "ddp-1") == ["step-000003.safetensors", "step-000006.safetensors"]  # once at 6


# 2. It continues from its last state, on the cosine recomputed over the new total.


def test_a_finished_run_trains_longer_from_its_last_state(finished, extended):
    run_dir = extended["auto"]
    records = _records(run_dir)
    kinds = [r["kind"] for r in records]
    first = kinds.index("summary")
    assert kinds[first + 1 : first + 3] == ["resume", "extend"]
    resume, extend = records[first + 1], records[first + 2]
    assert resume["checkpoint"].endswith("ddp-1/ckpt/step-000006.safetensors") and resume["step"] == 6
    assert resume["samples"] == 6 * 32  # the data position: the 6 batches trained, skipped on resume
    assert extend == {"kind": "extend", "step": 6, "old_total": 6, "new_total": 10}
    assert [r["step"] for r in records[first:] if r["kind"] == "train"] == [7, 8, 9, 10]
    # the optimizer went on (AdamW's step count is 10, not the 4 a fresh one would have)
    final = load_file(str(run_dir / "ckpt" / "step-000010.safetensors"))
    assert float(final["optim/0/step"]) == 10.0
    assert _ckpts(run_dir) == ["step-000010.safetensors"]  # --keep 1
    # the final weights are written again, and they changed
    assert not _same_tensors(run_dir / "model.safetensors", finished / "model.safetensors")
    weights = load_file(str(run_dir / "model.safetensors"))
    assert all(torch.equal(weights[k], final[f"model/{k}"]) for k in weights)  # the end's state, both


def test_the_logged_lr_follows_the_cosine_over_the_new_total(finished, extended):
    old = {r["step"]: r["lr"] for r in _records(finished) if r["kind"] == "train"}
    assert old == pytest.approx({s: _cosine(s, 6) for s in range(1, 7)}, rel=1e-9, abs=1e-15)
    new = {r["step"]: r["lr"] for r in _records(extended["auto"])[len(old) + 2 :] if r["kind"] == "train"}
    assert new == pytest.approx({s: _cosine(s, 10) for s in range(7, 11)}, rel=1e-9, abs=1e-15)
    assert new[7] > 0.2 * LR  # not 0 (a new T_max alone), not the old cosine climbing back (lr(7/6) = lr(5/6))
    assert new[7] != pytest.approx(_cosine(5, 6), rel=1e-3)


# 3. The records: an extend record, both summaries; readers take the last.


def test_the_records_keep_both_summaries_and_readers_take_the_last(extended, tmp_path):
    summaries = [r for r in _records(extended["auto"]) if r["kind"] == "summary"]
    assert [s["steps"] for s in summaries] == [6, 10]
    assert run_summary(extended["auto"].parent)["steps"] == 10  # tools/check.py
    before = _digest(extended["auto"])
    (again,) = _cases(
        (tmp_path, [*TINY, "--max-steps", "10", "--resume", "auto", "--out", str(extended["auto"].parent)])
    )
    assert "already finished at step 10; nothing to train" in _ok(again)
    assert _digest(extended["auto"]) == before


# 4. Interruptions: an interrupted extension resumes bit for bit; two extensions of copies end bit for bit equal.


def test_two_extensions_of_copies_of_one_finished_run_end_bit_for_bit_equal(extended):
    auto, path = extended["auto"], extended["path"]
    assert (auto / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    assert _same_tensors(auto / "ckpt" / "step-000010.safetensors", path / "ckpt" / "step-000010.safetensors")


def test_an_interrupted_extension_resumes_bit_for_bit(extended, tmp_path):
    whole = extended["every2"]
    assert _ckpts(whole) == [f"step-{s:06d}.safetensors" for s in (6, 8, 10)]
    # stopped after step 8's checkpoint, and stopped before its first one (only the finished run's, step 6)
    at8 = unfinished(_copy(whole, tmp_path / "at8"))
    (at8 / "ckpt" / "step-000010.safetensors").unlink()
    at6 = unfinished(_copy(whole, tmp_path / "at6"))
    for name in ("step-000008.safetensors", "step-000010.safetensors"):
        (at6 / "ckpt" / name).unlink()
    longer = [*TINY, "--max-steps", "10", "--ckpt-every", "2", "--keep", "10", "--resume", "auto"]
    for proc in _cases(
        (tmp_path, [*longer, "--out", str(at8.parent)]), (tmp_path, [*longer, "--out", str(at6.parent)])
    ):
        _ok(proc)
    for stopped in (at8, at6):
        assert (stopped / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
        assert _same_tensors(stopped / "ckpt" / "step-000010.safetensors", whole / "ckpt" / "step-000010.safetensors")
    assert [r["step"] for r in _records(at8) if r["kind"] == "resume"][-1] == 8


def test_two_ranks_extend_across_an_epoch_bit_for_bit(tmp_path):
    """Every rank's generator and the data position across an epoch's end (22 steps an epoch at 2 ranks): an
    extension from 20 to 26 steps, whole and stopped at step 24, ends with the same weights."""
    out = tmp_path / "whole"
    common = ["--model", "tiny:mlp", "--ckpt-every", "4", "--keep", "10", "--out", str(out)]
    command = [*torchrun("-m", "recipes", "run", "ddp"), *common]
    run([*command, "--max-steps", "20"], cwd=tmp_path, env=ENV, timeout=300)
    run([*command, "--max-steps", "26", "--resume", "auto"], cwd=tmp_path, env=ENV, timeout=300)
    whole = out / "ddp-1"
    assert [r["steps"] for r in _records(whole) if r["kind"] == "summary"] == [20, 26]
    stopped = unfinished(_copy(whole, tmp_path / "stopped"))
    (stopped / "ckpt" / "step-000026.safetensors").unlink()
    resumed = [*torchrun("-m", "recipes", "run", "ddp"), *common[:-1], str(stopped.parent)]
    run([*resumed, "--max-steps", "26", "--resume", "auto"], cwd=tmp_path, env=ENV, timeout=300)
    assert (stopped / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    assert _same_tensors(stopped / "ckpt" / "step-000026.safetensors", whole / "ckpt" / "step-000026.safetensors")


# 5. Only finished runs extend; any other change is refused; the pre-check agrees.


def test_only_a_finished_run_extends_and_nothing_else_changes(finished, tmp_path):
    done = _copy(finished, tmp_path / "done")
    stopped = unfinished(_copy(finished, tmp_path / "stopped"))  # as if killed before its summary...
    shutil.copy(stopped / "ckpt" / "step-000006.safetensors", stopped / "ckpt" / "step-000004.safetensors")
    (stopped / "ckpt" / "step-000006.safetensors").unlink()  # ...at a checkpoint before its end (a stand-in)
    _fake_step(stopped / "ckpt" / "step-000004.safetensors")
    before = {path: _digest(path) for path in (done, stopped)}
    procs = _cases(
        (tmp_path, [*TINY, "--max-steps", "6", "--lr", "0.1", "--resume", "auto", "--out", str(done.parent)]),
        (tmp_path, [*TINY, "--max-steps", "10", "--lr", "0.1", "--resume", "auto", "--out", str(done.parent)]),
        (tmp_path, [*TINY, "--max-steps", "4", "--resume", "auto", "--out", str(done.parent)]),
        (tmp_path, [*TINY, "--max-steps", "10", "--resume", "auto", "--out", str(stopped.parent)]),
    )
    assert "already finished at step 6; nothing to train" in _ok(procs[0])  # as today, whatever else it is given
    for proc, changed in zip(procs[1:], ["--lr 0.001 -> 0.1", "--max-steps 6 -> 4", "--max-steps 6 -> 10"]):
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 1 and last.startswith("error: ") and changed in last, proc.stderr
        assert "Traceback" not in proc.stderr
    assert {path: _digest(path) for path in (done, stopped)} == before


def _fake_step(path: Path) -> None:
    """Rewrite a checkpoint's header as if it were saved at step 4 of its 6 (its scheduler not at its end)."""
    from core.kernel.store import read_checkpoint, write_tensors

    tensors, meta = read_checkpoint(path)
    scheduler = json.loads(meta["scheduler"]) | {"last_epoch": 4, "_step_count": 5}
    progress = json.loads(meta["progress"]) | {"step": 4, "samples": 4 * 32}
    meta = {k: v for k, v in meta.items() if k not in ("checksums", "header_checksum")}
    write_tensors(path, tensors, meta | {"scheduler": json.dumps(scheduler), "progress": json.dumps(progress)})


def _precheck(**options) -> list[str]:
    recipe = RECIPES["ddp"]
    module = recipe.load()
    return precheck(recipe, module, module.Config(model="tiny:mlp", resume="auto", **options), world_size=1)


def test_the_pre_check_agrees(finished, tmp_path):
    out = str(_copy(finished, tmp_path).parent)
    sys.path.insert(0, str(REPO / "tests"))  # tests/tiny.py, as the runs find it
    assert _precheck(out=out, max_steps=6, lr=0.1) == []  # finished with these lengths: nothing to train
    assert _precheck(out=out, max_steps=10) == []  # trains longer: the checks of a resume pass
    for options, changed in (({"max_steps": 10, "lr": 0.1}, "--lr 0.001 -> 0.1"), ({"max_steps": 4}, "-> 4")):
        with pytest.raises(RecipeError) as refused:
            _precheck(out=out, **options)
        assert changed in str(refused.value)


# 6. The other recipes (fsdp: sharded checkpoints), and the standalone copy.


OTHERS = ["dp", "ddp_amp", "fsdp"]
HF_EXAMPLE = ["--model", "tiny_gpt2:model", "--data", "tiny_gpt2:data", "--batch-size", "8"]  # docs/examples/


@pytest.fixture(scope="module")
def others_extended(tmp_path_factory) -> dict[str, Path]:
    """Each of the other recipes, and ddp on a transformers model, run to 3 (2) steps and resumed to 5 (4): the first
    runs in one interpreter (tests/cli_cases.py), the resumes in another: {recipe or "hf": its out folder}."""
    outs = {name: tmp_path_factory.mktemp(name) for name in [*OTHERS, "hf"]}
    first, then = [], []  # a run holds its folder's lock until its process ends: the resumes run in a second one
    for recipe in OTHERS:
        model = [] if recipe == "fsdp" else ["--model", "tiny:mlp"]  # fsdp: its default, a small transformer
        args = ["run", recipe, *model, "--lr", str(LR), "--log-every", "1", "--ckpt-every", "0", "--out"]
        first.append({"args": [*args, str(outs[recipe]), "--max-steps", "3"], "cwd": str(outs[recipe])})
        then.append(
            {"args": [*args, str(outs[recipe]), "--max-steps", "5", "--resume", "auto"], "cwd": str(outs[recipe])}
        )
    hf = {"args": ["run", "ddp", *HF_EXAMPLE, "--out", str(outs["hf"])], "cwd": str(outs["hf"])}
    first.append(hf | {"args": [*hf["args"], "--max-steps", "2"]})
    then.append(hf | {"args": [*hf["args"], "--max-steps", "4", "--resume", "auto"]})
    env = user_env(PYTHONPATH=os.pathsep.join([str(REPO / "docs" / "examples"), PATHS]))
    for cases in (first, then):
        for proc in in_one_interpreter(cases, env=env, timeout=400):
            _ok(proc)
    return outs


@pytest.mark.parametrize("recipe", OTHERS)
def test_the_other_recipes_train_longer(recipe, others_extended):
    out = others_extended[recipe]
    records = _records(out / f"{recipe}-1")
    assert [r["steps"] for r in records if r["kind"] == "summary"] == [3, 5]
    assert {"kind": "extend", "step": 3, "old_total": 3, "new_total": 5} in records
    lrs = {r["step"]: r["lr"] for r in records if r["kind"] == "train"}
    assert lrs == pytest.approx({s: _cosine(s, 3 if s <= 3 else 5) for s in range(1, 6)}, rel=1e-9, abs=1e-15)
    saved = sorted({p.name.split(".")[0] for p in (out / f"{recipe}-1" / "ckpt").iterdir()})  # a file, a folder
    assert saved == ["step-000003", "step-000005"]


def test_the_standalone_copy_trains_longer_with_the_longer_plug_in_and_stays_finished_without(tmp_path):
    copies = {"": tmp_path / "lean.py", "longer": tmp_path / "longer.py"}
    for plugins, copy in copies.items():
        asked = ["--with", plugins] if plugins else []
        run([sys.executable, "-m", "recipes", "cp", "ddp", str(copy), "--standalone", *asked], cwd=REPO, env=ENV)
    cases = []
    for plugins, copy in copies.items():
        out = tmp_path / (plugins or "lean")
        for steps, resume in (("3", []), ("5", ["--resume", "auto"])):
            args = ["--max-steps", steps, "--ckpt-every", "0", "--out", str(out), *resume]
            cases.append({"args": args, "cwd": str(tmp_path), "file": str(copy)})
    procs = in_one_interpreter(cases, env=user_env(), timeout=300)
    for proc in procs:
        _ok(proc)
    records = _records(tmp_path / "longer" / "ddp-1")
    assert [r["steps"] for r in records if r["kind"] == "summary"] == [3, 5]
    assert {"kind": "extend", "step": 3, "old_total": 3, "new_total": 5} in records
    lean = _records(tmp_path / "lean" / "ddp-1")  # without it: finished, nothing trained, nothing written
    assert [r["steps"] for r in lean if r["kind"] == "summary"] == [3] and "already finished" in procs[1].stdout
    assert "nothing to train (more --epochs or --max-steps in a copy made --with longer train it on)" in procs[1].stdout


def test_the_final_weights_and_hf_are_written_again_at_the_new_end(others_extended):
    """A transformers model (docs/examples/tiny_gpt2.py): hf/ holds the extended run's weights."""
    from transformers import AutoModelForCausalLM

    run_dir = others_extended["hf"] / "ddp-1"
    assert [r["steps"] for r in _records(run_dir) if r["kind"] == "summary"] == [2, 4]
    saved = load_file(str(run_dir / "model.safetensors"))
    final = load_file(str(run_dir / "ckpt" / "step-000004.safetensors"))
    assert all(torch.equal(saved[k], final[f"model/{k}"]) for k in saved)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)
