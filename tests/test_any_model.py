"""fsdp on any model (issue 13.5) and DDP's sharp edges (13.6): find_blocks on GPT-2, Llama, nanoGPT-style and
our own models; the pre-checks of tensor_parallel and pipeline on a meta-device model; BatchNorm helpers; and
fsdp over a real transformers GPT2LMHeadModel (and a model without blocks) on 2 gloo ranks against one process."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from core import pipeline, shard, tp_plan
from core.gpt import GPT
from core.kernel.builtin import MLP
from core.kernel.job import RecipeError
from core.mesh import build_mesh
from core.plugins import blocks
from core.plugins.replicas import replicas_report
from core.plugins.tuning import checkpoint_blocks
from mp_reference import apply_fsdp, full_state_dict
from world import GlooWorld

transformers = pytest.importorskip("transformers")


def gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )  # no dropout: comparable
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=50,
    )
    return transformers.LlamaForCausalLM(config)


class NanoGPT(nn.Module):
    """nanoGPT's layout: transformer = ModuleDict(wte, h = ModuleList(Block)), lm_head."""

    def __init__(self):
        super().__init__()
        block = lambda: nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))  # noqa: E731
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(20, 8), h=nn.ModuleList([block() for _ in range(3)])))
        self.lm_head = nn.Linear(8, 20)


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.fast
@pytest.mark.parametrize(
    "build, path",
    [(gpt2, "transformer.h"), (llama, "model.layers"), (NanoGPT, "transformer.h"), (GPT, "blocks"), (MLP, "blocks")],
)
def test_find_blocks_finds_the_repeated_layers(build, path):
    name, found = shard.find_blocks(build())
    assert name == path and len(found) >= 2


@pytest.mark.fast
def test_find_blocks_by_name_and_a_bad_name():
    model = gpt2()
    assert blocks.named_blocks(model, "transformer.h")[0] == "transformer.h"
    with pytest.raises(RecipeError, match=r"--blocks transformer\.blocks: .*candidates: transformer\.h") as err:
        blocks.named_blocks(model, "transformer.blocks")
    assert "\n" not in str(err.value)
    assert shard.find_blocks(NoBlocks()) is None
    with pytest.raises(RecipeError, match=r"--blocks h: "):  # the run refuses it where it shards (a copy: no pre-check)
        shard.shard_blocks(SimpleNamespace(blocks="h"), model)


@pytest.mark.fast
@pytest.mark.parametrize("build", [gpt2, NanoGPT, NoBlocks])
def test_tp_and_pipeline_pre_checks_refuse_other_structures_on_meta(build):
    with torch.device("meta"):
        model = build()
    with pytest.raises(RecipeError, match="tensor parallelism needs a plan: .*model.blocks.*use fsdp"):
        tp_plan.plan_of(model, tp=2)
    with pytest.raises(RecipeError, match="pipelining needs every parameter in `model.blocks`"):
        pipeline.check_pipeline_model(model)


@pytest.mark.fast
def test_pre_checks_accept_the_gpt_on_meta():
    with torch.device("meta"):
        model = GPT()
    tp_plan.plan_of(model, tp=2)
    assert len(tp_plan.gpt_tp_plan(model)) == 4 * 6  # q, k, v, proj; fc, proj in each of the 4 blocks
    assert pipeline.check_pipeline_model(model) == 6


@pytest.mark.fast
def test_batchnorm_layers_and_sync_batchnorm_on_cpu(monkeypatch):
    from tools.precheck import check_devices
    from tools.probes import batchnorm_layers

    monkeypatch.setenv("TDR_DEVICE", "cpu")
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2), nn.BatchNorm1d(2))
    assert batchnorm_layers(model) == ["1 (BatchNorm2d)", "4 (BatchNorm1d)"] and batchnorm_layers(MLP()) == []
    with pytest.raises(RecipeError, match="--sync-batchnorm: .*GPUs only"):
        check_devices(model, spec="m", sync_batchnorm=True)
    with pytest.raises(RecipeError, match="SyncBatchNorm layers .* run on GPUs only"):
        check_devices(nn.SyncBatchNorm.convert_sync_batchnorm(model), spec="m", sync_batchnorm=False)


