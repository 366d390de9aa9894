"""Running the real commands as a user would: subprocesses with a timeout, in a clean environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def user_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "MAX_RESTARTS")
    }
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run(
    args: list[str], *, cwd: Path | str = REPO, timeout: float = 240, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run a command; on failure (when check) the assertion shows its stdout and stderr."""
    proc = subprocess.run(args, cwd=cwd, env=env or user_env(), capture_output=True, text=True, timeout=timeout)
    if check:
        output = f"--stdout--\n{proc.stdout}\n--stderr--\n{proc.stderr}"
        assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{output}"
    return proc


def in_one_interpreter(cases: list[dict], *, env: dict | None = None, timeout: float = 240) -> list:
    """tests/cli_cases.py: `cases` ({"args", "cwd"} for `python -m recipes ARGS`, with "file" for `python FILE ARGS`,
    "env" for variables of its own) one after another in one interpreter: each one's exit status, stdout and stderr,
    as `run` returns them."""
    with tempfile.TemporaryDirectory(prefix="tdr-cases-") as folder:
        listed = Path(folder) / "cases.json"
        listed.write_text(json.dumps(cases))
        proc = run([sys.executable, str(REPO / "tests" / "cli_cases.py"), str(listed)], env=env, timeout=timeout)
    said = json.loads(proc.stdout)
    return [
        subprocess.CompletedProcess(
            [case.get("file", "recipes"), *case["args"]], one["code"], one["stdout"], one["stderr"]
        )
        for case, one in zip(cases, said, strict=True)
    ]


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    """The command line of `torchrun --standalone --nproc-per-node NPROC ARGS` in this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]


def recipes_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "recipes", *args], **kwargs)


# Recipes still being moved onto the new core (issue 19): while one of them does not import, the tests that run
# it are skipped, saying so; once it imports, they run.
CONVERTING = frozenset({"ddp_monitored", "fsdp", "tensor_parallel", "fsdp_tp", "pipeline", "pipeline_naive"})


def waiting(name: str) -> bool:
    """A recipe still being converted that does not import yet."""
    if name not in CONVERTING:
        return False
    from tools.registry import RECIPES

    try:
        RECIPES[name].load()
        return False
    except ImportError:
        return True


def recipe_params(names) -> list:
    """pytest parameters for recipe names, the ones still being converted skipped with the reason."""
    import pytest

    return [
        pytest.param(n, marks=pytest.mark.skip(reason=f"{n} waits for its move to the new core (issue 19)"))
        if waiting(n)
        else n
        for n in names
    ]


def unfinished(run_dir: Path) -> Path:
    """The run folder as if its job had died before its end: without the summary record, which says a run is
    finished (a finished run, resumed, trains nothing). Its weights file stays: the resumed run rewrites it."""
    metrics = Path(run_dir) / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(line for line in lines if '"kind": "summary"' not in line))
    return Path(run_dir)


def checkpoints(ckpt_dir: Path) -> list[Path]:
    """The step-N.safetensors files of a ckpt/ folder, oldest first (a killed write's .step-N... files are not)."""
    return sorted(Path(ckpt_dir).glob("step-*.safetensors"), key=lambda p: (len(p.name), p.name))
