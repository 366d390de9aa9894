"""The launchers under bad input and faults: one `error:` line each, no orphans, nothing listening beyond loopback.

The end-to-end tests start real torchrun jobs of the ddp recipe on a tiny model (2 CPU processes), several side
by side where one test needs several endings. Times are bounds for "did not hang", never asserted as speeds.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from torch import nn

import tools.supervise
from helpers import REPO, free_port, run, user_env
from tools.cli import cli
from tools.supervise import Supervisor, explain, shorten, torchrun_error

SINGLE, MULTI = str(REPO / "launch_single_node.sh"), str(REPO / "launch_multi_node.sh")
BOUND_S = 30  # a worker still alive this long after its launcher died is an orphan
LONG_MESSAGE = "fails on purpose: " + " ".join(f"word{i}" for i in range(120))  # longer than a closing line


class FailsOnRank1(nn.Module):
    """tests/tiny.py's MLP, except that rank 1 (or every rank) raises, or rank 1 hangs, at its third step."""

    def __init__(self, how: str):
        super().__init__()
        from core.kernel.builtin import MLP

        self.inner, self.how, self.calls = MLP(hidden=32, depth=2), how, 0

    def forward(self, x):
        self.calls += self.training
        rank = os.environ.get("RANK")
        if self.calls == 3 and self.how == "raise everywhere":
            raise ValueError(f"rank {rank} {LONG_MESSAGE}")
        if rank == "1" and self.calls == 3:
            if self.how == "hang":
                time.sleep(3600)
            raise ValueError("rank 1 fails on purpose")
        return self.inner(x)


def raises() -> nn.Module:
    return FailsOnRank1("raise")


def raises_everywhere() -> nn.Module:
    return FailsOnRank1("raise everywhere")


def hangs() -> nn.Module:
    return FailsOnRank1("hang")


def slow() -> nn.Module:
    """A factory that takes its time: the pre-check is still building the model when it is stopped. It touches the
    file TDR_TEST_IN_FACTORY names first, so the test knows when it is there."""
    Path(os.environ["TDR_TEST_IN_FACTORY"]).touch()
    time.sleep(120)
    return FailsOnRank1("raise")


def env(**extra: str) -> dict[str, str]:
    tests = str(Path(__file__).parent)
    return user_env(PYTHONPATH=os.pathsep.join([str(REPO), tests]), **extra)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def assert_no_torchrun_report(stderr: str) -> None:
    """None of torchrun's own words: its failure dump, its signal traceback, its log lines."""
    for word in ("ChildFailedError", "SignalException", "torch/distributed/elastic", "Root Cause"):
        assert word not in stderr, stderr[-3000:]


# --- item 11.6: the single-node launcher checks its environment, one line each -------------------------


