"""The pre-check (tools/precheck.py): what it can know before launch, it says in one line naming the fix.

Fast: tools.precheck.precheck on the recipes' own Configs, with a user's models and data (tests/check_user.py):
one training step on the first samples as the recipes take it, so the sample's shape against the forward's signature,
the loss choice, parameters no forward uses, SyncBatchNorm on CPU, the batch against the data set, streams
without a length. End to end: the launcher and `python -m recipes run` refuse each before any rank starts, with
one line and no torchrun report, and leave nothing behind.
"""

import os
import sys

import pytest

from core.kernel.job import RecipeError
from helpers import REPO, in_one_interpreter, run, user_env
from tools.precheck import precheck
from tools.registry import RECIPES

TESTS = str(REPO / "tests")


def _precheck(name: str = "ddp", *, world_size: int = 1, **options) -> list[str]:
    recipe = RECIPES[name]
    module = recipe.load()
    return precheck(recipe, module, module.Config(**options), world_size=world_size)


def _refused(name: str = "ddp", **options) -> str:
    with pytest.raises(RecipeError) as refused:
        _precheck(name, **options)
    assert "\n" not in str(refused.value)
    return str(refused.value)


@pytest.fixture(autouse=True)
def _user_modules(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(TESTS)
    monkeypatch.setenv("TDR_DEVICE", "cpu")  # the CPU job, GPUs or not
    monkeypatch.chdir(tmp_path)  # --out runs: writable, and nothing may appear in it


@pytest.mark.fast
def test_samples_of_three_parts_are_passed_as_inputs_and_target():
    """(input, mask, target): model(input, mask), the last part the target. A forward that takes one input is told
    which call was made and what its signature is."""
    assert _precheck(model="check_user:masked", data="check_user:triples") == []
    line = _refused(model="mlp", data="check_user:triples")
    assert "a sample of 3 parts (inputs..., target) is passed as model(sample[0], sample[1])" in line
    assert "MLP.forward(x: 'torch.Tensor') -> 'torch.Tensor' does not take it" in line
    assert line.startswith("--model mlp --data check_user:triples: ")


@pytest.mark.fast
def test_a_nanogpt_model_trains_on_its_own_loss_and_another_choice_names_the_one_that_works():
    """forward(idx, targets=None): --loss auto hands it the targets (loss plug-in) and the pre-check agrees; --loss ce
    takes its inference output (the last position only), which cannot work: one line naming --loss auto."""
    assert _precheck("ddp_amp", model="check_user:nano", data="check_user:pair_stream", max_steps=2) == []
    line = _refused("ddp_amp", model="check_user:nano", data="check_user:pair_stream", max_steps=2, loss="ce")
    assert line.startswith("--model check_user:nano --data check_user:pair_stream --loss ce: the model returns logits")
    assert "for one position" in line and "return every position's logits" in line  # issue 27.4: cause and fix
    assert line.endswith("use --loss auto or model, with which this model and data give a loss")


@pytest.mark.fast
def test_float_targets_get_mse_and_a_loss_that_cannot_work_names_the_one_that_would():
    assert _precheck(model="check_user:regressor", data="check_user:regression") == []
    line = _refused(model="check_user:regressor", data="check_user:regression", loss="ce")
    assert "--loss ce: " in line and "use --loss auto or mse" in line
    assert "takes no targets; use --loss auto or ce" in _refused(loss="model")  # mlp's forward(x)


@pytest.mark.fast
def test_parameters_no_forward_uses_name_them_and_the_two_flags():
    line = _refused(model="check_user:unused")
    assert line.startswith("--model check_user:unused: parameters spare.weight, spare.bias get no gradient")
    assert "--find-unused-parameters" in line and "--static-graph" in line
    assert _precheck(model="check_user:unused", static_graph=True) == []
    assert _precheck(model="check_user:unused", find_unused_parameters=True) == []
    assert _precheck("dp", model="check_user:unused") == []  # no DDP: nothing waits for their gradients


@pytest.mark.fast
def test_syncbatchnorm_without_a_gpu_and_the_batchnorm_warning():
    assert "--sync-batchnorm: torch's SyncBatchNorm runs on GPUs only" in _refused(sync_batchnorm=True)
    assert "SyncBatchNorm layers (1) run on GPUs only" in _refused(model="check_user:syncbn")
    (warning,) = _precheck(model="check_user:batchnorm")
    assert warning.startswith("BatchNorm layers 1 (BatchNorm1d) normalise with each rank's own batch")
    assert _precheck("dp", model="check_user:batchnorm") == []  # one process: no replicas to tell apart


def test_unequal_counted_targets_across_ddp_replicas_is_one_warning_naming_ddp_amp():
    """27.4: padded sequences (-100 on tails of varying length) under ddp at 2 ranks: each rank's mean loss,
    averaged, weighs a target by its rank's count; the pre-check's first samples (11 and 10 counted after the
    shift) say so once. One rank, ddp_amp (token-exact) or targets that all count: no warning."""
    lm = dict(model="check_user:gpt2", data="check_user:lm", max_steps=1)
    (warning,) = _precheck(world_size=2, **lm)
    assert warning.startswith("the first samples hold 11 and 10 counted targets (not -100): ddp averages the mean ")
    assert "its 2 replicas" in warning
    assert warning.endswith("ddp_amp weighs every target of the global batch alike (token-exact weights)")
    assert _precheck("ddp_monitored", world_size=2, **lm)[0] == warning.replace(
        "ddp averages", "ddp_monitored averages"
    )
    assert _precheck(world_size=1, **lm) == [] and _precheck("ddp_amp", world_size=2, **lm) == []
    assert _precheck("dp", **lm) == [] and _precheck(world_size=2) == []  # dp on a CPU: one replica; digits: all count


@pytest.mark.fast
def test_a_batch_larger_than_one_ranks_share_and_a_stream_without_max_steps():
    assert "--batch-size 5000: the training set (1438 samples)" in _refused(batch_size=5000)
    line = _refused(batch_size=800, world_size=2)  # 1438 samples: 719 a rank
    assert line.endswith("gives each of 2 rank(s) 719, not one optimizer step; use --batch-size 719 or less")
    assert "--accum 2" in _refused("ddp_amp", batch_size=500, accum=2, world_size=2)
    assert "a stream without a length; set --max-steps" in _refused("ddp_amp", data="check_user:pair_stream")
    assert "ddp reads map-style data sets" in _refused(data="check_user:pair_stream", max_steps=2)


@pytest.mark.fast
def test_a_factory_that_exits_is_refused():
    assert "--model check_user:exits: the factory called sys.exit(0) instead of returning" in _refused(
        model="check_user:exits"
    )


@pytest.mark.fast
def test_a_model_with_nothing_to_train_or_nan_weights_is_refused_with_the_real_cause(tmp_path):
    """Review finds: a frozen model was sent between --loss auto and --loss ce; nan weights (from the factory or
    --init-from) passed, and the run failed at step 1 advising --lr and --clip."""
    assert "no parameter that requires grad, so there is nothing to train" in _refused(model="check_user:frozen")
    assert _precheck(model="check_user:masked_classes") == []  # a frozen -inf mask trains: no refusal
    line = _refused(model="check_user:nan_weights")
    assert line.startswith("--model check_user:nan_weights: the weights 0.weight hold nan or inf before training")
    from safetensors.torch import save_file

    import check_user

    save_file(check_user.nan_weights().state_dict(), tmp_path / "nan.safetensors")
    line = _refused(model="check_user:small", init_from=str(tmp_path / "nan.safetensors"))
    assert line.startswith(f"--init-from {tmp_path / 'nan.safetensors'}: the weights 0.weight hold nan or inf")


@pytest.mark.fast
def test_an_hf_attr_that_names_no_transformers_model_is_refused_before_launch():
    """A review find: a wrong --hf-attr was refused only when hf/ was written, after the whole run."""
    line = _refused(model="check_user:gpt2", data="check_user:lm", hf_attr="backbone")
    assert line == "--hf-attr backbone: GPT2LMHeadModel has no attribute backbone; name the path to it"
    assert "--hf-attr blocks: MLP holds a Sequential there, not a transformers model" in _refused(hf_attr="blocks")


@pytest.mark.fast
def test_a_step_that_is_not_finite_names_only_options_the_recipe_takes():
    """ddp takes no --clip (review find: its line advised it); the amp recipes do."""
    from core import accum
    from core.kernel.step import check_finite

    with pytest.raises(RecipeError) as plain:
        check_finite(float("nan"), step=1, on_nonfinite="stop")
    assert "--clip" not in str(plain.value) and "lower --lr, or pass --on-nonfinite skip" in str(plain.value)
    with pytest.raises(RecipeError) as clipping:
        accum.check_step(accum.StepStats(float("inf"), True), step=3, on_nonfinite="stop")
    assert "lower --lr, set --clip, or pass --on-nonfinite skip" in str(clipping.value)


# --- before launch, for real: the launcher stops at its pre-check ----------------------------------------------

LAUNCH = [  # (options, words of the one line): each was refused only in the ranks, or not at all
    (["--data", "check_user:pair_stream"], "a stream without a length; set --max-steps"),
    (["--sync-batchnorm"], "--sync-batchnorm: torch's SyncBatchNorm runs on GPUs only"),
    (["--model", "check_user:exits"], "the factory called sys.exit(0)"),
    (["--out", ""], "--out '': name a folder"),
    (["--model", "check_user:unused"], "parameters spare.weight, spare.bias get no gradient"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("options,words", LAUNCH, ids=[" ".join(o) for o, _ in LAUNCH])
def test_the_launcher_refuses_before_any_rank_starts(options, words, tmp_path):
    recipe = "ddp_amp" if any("pair_stream" in o for o in options) else "ddp"
    # NPROC_PER_NODE set (2, a CPU's default): the launcher starts no python of its own to count the GPUs
    proc = run(
        [str(REPO / "launch_single_node.sh"), recipe, *options],
        cwd=tmp_path,
        env=user_env(PYTHONPATH=os.pathsep.join([TESTS, str(REPO)]), TDR_DEVICE="cpu", NPROC_PER_NODE="2"),
        check=False,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[transformers]")]
    assert proc.returncode != 0 and lines == [lines[-1]] and lines[-1].startswith("error: "), proc.stderr
    assert words in lines[-1] and "torchrun" not in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir()), "nothing is written"


@pytest.mark.e2e
def test_the_warning_is_said_once_before_launch_and_a_run_alone_checks_first(tmp_path):
    """python -m recipes run (no launcher) runs the pre-check itself; TDR_PRECHECKED=1 under torchrun skips it in
    the ranks, whose launcher ran it."""
    env = user_env(PYTHONPATH=os.pathsep.join([TESTS, str(REPO)]), TDR_DEVICE="cpu")
    runs = [["--model", "check_user:batchnorm", "--max-steps", "2"], ["--sync-batchnorm"]]  # in one interpreter
    proc, alone = in_one_interpreter([{"args": ["run", "ddp", *a], "cwd": str(tmp_path)} for a in runs], env=env)
    assert proc.returncode == 0 and proc.stderr.count("warning: BatchNorm layers 1 (BatchNorm1d)") == 1, proc.stderr
    assert alone.returncode == 1 and alone.stderr.strip().splitlines()[-1].startswith("error: --sync-batchnorm")
    checked = user_env(PYTHONPATH=os.pathsep.join([TESTS, str(REPO)]), TDR_DEVICE="cpu", TDR_PRECHECKED="1")
    proc = run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "recipes"]
        + ["run", "ddp", "--model", "check_user:batchnorm", "--max-steps", "1", "--out", str(tmp_path / "ranks")],
        cwd=tmp_path,
        env=checked,
    )
    assert "warning: BatchNorm" not in proc.stderr and "summary " in proc.stdout
