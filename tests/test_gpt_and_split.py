"""Layer 1, no process group: the tiny GPT and its data, split_pipeline's cut, and the errors the
model-parallel recipes raise before any process group or training exists."""

import functools
import itertools
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from core import gpt, schedules
from core.kernel.job import RecipeError
from core.kernel.loss import Loss
from core.kernel.step import step_plain
from core.pipeline import plan_split
from core.plugins.balance import block_times
from core.schedules import split_pipeline
from tools.cli import run_cli


def _best_max(weights, num_stages):
    """Brute force: the lightest heaviest stage over every contiguous split."""
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 1000), min_size=1, max_size=9).flatmap(
        lambda w: st.tuples(st.just(w), st.integers(1, len(w)))
    )
)
def test_plan_split_is_a_best_contiguous_split(case):
    weights, num_stages = case
    sizes = plan_split(weights, num_stages)
    assert len(sizes) == num_stages and min(sizes) >= 1 and sum(sizes) == len(weights)
    starts = [sum(sizes[:k]) for k in range(num_stages)]
    heaviest = max(sum(weights[s : s + n]) for s, n in zip(starts, sizes))
    assert heaviest <= _best_max(weights, num_stages)


class Widths(nn.Module):
    def __init__(self, widths):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths, widths[1:])))

    def forward(self, x):
        return self.blocks(x)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=2, max_size=9).flatmap(
        lambda w: st.tuples(st.just(w), st.integers(1, len(w) - 1))
    )
)
def test_split_pipeline_every_block_once_in_order(case):
    widths, num_stages = case
    model = Widths(widths)
    stages = [split_pipeline(model, num_stages=num_stages, stage_index=i) for i in range(num_stages)]
    assert [i for s in stages for i in s.indices] == list(range(len(model.blocks)))
    merged = {k: v for s in stages for k, v in s.state_dict().items()}
    assert merged.keys() == model.state_dict().keys()  # the stages keep the model's own names
    x = torch.randn(3, widths[0])
    out = x
    for stage in stages:
        out = stage(out)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_split_pipeline_balances_the_gpt_and_takes_weights():
    model = gpt.gpt()  # Embed, 4 Blocks, Head: two stages of 3 blocks each by parameter count
    assert [split_pipeline(model, num_stages=2, stage_index=i).indices for i in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert split_pipeline(model, num_stages=2, stage_index=1, weights=[5.0] + [1.0] * 5).indices == [1, 2, 3, 4, 5]
    times = block_times(model, torch.randint(128, (2, 64)))
    assert len(times) == 6 and min(times) > 0
    timed = split_pipeline(model, num_stages=3, stage_index=0, weights=times)
    assert timed.indices[0] == 0 and len(timed.indices) >= 1


def test_split_pipeline_refuses_fewer_blocks_than_stages():
    with pytest.raises(RecipeError, match="cannot cut the model's 6 blocks into 8 pipeline stages; use 1 to 6 stages"):
        split_pipeline(gpt.gpt(), num_stages=8, stage_index=0)


@pytest.mark.fast
def test_pipeline_naive_refuses_several_processes_in_one_line(monkeypatch):
    """Its check (the pre-check's, and a copy's main's) names the world size and the two ways out."""
    from recipes import pipeline_naive

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match=r"runs in one process, not WORLD_SIZE=2: run .*or use the pipeline recipe"):
        pipeline_naive.check(pipeline_naive.Config())


def test_text_data_and_tokenizer():
    train, val = gpt.text()
    assert len(train) > 1000 and len(val) > 100
    x, y = train[3]
    assert x.shape == y.shape == (64,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])  # the target is the input shifted by one character
    assert bytes(gpt.encode("def f(x):\n").tolist()).decode() == "def f(x):\n"
    assert int(gpt.encode("é")[0]) == ord("?")  # outside ASCII: one known token, never an index error