@pytest.mark.fast
@pytest.mark.parametrize(
    "name, value, fix",
    [
        ("NPROC_PER_NODE", "0", "1 or more"),
        ("NPROC_PER_NODE", "abc", "1 or more"),
        ("NPROC_PER_NODE", "-1", "1 or more"),
        ("MASTER_PORT", "99999", "1..65535"),
        ("MASTER_PORT", "abc", "1..65535"),
        ("MASTER_PORT", "0", "1..65535"),
        ("MAX_RESTARTS", "abc", "0 or more"),
    ],
)
def test_single_node_bad_environment_one_line(name, value, fix):
    proc = run([SINGLE, "--max-steps", "2"], env=env(**{name: value}), check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {name}={value}: use ") and fix in line


@pytest.mark.fast
def test_multi_node_options_alone_mean_ddp():
    """`launch_multi_node.sh --max-steps 2` is ddp (its dry-run passes), so the next check speaks: NPROC_PER_NODE."""
    proc = run([MULTI, "--max-steps", "2"], env=env(NPROC_PER_NODE="0"), check=False, timeout=120)
    assert error_lines(proc.stderr) == ["error: NPROC_PER_NODE=0: use 1 or more processes"], proc.stderr[-2000:]


# --- issue 20, item 2: the machine the launcher runs on, one line with the fix, before torchrun starts -----


def without_torchrun(tmp_path: Path) -> str:
    """A PATH with this python but without torchrun (as where torch's bin/ is not on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(shutil.which("python"))
    return os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"])


@pytest.mark.fast
@pytest.mark.parametrize("launcher", [SINGLE, MULTI], ids=["single", "multi"])
@pytest.mark.parametrize("problem", ["port in use", "no such interface", "no torchrun", "no TMPDIR"])
def test_environment_problem_one_line_before_torchrun(launcher, problem, tmp_path):
    single = launcher == SINGLE
    with socket.create_server(("", 0)) as busy:  # a port something listens on, on every interface, as torchrun would
        port = busy.getsockname()[1]
        if problem == "port in use":
            extra = {"MASTER_PORT": str(port)}
            fix = "machine: pick a free port, or unset MASTER_PORT" if single else "node: pick another port"
            want = f"error: MASTER_PORT={port} is already in use on this {fix}"
        elif problem == "no such interface":
            name = "GLOO_SOCKET_IFNAME" if single else "IFNAME"
            extra, want = {name: "nosuch0"}, f"error: {name}=nosuch0: no interface nosuch0 on this machine (have: "
        elif problem == "no torchrun":
            extra = {"PATH": without_torchrun(tmp_path)}
            want = "error: torchrun is not on PATH: activate the Python environment torch is installed in"
        else:
            extra, want = (
                {"TMPDIR": str(tmp_path / "gone")},
                f"error: TMPDIR={tmp_path / 'gone'} is not a writable folder",
            )
        proc = run([launcher, "--max-steps", "2"], env=env(NPROC_PER_NODE="2", **extra), check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]  # multi: after its "talking over lo" note, where the check needs it
    assert error_lines(proc.stderr) == [last] and last.startswith(want), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.fast
@pytest.mark.parametrize("launcher", [SINGLE, MULTI], ids=["single", "multi"])
def test_a_recipe_file_that_is_not_there_is_one_line_before_torchrun(launcher, tmp_path):
    proc = run([launcher, "nosuch.py", "--max-steps", "2"], cwd=tmp_path, env=env(NPROC_PER_NODE="2"), check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert error_lines(proc.stderr) == [
        "error: nosuch.py: no such file; name a recipe file (python -m recipes cp NAME FILE writes one) or a recipe, "
        "e.g. ddp"
    ]


# --- items 11.6 and 11.11, issue 20 item 1: a rank that raises or hangs ends with one line that says so ------

TINY = ["--epochs", "1", "--max-steps", "20", "--batch-size", "8", "--log-every", "1"]
JOBS = {  # the jobs started side by side: (launcher, recipe and options); all but "copy" fail on purpose
    "single-every-rank": (SINGLE, ["ddp", *TINY, "--model", "test_launchers:raises_everywhere"]),
    "multi-rank1": (MULTI, ["ddp", *TINY, "--model", "test_launchers:raises"]),
    "hangs": (SINGLE, ["ddp", *TINY, "--model", "test_launchers:hangs", "--timeout-s", "10"]),
    # recipes copied out (`cp NAME NAME.py --standalone`): no pre-check, no --dry-run; they train, or say what is wrong
    "copy": (SINGLE, ["ddp.py", *TINY, "--max-steps", "2"]),
    "copy-bad-option": (MULTI, ["ddp.py", *TINY, "--lr", "99"]),
    "dp-copy-on-2": (SINGLE, ["dp.py", *TINY]),  # the launcher starts 2 processes: it cannot tell a dp copy
}


@pytest.fixture(scope="module")
def failed(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """JOBS, started side by side (the hang's wait for --timeout-s overlaps the others' work): each one's exit status
    and stderr, as `run` returns them (its last argument: its runs' folder). Their output goes to files (pipes could
    fill and block them). Each runs in a folder of its own; a copy's holds the lean copy of its recipe (NAME.py)."""
    started = {}
    for key, (launcher, job) in JOBS.items():
        folder = tmp_path_factory.mktemp(key)
        if job[0].endswith(".py"):
            made = CliRunner().invoke(cli, ["cp", job[0].removesuffix(".py"), str(folder / job[0]), "--standalone"])
            assert made.exit_code == 0, made.output
        more = {"NNODES": "1", "MASTER_PORT": str(free_port())} if launcher == MULTI else {}
        args = [launcher, *job, "--out", str(folder / "runs")]
        with open(folder / "stderr", "w") as err:
            proc = subprocess.Popen(args, cwd=folder, env=env(NPROC_PER_NODE="2", **more), stdout=subprocess.DEVNULL,
                                    stderr=err)  # fmt: skip
        started[key] = (args, proc, folder)
    done = {}
    for key, (args, proc, folder) in started.items():
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stderr = (folder / "stderr").read_text(errors="replace")
        done[key] = subprocess.CompletedProcess(args, proc.returncode, "", stderr)
    return done


@pytest.mark.e2e
@pytest.mark.parametrize("launcher", ["single-every-rank", "multi-rank1"])
def test_a_rank_raises_its_traceback_once_and_one_line_names_the_exception(failed, launcher):
    """Single: every rank raises (a loss that fails, say); multi: rank 1 raises and rank 0 loses its connection.
    Either way one traceback, with the user's frame, and one line naming the rank and the exception."""
    proc = failed[launcher]
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert error_lines(proc.stderr) == [last], proc.stderr[-3000:]
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-3000:]
    assert 'test_launchers.py", line' in proc.stderr and "in forward" in proc.stderr  # the user's own frame
    assert_no_torchrun_report(proc.stderr)
    if launcher == "multi-rank1":
        assert last.startswith("error: this node (127.0.0.1) failed: rank 1 raised ValueError: rank 1 fails on purpose")
        assert "lost the connection" not in last
    else:  # whichever rank raised first; its message is longer than a closing line: cut between two words
        said = re.fullmatch(
            r"error: ddp failed: rank (\d) raised ValueError: (rank \d fails on purpose: .*)\.\.\.", last
        )
        assert said and said[2].startswith(f"rank {said[1]} "), last
        words = said[2].split()
        assert words == f"rank {said[1]} {LONG_MESSAGE}".split()[: len(words)], last  # whole words only
        assert f"rank {said[1]} {LONG_MESSAGE}" in proc.stderr  # the traceback keeps the whole message