@pytest.mark.fast
def test_activation_checkpointing_on_a_transformers_model_recomputes_the_same_numbers():
    batches = _data("gpt2")
    plain = _train(gpt2(), batches, _lm_loss).state_dict()
    model = gpt2()
    assert checkpoint_blocks(model) == 2  # transformer.h
    for key, value in _train(model, batches, _lm_loss).state_dict().items():
        assert torch.equal(value, plain[key]), key


# --- fsdp on models as they come, 2 gloo ranks against one process ---------------------------------------


@pytest.fixture(scope="module")
def world2():
    with GlooWorld(2, timeout_s=120) as world:
        yield world


def _train(model, batches, loss_of):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, batch).backward()
        optimizer.step()
    return model


def _lm_loss(model, tokens):
    return model(input_ids=tokens, labels=tokens).loss


def _mse(model, xy):
    return nn.functional.mse_loss(model(xy[0]), xy[1])


def _data(kind, steps=2):
    g = torch.Generator().manual_seed(7)
    if kind == "gpt2":
        return [torch.randint(0, 50, (4, 12), generator=g) for _ in range(steps)]
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(steps)]


def fsdp_vs_one_process(topo, kind):
    build, loss_of = (gpt2, _lm_loss) if kind == "gpt2" else (lambda: torch.manual_seed(0) and NoBlocks(), _mse)
    batches = _data(kind)
    reference = _train(build(), batches, loss_of).state_dict()
    model = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_fsdp(model, mesh=build_mesh(topo, {"dp": 2}))
    half = lambda b: b[topo.rank * 2 : (topo.rank + 1) * 2]  # noqa: E731  each rank: its half of the global batch
    shares = [half(b) if kind == "gpt2" else tuple(half(t) for t in b) for b in batches]
    full = full_state_dict(_train(model, shares, loss_of))
    if not full:  # rank 1: the gathered weights live on rank 0 only
        return None
    assert full.keys() == reference.keys()
    diff = max((full[k] - v).abs().max().item() for k, v in reference.items())
    return diff, [str(w.message) for w in caught if "no repeated blocks" in str(w.message)]


@pytest.mark.world
def test_fsdp_shards_a_transformers_gpt2_per_block(world2):
    (diff, warned), _ = world2.run(fsdp_vs_one_process, "gpt2")
    assert diff < 1e-5 and not warned


@pytest.mark.world
def test_fsdp_shards_a_model_without_blocks_as_one_unit_with_a_warning(world2):
    (diff, warned), _ = world2.run(fsdp_vs_one_process, "noblocks")
    assert diff < 1e-5 and len(warned) == 1


def sync_batchnorm_under_ddp_on_cpu(topo):
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)))
    try:
        torch.nn.parallel.DistributedDataParallel(model)
    except ValueError as err:
        return str(err)
    return "accepted"


@pytest.mark.world
def test_torch_refuses_sync_batchnorm_on_cpu(world2):
    """Why to_sync_batchnorm refuses CPU: torch 2.13's DDP does (when this fails, torch learnt it: allow it)."""
    assert world2.run(sync_batchnorm_under_ddp_on_cpu) == ["SyncBatchNorm layers only work with GPU modules"] * 2


@pytest.mark.fast
def test_the_pre_check_warns_naming_the_batchnorm_layers():
    from tools.precheck import batchnorm_warnings

    said = batchnorm_warnings(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))
    assert len(said) == 1 and "BatchNorm layers 1 (BatchNorm1d) " in said[0] and "--sync-batchnorm" in said[0]
    assert batchnorm_warnings(MLP()) == []


def batchnorm_replicas(topo):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.randn(6, 4) + topo.rank).sum().backward()  # each rank's own batch statistics
    return replicas_report(model.state_dict())


@pytest.mark.world
def test_summary_says_why_batchnorm_replicas_differ(world2):
    report = world2.run(batchnorm_replicas)[0]  # the ranks shift the inputs: the running mean differs, not the variance
    assert report == {
        "replicas_identical": False,
        "replicas_differ": "1.running_mean: BatchNorm statistics are per rank",
    }
