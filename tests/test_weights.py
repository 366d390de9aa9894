"""Starting from weights (the kernel's write_weights, the init_from plug-in) and the Hugging Face folder of a run
(the hf plug-in), on transformers models from tiny configs (no download): GPT-2 ties its embeddings to lm_head, Llama
does not."""

import json
import pickle

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from core.kernel.job import RecipeError, RunFolder
from core.kernel.replica import save_checkpoint
from core.kernel.store import write_weights
from core.plugins.hf import hf_model, write_hf_folder
from core.plugins.init_from import InitFrom, check_weights, load_weights, read_weights


def _run(folder) -> RunFolder:
    return RunFolder(folder, None, "ddp", {"model": "x"}, True)


def save_weights(state, path):
    """A run's final weights, as the recipes write them (RUN/model.safetensors)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    written = write_weights(_run(path.parent), state)
    return written.rename(path)


pytestmark = pytest.mark.fast


def gpt2(**changes):
    config = dict(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(GPT2Config(**(config | changes)))


def llama(**changes):
    config = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, max_position_embeddings=32, **(config | changes)))


MODELS = {"gpt2": gpt2, "llama": llama}


def trained(build, seed=1):
    """A model whose weights no initialization gives (as after training), and its state dict."""
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(state, model):
    for key, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, state[key], rtol=0, atol=0, msg=key)  # bit for bit


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and "Traceback" not in text
    return text


@pytest.mark.parametrize("shard", [None, 2_000], ids=["one-file", "sharded"])
@pytest.mark.parametrize("name", MODELS)
def test_a_save_pretrained_folder_starts_a_run(name, shard, tmp_path):
    model, state = trained(MODELS[name])
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    tied = name == "gpt2"  # transformers leaves lm_head.weight out of the file: not a missing key
    assert set(read_weights(tmp_path)) == set(state) - ({"lm_head.weight"} if tied else set())
    with torch.device("meta"):  # the pre-check: shapes from a meta-device model and the headers alone
        check_weights(tmp_path, MODELS[name]())
    fresh, _ = trained(MODELS[name], seed=2)
    load_weights(fresh, tmp_path)
    assert_same(state, fresh)
    embeddings = fresh.transformer.wte.weight if tied else fresh.model.embed_tokens.weight
    assert (fresh.lm_head.weight is embeddings) == tied


def test_a_runs_model_safetensors_starts_a_run(tmp_path):
    model, state = trained(gpt2)
    save_weights(state, tmp_path / "model.safetensors")  # lm_head stored as a copy
    for path in (tmp_path / "model.safetensors", tmp_path):  # the file, or the run folder that holds it
        fresh, _ = trained(gpt2, seed=2)
        load_weights(fresh, path)
        assert_same(state, fresh)
        assert fresh.lm_head.weight is fresh.transformer.wte.weight


def test_a_training_checkpoint_starts_a_run_from_its_model_part(tmp_path, group1):
    """A review find: --init-from RUN/ckpt/step-N.safetensors was called "another model" (its keys are model/...,
    beside the optimizer's); its model part is the weights at step N, a fine start for a new run."""
    model, state = trained(gpt2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    progress = {"step": 4, "epoch": 0, "samples": 64, "skipped": 0}
    run = RunFolder(tmp_path, None, "ddp", {"model": "x", "global_batch": 16}, True)
    path = save_checkpoint(run, model=model, optimizer=optimizer, scheduler=scheduler, progress=progress, keep=2)
    fresh, _ = trained(gpt2, seed=2)
    load_weights(fresh, path)
    assert_same(state, fresh)


def test_a_sharded_checkpoint_or_a_file_of_it_names_what_to_pass_instead(tmp_path):
    """A review find: a file of ckpt/step-N/ was "another model", the folder "no such file" (core/shard_ckpt.py's
    layout: the shards in ckpt/step-N/, the file --resume takes beside it)."""
    step = tmp_path / "ckpt" / "step-000010"
    step.mkdir(parents=True)
    save_weights({"rng/0/cpu": torch.get_rng_state()}, step.with_suffix(".safetensors"))
    shard = step / "shard-00001-model-00001-of-00001.safetensors"
    save_weights(trained(gpt2)[1], shard)
    for path in (step, shard):
        with pytest.raises(RecipeError) as err:
            read_weights(path)
        assert one_line(err).startswith(f"--init-from {path}: a sharded training checkpoint")
        assert f"continue it with --resume {step}.safetensors" in one_line(err)


@pytest.mark.parametrize(
    "index,says",
    [
        ("not json", "JSONDecodeError"),
        ('{"metadata": {}}', "KeyError"),
        ('{"weight_map": {"wte.weight": null}}', "its weight_map names no files"),
        ('{"weight_map": []}', "AttributeError"),
    ],
)
def test_a_damaged_index_is_one_line(index, says, tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    for read in (read_weights, lambda path: check_weights(path, gpt2())):
        with pytest.raises(RecipeError) as err:
            read(tmp_path)
        assert one_line(err).startswith(f"--init-from {tmp_path}: model.safetensors.index.json is not a readable")
        assert says in one_line(err)


def test_a_damaged_run_file_is_refused(tmp_path):
    _, state = trained(gpt2)
    path = save_weights(state, tmp_path / "model.safetensors")
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    end = 8 + size + json.loads(data[8 : 8 + size])["lm_head.weight"]["data_offsets"][1]
    data[end - 3] ^= 0x40  # a bit of lm_head.weight
    path.write_bytes(bytes(data))
    with pytest.raises(RecipeError) as err:
        read_weights(path)
    damaged = "tensor lm_head.weight does not match its checksum (the file is damaged); use an undamaged copy of it"
    assert one_line(err) == f"{path}: {damaged}"


@pytest.mark.parametrize(
    "other,expect",
    [
        (lambda: gpt2(n_embd=32), ["shape mismatches: transformer.h.0.attn.c_attn.bias (48,) vs (96,)"]),
        (lambda: gpt2(n_layer=1), ["unexpected keys", "transformer.h.1."]),
        (lambda: gpt2(n_layer=3), ["missing keys", "transformer.h.2."]),
        (
            llama,
            [
                "missing keys: lm_head.weight, model.embed_tokens.weight, model.layers.0.",
                "unexpected keys: transformer.",
                "...",
            ],
        ),
    ],
    ids=["misshapen", "unexpected", "missing", "other-class"],
)
def test_weights_of_another_model_fail_in_one_line_naming_keys(other, expect, tmp_path):
    model, _ = trained(gpt2)
    model.save_pretrained(tmp_path)
    with torch.device("meta"):
        target = other()
    with pytest.raises(RecipeError) as err:
        check_weights(tmp_path, target)
    text = one_line(err)
    assert text.startswith(f"--init-from {tmp_path} holds another model")
    for part in expect:
        assert part in text


def test_a_file_that_gives_two_tied_names_different_values_is_refused(tmp_path):
    _, state = trained(gpt2)
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    save_weights(state, tmp_path / "model.safetensors")
    with pytest.raises(RecipeError, match="transformer.wte.weight and lm_head.weight differ.*; start from weights"):
        load_weights(gpt2(), tmp_path / "model.safetensors")


class Payload:
    """Unpickling this makes a folder: had anything unpickled the file, the folder would exist."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.marker),)


@pytest.mark.parametrize("layout", ["file.bin", "file.pt", "folder"])
def test_a_pickle_is_refused_never_unpickled(layout, tmp_path):
    marker = tmp_path / "unpickled"
    hf = tmp_path / "hf"
    hf.mkdir()
    target = hf / "pytorch_model.bin" if layout == "folder" else tmp_path / f"model.{layout.split('.')[1]}"
    target.write_bytes(pickle.dumps({"weight": Payload(marker)}))
    path = hf if layout == "folder" else target
    with pytest.raises(RecipeError, match="never unpickled") as err:
        read_weights(path)
    assert str(path) in one_line(err)
    with pytest.raises(RecipeError, match="never unpickled"):
        check_weights(path, gpt2())
    assert not marker.exists()


def test_paths_that_hold_no_weights_fail_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "junk.safetensors").write_bytes(b"not a header")
    broken = tmp_path / "broken"
    gpt2().save_pretrained(broken, max_shard_size=2_000)
    next(broken.glob("model-00002-*.safetensors")).unlink()  # an interrupted download
    cases = {
        tmp_path / "nothing": "no such file",
        tmp_path / "empty": "no such file (model.safetensors)",
        tmp_path / "notes.txt": "not a .safetensors file",
        tmp_path / "junk.safetensors": "not a readable safetensors file",
        broken: "model-00002-of-",
    }
    for path, says in cases.items():
        with pytest.raises(RecipeError) as err:
            read_weights(path)
        assert says in one_line(err) and str(path.name) in one_line(err)


@pytest.mark.parametrize("name", MODELS)
def test_the_hf_folder_loads_with_from_pretrained_bit_for_bit(name, tmp_path, capfd):
    model, state = trained(MODELS[name])
    capfd.readouterr()
    out = write_hf_folder(_run(tmp_path), model, state, max_shard_mb=100)
    assert capfd.readouterr().err == "" and hf_logging.is_progress_bar_enabled()  # no bar in the log, then as before
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(model).__name__]
    assert not (out / "model.safetensors.index.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(model)
    assert_same(state, loaded)
    if name == "gpt2":  # written once (the state held it as a copy), tied again by from_pretrained
        assert "lm_head.weight" not in read_weights(out)
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
    else:
        assert "lm_head.weight" in read_weights(out)


def test_the_hf_folder_is_sharded_above_the_size_from_a_meta_model(tmp_path):
    _, state = trained(gpt2)
    with torch.device("meta"):  # only config, class and tied names come from the model: a pipeline's rank 0
        meta = gpt2()
    out = write_hf_folder(_run(tmp_path), meta, state, max_shard_mb=0.005)  # 5000 bytes, above the largest (4096)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert all(p.stat().st_size <= 5_000 + 1_000 for p in out.glob("model-*.safetensors"))  # + the header
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert_same(state, loaded)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert not list(tmp_path.glob(".hf.tmp-*"))


class Wrapper(nn.Module):
    """A user's module that holds a transformers model, plus a part of its own."""

    def __init__(self):
        super().__init__()
        self.backbone = gpt2()
        self.probe = nn.Linear(16, 3)


def test_a_wrapped_model_is_named_by_its_attribute(tmp_path):
    model, state = trained(Wrapper)
    assert hf_model(model, attr="backbone") is model.backbone
    out = write_hf_folder(_run(tmp_path), model, state, attr="backbone", max_shard_mb=100)
    inner = {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}
    assert_same(inner, AutoModelForCausalLM.from_pretrained(out))


@pytest.mark.parametrize("model", [nn.Linear(2, 2), Wrapper()])
def test_a_model_that_is_no_transformers_model_gets_no_folder(model, tmp_path):
    assert write_hf_folder(_run(tmp_path), model, model.state_dict()) is None and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "attr,says",
    [
        ("probe", "--hf-attr probe: Wrapper holds a Linear there, not a transformers model"),
        ("backbone.nothing", "--hf-attr backbone.nothing: GPT2LMHeadModel has no attribute nothing"),
    ],
)
def test_an_hf_attr_that_names_no_transformers_model_is_one_line(attr, says, tmp_path):
    model = Wrapper()
    with pytest.raises(RecipeError) as err:
        write_hf_folder(_run(tmp_path), model, model.state_dict(), attr=attr, max_shard_mb=100)
    assert says in one_line(err)
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_hf_folder_has_the_run_folders_file_mode(tmp_path):
    """Issue 27 item 7: safetensors wrote hf/'s weights 0600 while the rest of the run folder is 0644."""
    model, state = trained(gpt2)
    run = _run(tmp_path)
    out = write_hf_folder(run, model, state, max_shard_mb=0.005)  # shards and an index: every file
    mode = write_weights(run, state).stat().st_mode & 0o777
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: mode for p in out.iterdir()}


def test_a_full_disk_during_the_hf_write_is_the_disk_full_line(tmp_path, monkeypatch):
    """safetensors reports a full disk as a SafetensorError naming no file: a traceback, not the disk-full line.
    It is an OSError naming the run folder's disk now, and nothing of the half-written folder is left."""
    from safetensors import SafetensorError

    from core.kernel.job import os_error_line

    model, state = trained(gpt2)

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(model, "save_pretrained", full)
    with pytest.raises(OSError) as caught:
        write_hf_folder(_run(tmp_path), model, state)
    assert caught.value.errno == 28 and os_error_line(caught.value).startswith(f"{tmp_path}: the disk is full (")
    assert not list(tmp_path.iterdir())


def test_init_from_is_an_option_group_of_its_own(capsys):
    """28.4: --init-from is the init_from plug-in's InitFrom, in every recipe, with its own --help section; the
    init_from plug-in is that group whole (a lean copy's Config has no such base)."""
    from core.kernel.job import Training
    from tools.copies import feature_options
    from tools.options import parse_args
    from tools.registry import RECIPES

    assert "init_from" not in Training.__dataclass_fields__ and list(InitFrom.__annotations__) == ["init_from"]
    assert all(feature_options(name, "init_from") == {"init_from"} for name in RECIPES)
    for recipe in RECIPES.values():
        assert issubclass(recipe.load().Config, InitFrom), recipe.name
    with pytest.raises(SystemExit):
        parse_args(RECIPES["ddp"].load().Config, ["--help"])
    assert "\ninitial weights:\n  --init-from STR " in capsys.readouterr().out