@pytest.mark.e2e
def test_a_rank_hangs_one_line_says_a_collective_timed_out(failed):
    proc = failed["hangs"]
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ddp failed") and "timed out" in last.lower(), proc.stderr[-3000:]
    assert "rank 1 had not failed" in last and error_lines(proc.stderr) == [last]
    assert "Traceback" not in proc.stderr
    assert_no_torchrun_report(proc.stderr)


@pytest.mark.e2e
def test_the_launchers_run_a_copied_recipe_file_and_its_bad_option_is_one_line(failed):
    """`./launch_single_node.sh train.py ...` (the launchers' usage): a copy has no pre-check and no --dry-run, so the
    launcher starts its ranks at once (it handed them --dry-run: every copy was refused with argparse's line); a bad
    option is the copy's own line, said once, through either launcher, and so is a dp copy started on 2 ranks."""
    trained = failed["copy"]
    assert trained.returncode == 0 and error_lines(trained.stderr) == [], trained.stderr[-3000:]
    (run_dir,) = Path(trained.args[-1]).iterdir()
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["kind"] == "summary" and summary["steps"] == 2 and summary["world_size"] == 2
    assert (run_dir / "model.safetensors").is_file() and (run_dir / "train.log").is_file()
    refused = failed["copy-bad-option"]
    assert refused.returncode == 1 and not Path(refused.args[-1]).exists()
    said = "error: this node (127.0.0.1) failed: --lr 99.0: use 1e-09 to 10"  # the multi-node launcher's words
    assert error_lines(refused.stderr) == [said], refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    one = failed["dp-copy-on-2"]  # refused after init_pg, on both ranks: said once, with how to start one process
    assert one.returncode == 1 and "Traceback" not in one.stderr, one.stderr[-3000:]
    copied = Path(one.args[-1]).parent / "dp.py"  # cp names the file as it was given
    assert error_lines(one.stderr) == [
        f"error: dp.py failed: dp runs in one process, not 2: start one (`python {copied}`, or NPROC_PER_NODE=1 with "
        "a launcher), or use ddp for several"
    ], one.stderr[-3000:]


