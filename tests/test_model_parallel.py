"""Layer 2: pipeline, tensor parallel, FSDP and FSDP x TP on 2 gloo ranks give the parameters one
process gets training the tiny GPT on the same global batches, and resume bitwise.

Each recipe test runs the recipe's own train() (data loading, schedule, optimizer, LR schedule, the run folder,
sharded checkpoints, the gathered safetensors file) and compares the file rank 0 wrote with plain
single-process training. Tolerance: atol 5e-5, rtol 1e-4 after 3 AdamW steps at lr 1e-3. The parallel runs
add the same numbers in another order (micro-batch sums, sharded matmuls, reduce-scatter), and Adam's step
divides by sqrt(v), which magnifies such float32 rounding for near-zero gradients (attention key biases, which
softmax ignores: 2.5e-5 after 3 steps on torch 2.13); a real mistake (a missing 1/M scale, a lost shard, a wrong
micro-batch) is off by 1e-3 or more.
"""

import dataclasses
import importlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core import accum, amp, grads
from core.exact_loss import count_targets, forward_exact, make_exact_loss
from core.kernel.job import RecipeError
from core.kernel.loss import Loss
from core.mesh import build_mesh
from core.shard import fsdp_sync
from helpers import build_data, build_model, unfinished
from mp_reference import apply_fsdp, assert_same_weights, config, full_state_dict, reference, run_recipe, run_recipe_rng

TOL = dict(atol=5e-5, rtol=1e-4)
BF16_TOL = dict(atol=1e-2, rtol=1e-1)  # bf16 rounding of activations and weights in forward, 3 steps


@pytest.fixture(scope="module")
def one_share():
    """Reference for the recipes whose ranks share one batch (pipeline, tensor parallel, dp=1)."""
    return reference(config("fsdp"), replicas=1)