def test_gpt_learns_on_cpu():
    torch.manual_seed(0)
    model = gpt.gpt()
    train, _ = gpt.text()
    loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = Loss()  # the GPT returns logits: cross-entropy
    losses = [step_plain(model, batch, optimizer=optimizer, loss_fn=loss_fn)[0] for batch, _ in zip(loader, range(40))]
    first, last = (m["loss_sum"] / m["count"] for m in (losses[0], losses[-1]))
    assert last < first - 1.0, (first, last)  # from ~ln(128)=4.85 to well under 3.85 in 40 steps
    with torch.no_grad():  # greedy continuation: what a trained model has learnt reads as text
        ids = gpt.encode("def ")[None]
        for _ in range(5):
            ids = torch.cat([ids, model(ids[:, -64:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert bytes(ids[0].tolist()).decode("ascii").startswith("def ")


def _cli(name, args, monkeypatch, capsys, world_size):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # tiny:tied, check_user:gpt2: test model factories
    code = run_cli(["run", name, *args])
    return code, capsys.readouterr().err


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="--offload is refused only without a GPU")


@pytest.mark.fast
@pytest.mark.parametrize(
    "name, args, world, message",
    [
        ("pipeline", ["--pp", "3"], 2, "--pp 3: the world size 2 must be a multiple of the pipeline stages"),
        ("pipeline", ["--pp", "8"], 8, "has 6 blocks, fewer than the 8 pipeline stages"),
        ("pipeline", ["--schedule", "interleaved1f1b"], 4, "has 6 blocks, fewer than the 8 pipeline stages"),
        ("pipeline", ["--batch-size", "30", "--microbatches", "4"], 2, "--microbatches 4: must divide --batch-size 30"),
        ("pipeline", ["--microbatches", "1"], 2, "--microbatches 1: 1f1b needs at least one per stage (2)"),
        ("pipeline", ["--loss", "model"], 2, "--loss model: pipeline computes cross-entropy on the last stage"),
        ("pipeline", ["--model", "mlp", "--data", "digits", "--pp", "8"], 8, "has 4 blocks, fewer than the 8"),
        ("pipeline", ["--model", "tiny:tied"], 2, "pipelining needs every parameter in `model.blocks`"),
        ("tensor_parallel", [], 3, "tensor parallel size 3 must divide the 4 attention heads"),
        ("fsdp_tp", ["--tp", "2"], 3, "--tp 2: the world size 3 is not a multiple of it"),
        ("fsdp_tp", ["--tp", "8"], 8, "tensor parallel size 8 must divide the 4 attention heads"),
        ("tensor_parallel", ["--model", "mlp", "--data", "digits"], 2, "MLP: tensor parallelism needs a plan"),
        ("tensor_parallel", ["--model", "check_user:gpt2"], 2, "GPT2LMHeadModel: tensor parallelism needs a plan"),
        ("fsdp_tp", ["--model", "check_user:gpt2"], 2, "this model has neither; use fsdp for this model"),
        ("tensor_parallel", ["--model", "mp_reference:tiny_llama", "--sequence-parallel"], 2, "only the built-in GPT"),
        (
            "tensor_parallel",
            ["--model", "mp_reference:tiny_llama"],
            3,
            "size 3 must divide the 128 vocab rows of model.embed",
        ),
        ("fsdp", ["--blocks", "layers"], 2, "--blocks layers: GPT has no nn.ModuleList or nn.Sequential there"),
        ("fsdp_tp", ["--blocks", "h"], 2, "--blocks h: GPT has no nn.ModuleList or nn.Sequential there"),
        pytest.param("fsdp", ["--offload"], 2, "--offload: there is no GPU", marks=NO_GPU),
    ],
)
def test_bad_configs_fail_before_any_process_group(monkeypatch, capsys, name, args, world, message):
    code, err = _cli(name, args, monkeypatch, capsys, world)
    assert code == 1 and message in err and err.startswith("error: ") and err.count("\n") == 1, err


def test_mesh_sizes_must_multiply_to_the_world_size():
    from types import SimpleNamespace

    from core.mesh import build_mesh

    six = SimpleNamespace(world_size=6)  # refused before any process group is needed
    with pytest.raises(RecipeError, match="a dp=2 x pp=2 mesh needs 4 processes but the world size is 6; launch 4"):
        build_mesh(six, {"dp": 2, "pp": 2})


def test_interleaved_micro_batch_rounds():
    with pytest.raises(RecipeError, match=r"--microbatches 5: interleaved1f1b on 2 ranks needs a multiple of 2.*use 4"):
        schedules.check_pipeline(
            world_size=2, pp=2, schedule="interleaved1f1b", num_blocks=6, batch_size=10, microbatches=5
        )
    schedules.check_pipeline(world_size=4, pp=2, schedule="interleaved1f1b", num_blocks=6, batch_size=8, microbatches=8)


def test_gpt_trains_under_the_ddp_recipe(tmp_path, monkeypatch, capsys):
    """One process, no launcher: the ddp recipe takes --model gpt --data text like any factory."""
    code, err = _cli(
        "ddp",
        ["--model", "gpt", "--data", "text", "--max-steps", "3", "--batch-size", "8", "--out", str(tmp_path)],
        monkeypatch,
        capsys,
        1,
    )
    assert code == 0, err
    assert list(tmp_path.glob("*/model.safetensors"))


def _left_out(text: str, feature: str) -> bool:
    """A copy's header names `feature` as left out: a joined copy's one sentence, or a generated copy's line each."""
    head = text[: text.index("\nfrom __future__")].replace("\n# ", " ")
    joined = re.search(rf"each added by `--with NAME`[^:]*:[^.]*\b{feature}\b", head)
    return bool(joined) or f"`--with {feature}` adds it" in head


def test_lean_copies_leave_balance_blocks_digits_file_and_loss_counts_to_their_features():
    """A lean copy cuts the stages by parameter count (no --balance, no block_times), shards the blocks it finds (no
    --blocks), calls sklearn's load_digits, and weighs the model's own loss as a mean; each `--with` brings its code
    back, and the header names what is left out."""
    from tools.copies import copy_source

    @functools.cache
    def copy(name: str, *kept: str) -> str:
        return copy_source(name, f"{name}.py", kept=set(kept))

    cases = [
        ("pipeline", "balance", "def block_times("),
        ("fsdp", "blocks", "def named_blocks("),
        ("fsdp_tp", "blocks", "def named_blocks("),
    ]
    for name, feature, code in cases:
        lean, kept = copy(name), copy(name, feature)
        assert code not in lean and _left_out(lean, feature), (name, feature)
        assert code in kept and not _left_out(kept, feature), (name, feature)
    lean, kept = copy("ddp_amp"), copy("ddp_amp", "loss_counts")  # a recipe on the kernel: the plug-in's file, joined
    assert "def forward_counted(" not in lean and _left_out(lean, "loss_counts")
    assert "def forward_counted(" in kept and not _left_out(kept, "loss_counts")
    assert "balance: str = option(" not in copy("pipeline")  # no --balance: the lean copy names only what it has
    assert "load_digits(return_X_y=True)" in copy("ddp_amp")  # on the kernel: its digits(), sklearn's, as ddp's
    assert "load_digits(return_X_y=True)" in copy("ddp") and "def _digits_table(" not in copy("ddp", "all")