@pytest.mark.e2e
def test_a_sigterm_during_the_pre_check_ends_it_with_the_launcher_in_one_line(tmp_path):
    """A review find: the launcher died of a SIGTERM sent while its pre-check ran, and left the pre-check running."""
    args = [SINGLE, "ddp", *TINY, "--model", "test_launchers:slow", "--out", str(tmp_path / "runs")]
    in_factory = tmp_path / "in-factory"
    environ = env(NPROC_PER_NODE="2", TDR_TEST_IN_FACTORY=str(in_factory))
    proc = subprocess.Popen(args, env=environ, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while (
        not (checks := [pid for pid in children(proc.pid) if b"--dry-run" in cmdline(pid)]) or not in_factory.exists()
    ):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    # the pre-check is in the factory's sleep now (not merely started: on a busy machine its imports take seconds)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=BOUND_S)
    for _ in range(BOUND_S * 4):  # the pre-check follows its launcher
        if not alive(checks[0]):
            break
        time.sleep(0.25)
    assert not alive(checks[0]), "the pre-check outlived its launcher"
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM)  # the shell itself dies of it
    assert error_lines(err) == ["error: stopped by SIGTERM"], err  # the pre-check's line: no run, no checkpoint


@pytest.mark.e2e
@pytest.mark.skipif(not shutil.which("unshare") or os.geteuid() != 0, reason="needs unshare and root")
def test_the_launcher_as_a_containers_first_process_runs_its_pre_check(tmp_path):
    """`docker run IMAGE ./launch_single_node.sh`: the launcher is PID 1 of its PID namespace. Its pre-check took a
    parent PID of 1 for a launcher already gone and stopped itself ("error: interrupted"): it now knows the
    launcher by the PID the launcher hands it (TDR_DIE_WITH_PARENT=$$)."""
    args = ["unshare", "--pid", "--fork", "--mount-proc", SINGLE, "ddp", "--dry-run", "--out", str(tmp_path / "runs")]
    proc = subprocess.run(args, env=env(NPROC_PER_NODE="2"), capture_output=True, text=True, timeout=BOUND_S * 4)
    assert proc.returncode == 0 and error_lines(proc.stderr) == [], proc.stderr
    assert proc.stdout.count("ok: ddp {") == 1, proc.stdout  # --dry-run: the pre-check is the whole job, no torchrun
    assert proc.stderr.count("plan: largest peak") == 1 and not (tmp_path / "runs").exists(), proc.stderr


# --- the processes of a long run -----------------------------------------------------------------------


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # it ended while we looked
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


LONG = ["ddp", "--model", "tiny:mlp", "--epochs", "1000", "--batch-size", "8", "--log-every", "5"]


class Job:
    """A long launcher run in the background, its output in files (pipes could fill and block it)."""

    def __init__(self, tmp_path: Path, name: str, *args: str, environ: dict | None = None):
        self.out, self.logs = tmp_path / name / "runs", tmp_path / name
        self.logs.mkdir(parents=True)
        self._out, self._err = open(self.logs / "stdout", "w"), open(self.logs / "stderr", "w")
        command = [SINGLE, *LONG, "--ckpt-every", "5", "--out", str(self.out), *args]
        self.proc = subprocess.Popen(
            command, cwd=REPO, env=environ or env(NPROC_PER_NODE="2"), stdout=self._out, stderr=self._err
        )

    @property
    def stdout(self) -> str:
        return (self.logs / "stdout").read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return (self.logs / "stderr").read_text(errors="replace")

    @property
    def agent(self) -> int | None:
        found = [pid for pid in children(self.proc.pid) if b"torchrun" in cmdline(pid)]
        return found[0] if found else None

    def ranks(self) -> dict[str, int]:
        """LOCAL_RANK -> the rank's process (the child of its tools/worker.py, itself torchrun's child)."""
        found = {}
        for worker in children(self.agent or -1):
            try:
                local = re.search(rb"\0LOCAL_RANK=(\d+)\0", b"\0" + (Path(f"/proc/{worker}/environ").read_bytes()))
            except OSError:
                continue
            below = children(worker)
            if local and below:
                found[local[1].decode()] = below[0]
        return found

    def processes(self) -> list[int]:
        """torchrun, its tools/worker.py processes and their ranks."""
        workers = children(self.agent or -1)
        return [self.agent, *workers, *(pid for worker in workers for pid in children(worker))] if self.agent else []

    def wait_for_training(self, *, after: int = 0) -> None:
        """Until two ranks run and a checkpoint past step `after` exists (the recipe writes every 5 steps)."""
        deadline = time.monotonic() + 240
        while not (len(self.ranks()) == 2 and any(step > after for step in self.checkpoints())):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.stderr[-3000:]
            time.sleep(0.2)

    def checkpoints(self) -> list[int]:
        return [int(p.name.split("-")[1].split(".")[0]) for p in self.out.glob("*/ckpt/step-*.safetensors")]

    def wait(self, timeout: float = BOUND_S * 4) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the launcher still ran {timeout}s on (hung)\n{self.stderr[-3000:]}")
        finally:
            self._out.close()
            self._err.close()