@pytest.mark.world
def test_pipeline_evaluates_every_validation_sample_once(world2, tmp_path):
    """27.3: 37 validation windows in groups of 16 (--accum 2 x 8): the smaller last group (5, its second
    micro-batch all padding) is evaluated, not dropped. val_loss and val_acc equal a plain evaluation, written here in
    plain torch, of the final weights over every sample: loss within rel 1e-5 (float32 sums in another order; the 32
    samples of the whole groups alone are 8e-4 away), accuracy within one target of 37 x 64."""
    cfg = config("pipeline", out=str(tmp_path), data="mp_reference:odd_text", accum=2, microbatches=2, max_steps=1)
    summary = world2.run(run_recipe, "pipeline", cfg)[0]
    model = build_model("gpt")
    model.load_state_dict(load_file(summary["weights"]))
    _, val, _ = build_data(cfg.data)
    inputs, targets = (torch.stack(column) for column in zip(*[val[i] for i in range(len(val))]))
    with torch.no_grad():
        logits = model.eval()(inputs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    assert summary["val_loss"] == pytest.approx(loss.item() / targets.numel(), rel=1e-5)
    assert summary["val_acc"] == pytest.approx(logits.argmax(-1).eq(targets).double().mean().item(), abs=1.01 / 2368)


@pytest.mark.world
@pytest.mark.parametrize("schedule, microbatches", [("1f1b", 4), ("gpipe", 2), ("interleaved1f1b", 4)])
def test_pipeline_equals_single_process(world2, one_share, tmp_path, schedule, microbatches):
    cfg = config("pipeline", out=str(tmp_path), schedule=schedule, microbatches=microbatches, pp=2)
    summaries = world2.run(run_recipe, "pipeline", cfg)
    assert summaries[0]["pp"] == 2 and summaries[0]["steps"] == 3
    assert_same_weights(summaries[0], one_share, **TOL)


@pytest.mark.world
def test_pipeline_weighs_padded_targets_exactly_and_drops_a_smaller_last_batch(world2, tmp_path):
    """Targets -100 on padded tails (a micro-batch may count none): the step is one process's on the whole batch and
    the losses are finite; a training set of 5 batches and 3 samples (the README's 1f1b example ends so on `text`)
    trains its 5 whole batches, the schedule needing equal micro-batches."""
    cfg = config("pipeline", out=str(tmp_path), data="mp_reference:padded_text", max_steps=0, microbatches=4, pp=2)
    summaries = world2.run(run_recipe, "pipeline", cfg)
    assert summaries[0]["steps"] == 5 and summaries[0]["train_loss"] == summaries[1]["train_loss"]
    assert math.isfinite(summaries[0]["train_loss"]) and math.isfinite(summaries[0]["val_loss"])
    assert_same_weights(summaries[0], reference(dataclasses.replace(cfg, max_steps=5), replicas=1), **TOL)


@pytest.mark.world
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_equals_single_process(world2, one_share, tmp_path, sequence_parallel):
    """Also issue 20.7: the two ranks are one tensor-parallel group (dp rank 0): they end on one generator state."""
    cfg = config("tensor_parallel", out=str(tmp_path), sequence_parallel=sequence_parallel)
    (summary, first), (_, second) = world2.run(run_recipe_rng, "tensor_parallel", cfg)
    assert first == second
    assert_same_weights(summary, one_share, **TOL)


@pytest.mark.world
def test_tensor_parallel_splits_a_llama_by_its_own_plan_like_one_process(world2, tmp_path):
    """Issue 21.4: a transformers Llama (tiny config, no download) declares its plan; 2 ranks split it by that plan
    (embedding, q/k/v/o, gate/up/down, lm_head) and train as one process does, its own loss included."""
    cfg = config("tensor_parallel", out=str(tmp_path), model="mp_reference:tiny_llama")
    summaries = world2.run(run_recipe, "tensor_parallel", cfg)
    assert summaries[0]["tp"] == 2 and summaries[0]["train_loss"] == summaries[1]["train_loss"]
    assert_same_weights(summaries[0], reference(cfg, replicas=1), **TOL)


@pytest.mark.world
def test_fsdp_equals_single_process(world2, tmp_path):
    """Also issue 20.7: after the build each rank reseeds with seed + rank: they end on different generator states."""
    cfg = config("fsdp", out=str(tmp_path))
    (summary, first), (_, second) = world2.run(run_recipe_rng, "fsdp", cfg)
    assert summary["global_batch"] == 2 * cfg.batch_size and summary["replicas_identical"] and first != second
    assert_same_weights(summary, reference(cfg, replicas=2), **TOL)


@pytest.mark.world
@pytest.mark.parametrize("precision, tol", [("fp32", TOL), ("bf16", BF16_TOL)])
def test_fsdp_accumulation_clip_and_precision_equal_single_process(world2, tmp_path, precision, tol):
    """The recipe's whole step: K=2 micro-batches a rank, a clip that bites, bf16 by MixedPrecisionPolicy."""
    cfg = config("fsdp", out=str(tmp_path), accum=2, clip=0.05, precision=precision, batch_size=4)
    summaries = world2.run(run_recipe, "fsdp", cfg)
    assert summaries[0]["global_batch"] == 16 and max(_norms(summaries[0])) > cfg.clip  # the clip bites
    assert_same_weights(summaries[0], reference(cfg, replicas=2), **tol)


@pytest.mark.world
def test_fsdp_tp_on_two_ranks_equals_single_process(world2, one_share, tmp_path):
    """tp=2 x dp=1: the 2-D code path (two meshes, DTensor shards wrapped by fully_shard)."""
    summaries = world2.run(run_recipe, "fsdp_tp", config("fsdp_tp", out=str(tmp_path), tp=2))
    assert_same_weights(summaries[0], one_share, **TOL)


@pytest.mark.world
def test_ranks_agree_on_the_reported_loss(world2, tmp_path):
    """The loss comes from the last stage, reduced over ranks: both ranks return the same summary."""
    cfg = config("pipeline", out=str(tmp_path), max_steps=2, microbatches=2, pp=2, balance="time")
    first, second = world2.run(run_recipe, "pipeline", cfg)
    assert first["train_loss"] == second["train_loss"] and first["val_loss"] == second["val_loss"]


def _norms(summary) -> list[float]:
    return [r["grad_norm"] for r in _records(summary) if r["kind"] == "train"]


def _records(summary) -> list[dict]:
    return [json.loads(line) for line in (Path(summary["weights"]).parent / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.world
def test_fsdp_evaluates_unequal_shares_without_hanging(world2, tmp_path):
    """359 validation samples in batches of 1: rank 0 has 180 forwards, rank 1 179, each one a collective. The
    shorter rank repeats its last batch uncounted, so the job ends and val_loss is the whole set's, counted once."""
    cfg = config("fsdp", out=str(tmp_path), model="mlp", data="digits", batch_size=1, max_steps=1)
    summary = world2.run(run_recipe, "fsdp", cfg)[0]
    model = build_model("mlp")
    model.load_state_dict(load_file(summary["weights"]))
    val = torch.utils.data.DataLoader(build_data("digits")[1], batch_size=64)
    with torch.no_grad():  # by hand: the whole set's mean cross-entropy and accuracy, each sample once
        logits, targets = map(torch.cat, zip(*((model(x), y) for x, y in val)))
    expected = {"val_loss": torch.nn.functional.cross_entropy(logits, targets).item()}
    expected["val_acc"] = logits.argmax(-1).eq(targets).double().mean().item()
    assert summary["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    assert summary["val_acc"] == pytest.approx(expected["val_acc"])


# --- issue 20.6: buffers compared across ranks (20.7, each data-parallel rank's own stream: above) ---------------


@pytest.mark.world
def test_fsdp_names_the_buffers_that_differ_across_ranks(world2, tmp_path):
    """A buffer forward updates from each rank's own data differs at the end: the summary names it."""
    cfg = config("fsdp", out=str(tmp_path), model="mp_reference:counting_mlp", data="digits", max_steps=2)
    summary = world2.run(run_recipe, "fsdp", cfg)[0]
    assert summary["replicas_identical"] is False and "inputs_seen" in summary["replicas_differ"]


# --- resume (issue 14.1, 14.2, 11.1): a run that stopped after a checkpoint continues to the same weights ------


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resumed(world, name: str, cfg, finished: dict, tmp_path, *, stop: int, monkeypatch=None, **changes) -> dict:
    """Copy the finished run's step-`stop` checkpoint into a fresh --out and continue it with --resume auto (after
    the launchers' pre-check, with `monkeypatch`)."""
    out = tmp_path / "resumed"
    source = finished["weights"].replace("model.safetensors", f"ckpt/step-{stop:06d}")
    shutil.copytree(source, out / f"{name}-1" / "ckpt" / f"step-{stop:06d}")
    resumed = dataclasses.replace(cfg, out=str(out), resume="auto", **changes)
    if monkeypatch is not None:
        with monkeypatch.context() as env:
            env.setenv("WORLD_SIZE", str(world.world_size))
            _check_resume(name, resumed)
    return world.run(run_recipe, name, resumed)[0]


RESUMABLE = {  # name: (options, changes that keep the global batch on one rank; None: not tried there)
    "fsdp": (dict(accum=2, clip=0.05, batch_size=4, model="mp_reference:dropout_gpt"), None),  # each rank's dropout
    "tensor_parallel": (dict(clip=0.05), {}),  # tp 2 -> 1: DCP reads each rank's new slices from the saved ones
    "pipeline": (dict(accum=2, clip=0.05, microbatches=2, pp=0), {}),  # pp 2 -> 1: the stages keep the model's names
    "fsdp_tp": (dict(tp=2, clip=0.05), dict(tp=1)),
}


def _check_resume(name: str, cfg) -> None:
    """What the launchers run before torchrun (WORLD_SIZE set, no process group) for a resume."""
    from tools.precheck import check_resume

    module, world_size = importlib.import_module(f"recipes.{name}"), int(os.environ.get("WORLD_SIZE", "1"))
    dp = module.mesh(cfg, world_size)["dp"]
    check_resume(name, cfg, build_model(cfg.model), world_size=world_size, dp=dp)


@pytest.mark.world
@pytest.mark.parametrize("name", list(RESUMABLE))
def test_resume_at_the_same_world_size_is_bitwise(world2, world1, tmp_path, monkeypatch, name):
    """The pre-check (WORLD_SIZE set, no process group) lets the same job resume; it ends bitwise where the run that
    never stopped did, and once finished it trains nothing more. 14.2: the checkpoint continues on one rank too, at
    the same global batch, resharded to that layout (within float rounding: sums in another order)."""
    options, on_one = RESUMABLE[name]
    cfg = config(name, out=str(tmp_path / "whole"), max_steps=4, ckpt_every=2, keep=5, **options)
    finished = world2.run(run_recipe, name, cfg)[0]
    weights = load_file(finished["weights"])
    resumed = _resumed(world2, name, cfg, finished, tmp_path / "two", stop=2, monkeypatch=monkeypatch)
    assert resumed["steps"] == 4 and _same(load_file(resumed["weights"]), weights)
    if on_one is not None:
        alone = _resumed(world1, name, cfg, finished, tmp_path / "one", stop=2, **on_one)
        assert alone["world_size"] == 1 and alone["global_batch"] == finished["global_batch"]
        assert_same_weights(alone, weights, **TOL)
    run_dir = Path(finished["weights"]).parent
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    again = world2.run(run_recipe, name, dataclasses.replace(cfg, resume="auto"))[0]  # 11.1: nothing past --max-steps
    assert again["already_finished"] and again["steps"] == 4
    # 27.2: any checkpoint of the finished run, at another world size (another global batch for fsdp): no check,
    # nothing trained, no byte changed; the launchers' pre-check lets it through too
    step2 = dataclasses.replace(cfg, resume=str(run_dir / "ckpt" / "step-000002"), batch_size=cfg.batch_size * 3)
    _check_resume(name, step2)
    assert world1.run(run_recipe, name, step2)[0]["already_finished"]
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


@pytest.mark.world
def test_fsdp_checkpoints_tied_weights_and_resumes_bitwise(world2, tmp_path):
    """Two modules share one weight (a tied lm_head): safetensors refuses shared memory, so the shard holds it once
    and loading fills both."""
    cfg = config("fsdp", out=str(tmp_path / "whole"), model="tiny:tied", data="digits", max_steps=2, ckpt_every=1)
    finished = world2.run(run_recipe, "fsdp", dataclasses.replace(cfg, keep=5))[0]
    resumed = _resumed(world2, "fsdp", cfg, finished, tmp_path, stop=1)
    assert resumed["steps"] == 2 and _same(load_file(resumed["weights"]), load_file(finished["weights"]))


@pytest.mark.world
def test_a_checkpoint_under_another_recipe_or_precision_is_refused_in_one_line(world2, tmp_path, monkeypatch):
    """14.7: the pre-check names both sides: an fsdp checkpoint under tensor_parallel, a bf16 one resumed in fp32."""
    cfg = config("fsdp", out=str(tmp_path), max_steps=2, ckpt_every=2, precision="bf16")
    path = unfinished(Path(world2.run(run_recipe, "fsdp", cfg)[0]["weights"]).parent) / "ckpt" / "step-000002"
    path = path.with_suffix(".safetensors")  # the kernel's file beside the shards' folder (core/shard_ckpt.py)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match="a checkpoint of recipe fsdp, and this run is tensor_parallel.*with fsdp"):
        _check_resume("tensor_parallel", config("tensor_parallel", out=str(tmp_path), resume=str(path)))
    with pytest.raises(RecipeError, match=r"other options \(--precision bf16 -> fp32\)"):
        _check_resume("fsdp", dataclasses.replace(cfg, resume=str(path), precision="fp32"))


def refused_resume(topo, name: str, cfg) -> str:
    try:
        run_recipe(topo, name, cfg)
    except RecipeError as err:
        return str(err)
    return "resumed"


@pytest.mark.world
def test_a_missing_shard_is_skipped_by_auto_and_named_for_a_path(world2, tmp_path, monkeypatch, capsys):
    """Issue 20.8: step 2 loses a shard file. --resume auto warns and continues from step 1, to the weights of the
    run that never stopped; --resume step-2 is one line naming the file, before launch and in the run itself."""
    from core.kernel.store import newest_good

    cfg = config("fsdp", out=str(tmp_path), max_steps=2, ckpt_every=1, keep=5)
    finished = world2.run(run_recipe, "fsdp", cfg)[0]
    run_dir = unfinished(Path(finished["weights"]).parent)  # as if the job had died: it resumes
    lost = sorted((run_dir / "ckpt" / "step-000002").glob("shard-*.safetensors"))[1]
    lost.unlink()
    explicit = dataclasses.replace(cfg, resume=str(run_dir / "ckpt" / "step-000002.safetensors"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match=f"shard file {lost.name} is missing") as refused:
        _check_resume("fsdp", explicit)
    assert "\n" not in str(refused.value)
    errors = world2.run(refused_resume, "fsdp", explicit)
    assert errors[0] == errors[1] and f"shard file {lost.name} is missing" in errors[0], errors
    assert newest_good(run_dir) == run_dir / "ckpt" / "step-000001.safetensors"
    warning = f"skipping {run_dir / 'ckpt' / 'step-000002.safetensors'}, damaged (shard file {lost.name} is missing)"
    assert warning in capsys.readouterr().err
    resumed = world2.run(run_recipe, "fsdp", dataclasses.replace(cfg, resume="auto"))[0]
    assert resumed["steps"] == 2 and _same(load_file(resumed["weights"]), load_file(finished["weights"]))
    assert [r["step"] for r in _records(resumed) if r["kind"] == "resume"] == [1]


@pytest.mark.world
def test_fsdp_resumes_from_two_ranks_on_one(world2, world1, tmp_path):
    """14.2: a 2-rank checkpoint continues on 1 rank at the same global batch (16 = 2 x 8 = 1 x 16)."""
    cfg = config("fsdp", out=str(tmp_path / "whole"), max_steps=4, ckpt_every=2, keep=5)
    finished = world2.run(run_recipe, "fsdp", cfg)[0]
    resumed = _resumed(world1, "fsdp", cfg, finished, tmp_path, stop=2, batch_size=16)
    assert resumed["steps"] == 4 and resumed["world_size"] == 1 and resumed["global_batch"] == 16
    assert_same_weights(resumed, load_file(finished["weights"]), **TOL)


# --- issue 21.1 and 21.3: --init-from into the plain model before sharding; a Hugging Face folder out ----------


@pytest.mark.world
def test_fsdp_starts_from_a_runs_weights_and_writes_a_folder_from_pretrained_loads(world2, tmp_path):
    """A tiny Llama under fsdp: the run's hf/ loads with from_pretrained to exactly its model.safetensors, and its
    TensorBoard logs hold the loss; a new run --init-from that file trains on 2 ranks as one process does from the
    same weights."""
    import transformers
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = config("fsdp", out=str(tmp_path / "a"), model="mp_reference:tiny_llama", max_steps=2, log_to="tensorboard")
    summary = world2.run(run_recipe, "fsdp", first)[0]
    run_dir = Path(summary["weights"]).parent
    loaded = transformers.LlamaForCausalLM.from_pretrained(run_dir / "hf")
    saved = load_file(summary["weights"])
    assert loaded.state_dict().keys() == saved.keys()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, saved[key]), key
    events = EventAccumulator(str(run_dir / "tensorboard"))
    assert [e.step for e in events.Reload().Scalars("train/loss")] == [1, 2]
    second = dataclasses.replace(first, out=str(tmp_path / "b"), init_from=summary["weights"], log_to="")
    again = world2.run(run_recipe, "fsdp", second)[0]
    assert again["init_from"] == summary["weights"]
    assert_same_weights(again, reference(second, replicas=2), **TOL)


# --- the full step (issue 14.4): accumulation, clipping and precision under fully_shard and pipelines -------
# Each is checked against core.accum.step_amp on one process over the same global batch, with clipping that
# bites (max norm 0.05, below the gradients' norm): a norm taken over one shard or stage would scale wrongly.

CLIP = 0.05


def _tiny_gpt():
    from core.gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab=40, context=16, dim=32, heads=2, layers=2)


def _split_tp(model, mesh):
    """The recipes' TP split (core/tp_plan.py) over a 1-D mesh, in place: the GPT's Megatron plan."""
    from torch.distributed.tensor.parallel import parallelize_module

    from core.tp_plan import plan_of

    parallelize_module(model, mesh, plan_of(model, tp=mesh.size()))  # plan_of refuses what tp cannot split
    return model


def _token_batches(steps: int = 2, size: int = 8, *, padded: bool = False):
    """padded: targets -100 on a tail of each row's own length, the rows 2..3 of every 4 wholly (a micro-batch of
    2 rows with no counted target), as padded sequences give: a mean per micro-batch would weigh them wrongly."""
    g = torch.Generator().manual_seed(3)
    batches = [(x, torch.roll(x, -1, 1)) for x in (torch.randint(0, 40, (size, 16), generator=g) for _ in range(steps))]
    if padded:
        for _, y in batches:
            for row in range(size):
                y[row, 2 + (3 * row) % 13 :] = -100  # a tail of the row's own length
                if row % 4 > 1:
                    y[row] = -100
    return batches


def _one_process(batches, *, k: int, precision: str = "fp32", losses: bool = False):
    """step_amp on the whole global batch, cut into k micro-batches: (weights, norms[, each step's mean loss])."""
    model = _tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = make_exact_loss(Loss(), model=model)
    norms, means = [], []
    for x, y in batches:
        micro = list(zip(x.chunk(k), y.chunk(k)))
        sums, stats = accum.step_amp(model, micro, optimizer=optimizer, loss_fn=loss_fn, clip=CLIP, precision=precision)
        norms.append(stats.grad_norm)
        means.append(float(sums["loss_sum"] / sums["count"]))
    return (model.state_dict(), norms, means) if losses else (model.state_dict(), norms)


def fsdp_accum_clip(topo):
    """fully_shard over 2 ranks, K=2 micro-batches per rank, the reduce-scatter only on the second (fsdp_sync)."""
    batches = _token_batches()
    expected, expected_norms = _one_process(batches, k=1)
    mesh = build_mesh(topo, {"dp": 2})
    model = apply_fsdp(_tiny_gpt(), mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = make_exact_loss(Loss(), model=model)
    norms = []
    for x, y in batches:
        mine = x.chunk(2)[topo.rank], y.chunk(2)[topo.rank]
        micro = list(zip(mine[0].chunk(2), mine[1].chunk(2)))
        _, stats = accum.step_amp(
            model,
            micro,
            optimizer=optimizer,
            loss_fn=loss_fn,
            clip=CLIP,
            sync=fsdp_sync,
            dp_group=mesh.get_group(),
        )
        norms.append(stats.grad_norm)
    full = full_state_dict(model)
    return norms, expected_norms, {k: (full[k], v) for k, v in expected.items()} if full else None


def pipeline_accum_clip(topo, precision):
    """2 stages, K=2 accumulated batches of 2 micro-batches each, clipped over both stages; padded targets (-100),
    one micro-batch with none counted: token-exact, and the loss reported finite and equal to one process's."""
    from torch.distributed.pipelining import PipelineStage

    from core import schedules

    batches = _token_batches(padded=True)
    expected, _, expected_losses = _one_process(batches, k=4, precision=precision, losses=True)
    stage = schedules.split_pipeline(_tiny_gpt(), num_stages=2, stage_index=topo.rank)
    loss_fn = schedules.TokenLoss()
    stages = [PipelineStage(stage, topo.rank, 2, topo.device)]
    sched = schedules.build_schedule("1f1b", stages, microbatches=4, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    losses = []
    for x, y in batches:
        # K=2 batches of 4 through a schedule of 2 x 2 micro-batches: step_pipeline takes them as one
        sums, _ = schedules.step_pipeline(
            sched,
            (x, y),
            loss_fn=loss_fn,
            optimizer=optimizer,
            holds_last=topo.rank == 1,
            precision=precision,
            clip=CLIP,
            pp_group=torch.distributed.group.WORLD,
        )
        losses.append(float(sums["loss_sum"] / sums["count"]) if topo.rank == 1 else None)
    full = schedules.gather_state_dict([stage])
    if topo.rank == 1:  # the last stage's metrics: finite, and the one process's loss
        assert losses == pytest.approx(expected_losses, rel=1e-2 if precision == "bf16" else 1e-5)
    return {k: (full[k], v) for k, v in expected.items()} if full else None


def pipeline_float_targets(topo):
    """Soft labels (float targets) through the pipeline's step: every rank's error, none left waiting."""
    from torch.distributed.pipelining import PipelineStage

    from core import schedules

    stage = schedules.split_pipeline(_tiny_gpt(), num_stages=2, stage_index=topo.rank)
    loss_fn = schedules.TokenLoss()
    sched = schedules.build_schedule(
        "1f1b", [PipelineStage(stage, topo.rank, 2, topo.device)], microbatches=2, loss_fn=loss_fn
    )
    tokens, soft = torch.randint(0, 40, (4, 16)), torch.rand(4, 16, 40).softmax(-1)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    try:
        schedules.step_pipeline(sched, (tokens, soft), loss_fn=loss_fn, optimizer=optimizer, holds_last=topo.rank == 1)
    except RecipeError as err:
        return str(err)


@pytest.mark.world
def test_pipeline_refuses_float_targets_on_every_rank_at_once(world2):
    """A review find: soft labels passed the pre-check and crashed the last stage with torch's ValueError."""
    first, second = world2.run(pipeline_float_targets)
    assert first == second and first.startswith("pipeline's loss is cross-entropy over class indices; these targets")


def _assert_pairs(pairs, **tol):
    for key, (got, want) in pairs.items():
        torch.testing.assert_close(got, want, **tol, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.world
def test_fsdp_accumulation_and_clip_equal_one_process(world2):
    (norms, expected_norms, pairs), _ = world2.run(fsdp_accum_clip)
    assert min(expected_norms) > CLIP  # the clip bites
    assert norms == pytest.approx(expected_norms, rel=1e-5)
    _assert_pairs(pairs, **TOL)


@pytest.mark.world
@pytest.mark.parametrize("precision, tol", [("fp32", TOL), ("bf16", dict(atol=1e-3, rtol=1e-2))])
def test_pipeline_accumulation_clip_and_precision_equal_one_process(world2, precision, tol):
    pairs, _ = world2.run(pipeline_accum_clip, precision)
    _assert_pairs(pairs, **tol)


def accumulate(model, micro_batches, loss_fn, *, dp_group, sync=amp.grad_sync) -> None:
    """step_amp's fp32 backward, by hand: each micro-batch's summed loss over the global count, backward; the
    gradients reduced across ranks in the last one's only (`sync`: core.amp.grad_sync's shape)."""
    count = sum(count_targets(batch, loss_fn) for batch in micro_batches)
    torch.distributed.all_reduce(count, group=dp_group)  # the global batch's counted targets
    normalizer = count / torch.distributed.get_world_size(dp_group)
    for i, batch in enumerate(micro_batches):
        with sync(model, enabled=i == len(micro_batches) - 1):
            forward_exact(model, batch, loss_fn, normalizer=normalizer)[0].backward()


def tp_accum_clip(topo, via_step_amp: bool):
    """tensor parallel over 2 ranks (both see the whole batch), K=2 micro-batches, the clip's norm over the
    DTensor shards and the plain (replicated) layers the TP plan leaves out, together."""
    batches = _token_batches()
    expected, expected_norms = _one_process(batches, k=2)
    mesh = build_mesh(topo, {"dp": 1, "tp": 2})  # no data parallelism: the count is this rank's batch's
    model = _split_tp(_tiny_gpt(), mesh["tp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = make_exact_loss(Loss(), model=model)
    one = mesh["dp"].get_group()
    norms = []
    for x, y in batches:
        micro = list(zip(x.chunk(2), y.chunk(2)))
        if via_step_amp:
            stats = accum.step_amp(model, micro, optimizer=optimizer, loss_fn=loss_fn, clip=CLIP, dp_group=one)[1]
            norms.append(stats.grad_norm)
            continue
        optimizer.zero_grad(set_to_none=True)  # step_amp's fp32 path, with grads.clip_grad_norm
        accumulate(model, micro, loss_fn, dp_group=one)
        norms.append(float(grads.clip_grad_norm(model.parameters(), CLIP)))
        optimizer.step()
    full = full_state_dict(model)
    return norms, expected_norms, {k: (full[k], v) for k, v in expected.items()} if full else None


@pytest.mark.world
@pytest.mark.parametrize("via_step_amp", [False, True])
def test_tensor_parallel_accumulation_and_clip_equal_one_process(world2, via_step_amp):
    (norms, expected_norms, pairs), _ = world2.run(tp_accum_clip, via_step_amp)
    assert norms == pytest.approx(expected_norms, rel=1e-5)
    _assert_pairs(pairs, **TOL)