@pytest.fixture
def job(tmp_path):
    """job(name, *recipe_args, environ=...): a Job started now; any still running at the end is killed (-9 to its
    launcher: torchrun and the ranks follow it)."""
    started = []

    def start(name: str, *args: str, environ: dict | None = None) -> Job:
        started.append(Job(tmp_path, name, *args, environ=environ))
        return started[-1]

    yield start
    for one in started:
        if one.proc.poll() is None:
            one.proc.kill()
            one.proc.wait(timeout=BOUND_S)


def listening(pids: list[int]) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every TCP socket these processes listen on, from /proc/net/tcp{,6}."""
    inodes = set()
    for pid in pids:
        for fd in (Path("/proc") / str(pid) / "fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host-endian
                found.append((ipaddress.ip_address(raw), int(hexport, 16)))
    return found


def is_loopback(addr) -> bool:
    return addr.is_loopback or (addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback)


def assert_gone(pids: list[int], job: Job) -> None:
    for _ in range(BOUND_S * 4):
        if not any(alive(pid) for pid in pids):
            break
        time.sleep(0.25)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)  # do not leave them to the next test
    assert not left, f"processes {left} outlived their launcher"
    assert not list(job.out.glob("*/model.safetensors"))


# --- items 11.3 and 11.10: no orphans after kill -9, and a single-node job listens on loopback only ------


@pytest.mark.e2e
def test_kill_9_of_the_launcher_or_torchrun_ends_every_rank(job):
    """The launcher killed: torchrun follows it, and the ranks follow torchrun. torchrun killed: the ranks follow it
    (PR_SET_PDEATHSIG, armed by the launcher: tools/worker.py), and the launcher says so."""
    environ = env(NPROC_PER_NODE="2")
    del environ["GLOO_SOCKET_IFNAME"]  # the launcher must keep gloo on loopback by itself
    launcher, torchrun = job("launcher", environ=environ), job("torchrun", environ=environ)
    for one in (launcher, torchrun):
        one.wait_for_training()
    sockets = listening(launcher.processes())
    assert sockets and all(is_loopback(addr) for addr, _ in sockets), sockets
    gone = {one: one.processes() for one in (launcher, torchrun)}
    os.kill(launcher.proc.pid, signal.SIGKILL)
    os.kill(torchrun.agent, signal.SIGKILL)
    launcher.wait(BOUND_S)
    assert torchrun.wait(BOUND_S) == 128 + signal.SIGKILL
    assert torchrun.stderr.strip().splitlines()[-1] == (
        "error: ddp failed: torchrun was killed by SIGKILL, and its ranks ended with it"
    )
    for one, pids in gone.items():
        assert_gone(pids, one)


# --- issue 20, item 3: a stop by signal is one line: the signal, the last step, the checkpoint kept -------


@pytest.mark.e2e
@pytest.mark.slow
def test_a_stop_by_signal_names_the_step_and_checkpoint_and_exits_128_plus_the_signal(job):
    """SIGTERM (a scheduler's preemption), SIGINT (Ctrl-C), SIGHUP, to the launcher or to torchrun: one line each."""
    stops = [("the launcher", signal.SIGTERM), ("torchrun", signal.SIGINT), ("the launcher", signal.SIGHUP)]
    jobs = [job(f"{to.split()[-1]}-{sig.name}") for to, sig in stops]
    for one in jobs:
        one.wait_for_training()
    for one, (to, sig) in zip(jobs, stops, strict=True):
        os.kill(one.proc.pid if to == "the launcher" else one.agent, sig)
    for one, (to, sig) in zip(jobs, stops, strict=True):
        assert one.wait() == 128 + sig, one.stderr[-3000:]
        last = one.stderr.strip().splitlines()[-1]
        assert error_lines(one.stderr) == [last], one.stderr[-3000:]
        said = re.fullmatch(
            rf"error: ddp stopped by {sig.name} \(sent to {to}\) after step (\d+); kept (\S+): "
            r"rerun the same command with --resume auto to continue from it",
            last,
        )
        assert said, last
        kept = Path(said[2])
        assert kept.is_file() and kept.parent.parent.parent == one.out and int(said[1]) >= max(one.checkpoints())
        assert kept.name == f"step-{max(one.checkpoints()):06d}.safetensors"  # the newest
        assert "Traceback" not in one.stderr
        assert_no_torchrun_report(one.stderr)


# --- issue 20, item 3: a rank that dies or hangs is one line, and the restart that follows it --------------


@pytest.mark.e2e
def test_a_rank_killed_or_stopped_is_one_line_then_the_restart_resumes(job):
    """MAX_RESTARTS=1: rank 1 killed with SIGKILL, or stopped with SIGSTOP past --timeout-s: one line naming the rank
    and the signal and the restart; the restarted group resumes from the newest checkpoint and the job exits 0."""
    restart = env(NPROC_PER_NODE="2", MAX_RESTARTS="1")
    # 300 steps (not the 5 epochs' 110): the kill lands in training even when a busy machine sees the checkpoint late
    opts = ["--max-steps", "300", "--epochs", "20", "--resume", "auto", "--timeout-s", "8"]
    killed, stopped = (job(name, *opts, environ=restart) for name in ("killed", "stopped"))
    for one, sig in ((killed, signal.SIGKILL), (stopped, signal.SIGSTOP)):
        one.wait_for_training()
        os.kill(one.ranks()["1"], sig)
    for one, said in (
        (killed, "rank 1 died of SIGKILL, sent by neither the launcher nor torchrun: the OOM killer"),
        (stopped, "rank 1 was stopped (SIGSTOP) and stopped answering: a collective timed out after --timeout-s"),
    ):
        assert one.wait() == 0, one.stderr[-3000:]
        notes = [line for line in one.stderr.splitlines() if line.startswith("launch_single_node: ")]
        assert len(notes) == 1 and re.match(r"launch_single_node: the group failed \(exitcode -?\d+\): ", notes[0])
        assert said in notes[0] and notes[0].endswith("; restarting it (restart 1 of MAX_RESTARTS=1)"), notes
        assert "resumed from" in one.stdout and one.stdout.strip().splitlines()[-1].startswith("summary ")
        assert "Traceback" not in one.stderr and not error_lines(one.stderr)
        assert_no_torchrun_report(one.stderr)


# --- the cause of a failure, from the ranks' ends (tools/supervise.py's explain) ------------------------


def ended(*, error: str | None = None, t: float = 0.0, **end) -> dict:
    """A rank's state as the supervisor keeps it: what it held back (its `error:` line) and how it ended."""
    return {"held": [f"error: {error}"] if error else [], "end": {"t": t, **end}}


@pytest.mark.fast
@pytest.mark.parametrize(
    "line", ["Timed out waiting 20000ms for recv operation to complete", "Application timeout caused pair closure"]
)
def test_a_collective_timeout_is_named_in_either_of_gloos_words(line):
    """gloo says a silent peer's timeout two ways; both are "a collective timed out" (the multi-node launcher says
    "the peer is unreachable"), not "rank 0 exited with code 1"."""
    ranks = {"0": ended(error=f"rank 0: RuntimeError: {line}", code=1)}
    cause, traceback = explain(ranks)
    assert cause.startswith("a collective timed out (") and line[:24] in cause and not traceback, cause
    multi, _ = explain(ranks, this_node="10.0.0.1", peer=lambda: "node 0 at 10.0.0.9")
    assert multi.startswith("no answer from node 0 at 10.0.0.9 ") and "unreachable" in multi, multi


@pytest.mark.fast
def test_a_timeout_beside_a_rank_torchrun_closed_names_node_0_when_it_cannot_be_reached():
    """A review find (a flake of the cut-cable test under load): on the cut node one rank timed out, torchrun closed
    the other before its own timeout, and the line blamed that rank ("had not failed: hung") though node 0 did not
    answer a probe. Node 0 unreachable is said first; where node 0 answers (or is this node), both causes are named."""
    ranks = {
        "2": ended(error="rank 2: RuntimeError: Timed out waiting 20000ms for recv operation to complete", code=1),
        "3": ended(closed_by="torchrun", t=1.0),
    }
    cut = explain(ranks, this_node="10.0.0.2", peer=lambda: "node 0 at 10.0.0.1")[0]
    assert cut.startswith("no answer from node 0 at 10.0.0.1 within 20s (--timeout-s): the peer is unreachable"), cut
    here = explain(ranks, this_node="10.0.0.1")[0]
    assert "rank 3 had not failed: hung, or slower than --timeout-s; or a peer node is unreachable" in here, here
    alone = explain(ranks)[0]  # one node: the rank beside it hung
    assert alone.endswith("while rank 3 had not failed: hung, or slower than --timeout-s"), alone


@pytest.mark.fast
@pytest.mark.parametrize(
    "closed", ["Connection closed by peer [10.0.0.2]:41234", "[10.0.0.2]:41234: Connection reset by peer"]
)
def test_a_connection_closed_by_a_rank_of_this_node_is_not_the_lost_peer(closed):
    """The cut node's rank 2 times out and exits; rank 3, beside it, then loses its connection to rank 2. On that
    node (10.0.0.2) the cause is the timeout: the peer is unreachable. On the other node the same line names a
    lost peer, 10.0.0.2."""
    ranks = {
        "3": ended(error=f"rank 3: RuntimeError: {closed}", code=1, t=2.0),
        "2": ended(error="rank 2: RuntimeError: Timed out waiting 20000ms for recv operation to complete", code=1),
    }
    here = explain(ranks, this_node="10.0.0.2")[0]
    assert here.startswith("no answer from a peer node within 20s (--timeout-s): the peer is unreachable"), here
    there = explain(ranks, this_node="10.0.0.1")[0]
    assert there.startswith("lost the connection to peer 10.0.0.2 ("), there


@pytest.mark.fast
def test_the_rank_that_raised_wins_over_the_ranks_it_took_down():
    traceback = ["Traceback (most recent call last):", '  File "model.py", line 3, in forward', "ValueError: x"]
    for words in (traceback, [*traceback, "error: rank 1: ValueError: x"]):  # as Python prints it; with the rank's line
        ranks = {
            "0": ended(error="rank 0: RuntimeError: [127.0.0.1]:5040: Connection reset by peer", code=1, t=1.0),
            "1": {"held": words, "end": {"code": 1, "t": 2.0}},
            "2": ended(signal=int(signal.SIGTERM), closed_by=int(signal.SIGTERM), t=3.0),
        }
        assert explain(ranks) == ("rank 1 raised ValueError: x", traceback)


@pytest.mark.fast
def test_a_closing_line_is_cut_between_words_and_torchruns_port_error_is_one_line():
    assert shorten("a " * 10, 400) == "a a a a a a a a a a"
    assert shorten("alpha beta gamma delta", 14) == "alpha beta..."
    assert shorten("x" * 30, 10) == "xxxxxxx..."  # one word longer than the line: cut, there is no boundary
    traceback = [
        "Traceback (most recent call last):",
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
        "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
    ]
    assert torchrun_error(traceback) == (
        "port 29500 is already in use on this machine: set MASTER_PORT to a free port (the same on every node)",
        False,
    )


@pytest.mark.fast
def test_a_traceback_a_rank_prints_and_survives_is_shown_after_a_pause(capsys, monkeypatch):
    """Held back while it may end the rank; a rank that goes on (it caught and printed the exception) shows it."""
    watch = Supervisor(what="ddp", note="launch_single_node", max_restarts=0, this_node=None, master=None)
    for line in ("step 1 ok", "Traceback (most recent call last):", '  File "x.py", line 1, in f', "KeyError: 'k'"):
        watch.feed(f"\x1e1\x1f{line}")
    watch.tick()
    assert capsys.readouterr().err == "step 1 ok\n"
    monkeypatch.setattr(tools.supervise, "RELEASE_S", -1.0)  # as if the rank had gone on for a while
    watch.tick()
    assert (
        capsys.readouterr().err == "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nKeyError: 'k'\n"
    )


# --- issue 28 item 5, issue 27 item 7: what the launcher adds to the run's log, and leaves on its disk ----------


@pytest.mark.fast
def test_a_ranks_own_line_is_named_as_it_said_it_and_the_closing_line_ends_train_log(tmp_path, capsys):
    """A full disk on rank 1 (`error: rank 1: RUN: the disk is full ...`) closes the job as that line, not as an
    exception the rank 'raised'; the launcher's own lines go to the end of the run's train.log, which it never
    creates."""
    full = "runs/fsdp-1/ckpt/.step-000002.tmp: the disk is full (0 bytes free); free some space"
    ranks = {"0": ended(signal=int(signal.SIGTERM), closed_by=int(signal.SIGTERM), t=2.0)}
    ranks["1"] = ended(error=f"rank 1: {full}", code=1, t=1.0)
    assert explain(ranks) == (f"rank 1: {full}", [])
    run_dir = tmp_path / "fsdp-1"
    run_dir.mkdir()
    watch = Supervisor(what="fsdp", note="launch_single_node", max_restarts=0, this_node=None, master=None)
    watch.feed(f"\x1e0\x1frun folder {run_dir}")
    watch.own("error: fsdp failed: x")  # no train.log: the run took its folder back, or never opened it
    assert not (run_dir / "train.log").exists()
    (run_dir / "train.log").write_text("2026-01-01 00:00:00.000 | INFO    | rank 0 | step 1/4\n")
    watch.own("error: fsdp failed: y")
    last = (run_dir / "train.log").read_text().splitlines()[-1]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \| ERROR   \| launcher \| error: fsdp failed: y", last)
    assert capsys.readouterr().err.splitlines()[-1] == "error: fsdp failed: y"


@pytest.mark.fast
def test_what_a_killed_write_left_is_removed_once_its_process_is_gone(tmp_path):
    """Issue 27 item 7: a rank killed during the first checkpoint's write left its partial file in the run that
    --resume auto then passes over (no checkpoint) for a new one."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / "ckpt").mkdir()
    dead = [tmp_path / "ckpt" / f".step-000002.safetensors.tmp-{gone.pid}", tmp_path / f".hf.tmp-{gone.pid}"]
    dead[0].write_bytes(b"half")
    dead[1].mkdir()
    live = tmp_path / "ckpt" / f".step-000004.safetensors.tmp-{os.getpid()}"  # still being written
    live.write_bytes(b"half")
    assert sorted(tools.supervise.remove_temporaries(tmp_path)) == sorted(dead) and live.exists()


@pytest.mark.e2e
def test_bare_torchrun_prints_an_error_every_rank_meets_once(tmp_path):
    """Without the launcher nothing gathers the ranks' lines: rank 0 alone says an error every rank meets."""
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not on PATH")
    args = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "recipes", "run", "ddp", *TINY]
    args += ["--model", "tiny:mlp", "--resume", str(tmp_path / "none.safetensors"), "--out", str(tmp_path / "runs")]
    proc = run(args, env=env(), check=False, timeout=120)
    assert proc.returncode == 1
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"error: --resume {tmp_path / 'none.safetensors'}: no such checkpoint file")
