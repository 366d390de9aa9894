"""The launchers' last step: run torchrun, and end the run with one line that says how it ended.

    exec python tools/supervise.py --what ddp --note launch_single_node [--max-restarts N] [--remove DIR]
        [--this-node IP --master IP:PORT] -- torchrun ARGS... python tools/worker.py python -m recipes run ...

Standard library only; docs/multinode.md ("How the launchers know") tells what it holds back and what it says.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

RELEASE_S = 3.0  # a held traceback not followed by the rank's end or `error:` line within this is shown as it is
LIMIT = 400  # characters of a cause in the closing line
GRACE_S = 10.0  # how long after torchrun's end the ranks' last words may still come
CLOSING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
GLOG = re.compile(r"[IWEC]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] (.*)")  # torchrun's own log lines
FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
RECEIVED = re.compile(r"Received (\d+) death signal")
QUIET = ("Sending process", "Unable to shutdown process", "did not exit after", "failed (exitcode")
TAGGED = re.compile(r"\x1e([^\x1f\x1d]*)([\x1f\x1d])(.*)", re.S)
EXCEPTION = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)):? ?(.*)")
SYMPTOM = re.compile(  # a rank's error that only follows from another's failure: a peer gone, a collective timed out
    r"DistNetworkError|DistStoreError|Connection (reset|closed|refused)|Broken pipe|[Tt]imed out|Socket Timeout"
    r"|pair closure|[Ww]atchdog caught collective operation timeout"
)
TIMEOUT = re.compile(
    r"Timed out waiting \d+ms for (send|recv)|Application timeout caused pair closure"
    r"|[Ww]atchdog caught collective operation timeout|hang-rank\d+\.txt"
)
LOST = re.compile(
    r"(Connection (reset|closed|refused)[a-z ]*|Broken pipe)[^\[]*\[([0-9a-f.:]+)\]"
    r"|\[([0-9a-f.:]+)\]:\d+: (Connection (reset|closed|refused)[a-z ]*|Broken pipe)"
)
CKPT = re.compile(r"step-(\d+)(\.safetensors)?")
TEMPORARY = re.compile(r"\..+\.tmp-(\d+)")  # the kernel's write_tensors, the hf plug-in's folder: .NAME.tmp-PID


def signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def shorten(text: str, limit: int = LIMIT) -> str:
    """`text`, or its first words and "..." when longer than `limit`: never cut inside a word."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    head = text[: limit - 3].rsplit(" ", 1)[0]  # no space in it: all of it
    return head.rstrip(" ,;:") + "..."


def last_words(held: list[str]) -> tuple[str | None, list[str]]:
    """A rank's held lines as (what ended it, the traceback above): its last `error:` line, else its exception."""
    for i in range(len(held) - 1, -1, -1):
        if held[i].startswith("error: "):
            return held[i][len("error: ") :], held[:i]
    return final_exception(held), held


def final_exception(lines: list[str]) -> str | None:
    """`Type: message` (on one line) of the last traceback in `lines`, or None when there is none."""
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")), default=None)
    if start is None:
        return None
    rest = lines[start + 1 :]
    at = next((i for i, line in enumerate(rest) if line.strip() and not line.startswith((" ", "\t"))), None)
    if at is None:
        return None
    text = " ".join(line.strip() for line in rest[at:] if line.strip())
    return re.sub(r"^[\w.]+\.(\w+)(?=:|$)", r"\1", text)  # torch.distributed.DistBackendError: DistBackendError


def fate(rank: str, state: dict) -> tuple[str, str, list[str]]:
    """How one rank ended: (kind: raised, killed, stopped, vanished, symptom, silent or ok; a line; its traceback)."""
    end = state["end"] or {}
    if state["end"] is not None and end.get("code") == 0:
        return "ok", "", []
    error, traceback = last_words(state["held"])
    if error is None and state.get("released") and end.get("code") and not end.get("closed_by"):
        # it printed its traceback, then took a while to exit (shown already): that exception ended it
        error, traceback = final_exception(state["released"]), []
    said = error and re.fullmatch(r"rank \d+: (.*)", error)  # a rank's uncaught exception: `error: rank R: ...`
    if said and not EXCEPTION.fullmatch(said[1]):  # a line of its own (a full disk): as the rank said it
        error = f"rank {rank}: {said[1]}"
    elif said or (error and EXCEPTION.fullmatch(error)):
        error = f"rank {rank} raised {said[1] if said else error}"
    if error:  # else a one-line error every rank prints alike (core's RecipeError): as it is
        return "symptom" if SYMPTOM.search(error) else "raised", error, traceback
    if state["end"] is None:  # tools/worker.py reports every end it lives to see: it was killed too
        return "vanished", f"rank {rank} was killed together with the tools/worker.py that ran it (SIGKILL?)", []
    if end.get("signal") and not end.get("closed_by"):
        native = end["signal"] in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)
        why = "a crash in native code" if native else "sent by another process, not by torchrun"
        if end["signal"] == signal.SIGKILL:
            why = "sent by neither the launcher nor torchrun: the OOM killer (see dmesg) or a kill -9"
        return "killed", f"rank {rank} died of {signame(end['signal'])}, {why}", []
    if end.get("stopped"):
        return "stopped", f"rank {rank} was stopped ({signame(end['stopped'])}) and stopped answering", []
    if end.get("closed_by"):
        return "silent", f"rank {rank}", []
    if end.get("code"):
        return "raised", f"rank {rank} exited with code {end['code']} without an error message", traceback
    return "ok", "", []


def explain(
    ranks: dict[str, dict], *, this_node: str | None = None, peer: Callable[[], str] = lambda: "a peer node"
) -> tuple[str | None, list[str]]:
    """Why a group failed: (one line, the traceback to show), or (None, []); `peer()` may probe: asked on a timeout."""
    order = sorted(ranks, key=lambda r: ((ranks[r]["end"] or {}).get("t", math.inf), int(r) if r.isdigit() else 0))
    fates = {r: fate(r, ranks[r]) for r in order}
    symptoms = [fates[r][1] for r in order if fates[r][0] == "symptom"]
    timeout = next((m[0] for m in map(TIMEOUT.search, symptoms) if m), None)
    for kind in ("raised", "killed", "stopped", "vanished"):
        first = next((r for r in order if fates[r][0] == kind), None)
        if first is not None:
            _, line, traceback = fates[first]
            if kind == "stopped" and timeout:
                line += f": a collective timed out after --timeout-s ({timeout})"
            return line, traceback
    if this_node is not None and (lost := lost_peer(symptoms, this_node=this_node)):
        return lost, []
    silent = [r for r in order if fates[r][0] == "silent"]
    reached = peer() if timeout and this_node is not None else None  # multi-node: does node 0 answer a probe?
    if timeout and silent and reached in (None, "a peer node"):  # a rank here did not fail: it hung, or it waited
        who = f"rank {silent[0]} had" if len(silent) == 1 else f"ranks {', '.join(silent)} had"
        also = "; or a peer node is unreachable (network down?)" if reached else ""
        return f"a collective timed out ({timeout}) while {who} not failed: hung, or slower than --timeout-s{also}", []
    if reached:
        seconds = re.search(r"(\d+)ms", timeout)
        within = f"within {int(seconds[1]) // 1000}s " if seconds else ""
        unreachable = "the peer is unreachable (network down?) or stuck; see its log"
        return f"no answer from {reached} {within}(--timeout-s): {unreachable}", []
    if timeout:
        return f"a collective timed out ({timeout}): a rank hung or stopped answering within --timeout-s", []
    if symptoms:
        first = next(r for r in order if fates[r][0] == "symptom")
        return fates[first][1], fates[first][2]
    return None, []


def lost_peer(errors: list[str], *, this_node: str) -> str | None:
    """The first peer on another node whose connection a rank lost, as a line; None if there is none."""
    for error in errors:
        for match in LOST.finditer(error):
            address = match[3] or match[4]
            if address != this_node:
                what = re.search(r"Connection [a-z]+( by peer)?|Broken pipe", match[0])[0]
                why = "that node stopped or the network to it failed; see its log"
                return f"lost the connection to peer {address} ({what}): {why}"
    return None


def progress(run_dir: Path) -> tuple[int | None, Path | None]:
    """The last step the run folder records (train records, checkpoints), and its newest checkpoint."""
    step = None
    with contextlib.suppress(OSError), open(run_dir / "metrics.jsonl", "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))  # the last records are enough
        for raw in f.read().splitlines():
            try:
                record = json.loads(raw)
            except ValueError:  # the first, cut, or a torn last line
                continue
            if record.get("kind") == "train":
                step = record.get("step")
    saved = []
    with contextlib.suppress(OSError):  # no ckpt folder yet
        saved = [(int(m[1]), p) for p in (run_dir / "ckpt").iterdir() if (m := CKPT.fullmatch(p.name))]
    newest = max(saved, default=None)
    if newest is not None and (step is None or newest[0] > step):
        step = newest[0]
    return step, newest[1] if newest else None


def stop_line(what: str, signum: int, *, sent_to: str, run_dir: str | None, multi_node: bool) -> str:
    """The closing line of a run stopped by `signum`: where it stopped, the checkpoint kept, how to go on."""
    head = f"error: {what} stopped by {signame(signum)} (sent to {sent_to})"
    if run_dir is None and multi_node:  # rank 0, which tells the run folder, may be on another node
        return f"{head}; checkpoints already written are kept on rank 0's node: rerun with --resume auto to continue"
    if run_dir is None:  # rank 0 names the run folder before it builds the model
        return f"{head} before training began"
    step, newest = progress(Path(run_dir))
    at = f" after step {step}" if step else ""
    if newest is None:
        return (
            f"{head}{at}; no checkpoint was written yet (--ckpt-every N writes one every N steps): a rerun starts over"
        )
    return f"{head}{at}; kept {newest}: rerun the same command with --resume auto to continue from it"


def torchrun_error(traceback: list[str]) -> tuple[str, bool]:
    """torchrun's own failure as a line, and whether its traceback is worth showing (not for the known ones)."""
    text = "\n".join(traceback)
    if "EADDRINUSE" in text or "address already in use" in text:
        port = re.search(r"port: (\d+)", text)
        where = f"port {port[1]}" if port else "the rendezvous port"
        fix = "set MASTER_PORT to a free port (the same on every node)"
        return f"{where} is already in use on this machine: {fix}", False
    exceptions = [m for m in map(EXCEPTION.fullmatch, traceback) if m]
    if not exceptions:
        return "torchrun failed; see its report above", True
    name, message = exceptions[-1][1].rsplit(".", 1)[-1], exceptions[-1][2]
    return f"torchrun failed: {name}: {message}" if message else f"torchrun failed: {name}", True


def say(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # nobody reads our stderr any more: the run goes on regardless
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def log_line(run_dir: str | None, text: str, *, level: str) -> None:
    """Append a line of the launcher's to RUN/train.log, in the log's own form, if the run opened one."""
    if run_dir is None:
        return
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
    with contextlib.suppress(OSError):  # no log the run opened (no O_CREAT), or a full disk: the terminal has the line
        with os.fdopen(os.open(Path(run_dir) / "train.log", os.O_WRONLY | os.O_APPEND), "ab", buffering=0) as log:
            log.write(f"{stamp} | {level:<7} | launcher | {text}\n".encode())


def remove_temporaries(run_dir: Path) -> list[Path]:
    """Delete what a killed write left in run_dir and run_dir/ckpt (a sharded save's step-N/: its next save does)."""
    removed = []
    for folder in (run_dir, run_dir / "ckpt"):
        try:
            found = list(folder.iterdir())
        except OSError:
            continue
        for path in found:
            pid = TEMPORARY.fullmatch(path.name)
            if pid and not alive(int(pid[1])):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Supervisor:
    """What torchrun's stderr has told so far, and what to print."""

    def __init__(self, *, what: str, note: str, max_restarts: int, this_node: str | None, master: str | None):
        self.what, self.note, self.max_restarts = what, note, max_restarts
        self.this_node, self.master = this_node, master
        self.ranks: dict[str, dict] = {}
        self.failures, self.shown, self.cause = 0, None, None
        self.stop = self.torchrun_signal = None  # a signal sent to us (and passed on), or to torchrun itself
        self.traceback: list[str] | None = None  # torchrun's own, when it ends by an exception
        self.run_dir: str | None = None

    def feed(self, line: str) -> None:
        if tagged := TAGGED.match(line):  # a rank's line or event, from tools/worker.py
            rank, kind, text = tagged.groups()
            if kind == "\x1f":
                self.rank_line(rank, text)
            else:
                try:
                    self.rank_event(rank, json.loads(text))
                except ValueError:  # torn: longer than a pipe writes at once, and mixed with another's line
                    say(text)
        else:
            self.torchrun_line(line)

    def rank(self, rank: str) -> dict:
        state = self.ranks.get(rank)
        if state is None or state["end"] is not None:  # a rank of a new group (torchrun restarted it)
            state = self.ranks[rank] = {"held": [], "held_t": 0.0, "blank": 0, "end": None, "released": []}
        return state

    def rank_line(self, rank: str, text: str) -> None:
        state = self.rank(rank)
        if text.startswith("run folder "):
            self.run_dir = text[len("run folder ") :]
        if state["held"] or text.startswith(("Traceback (most recent call last):", "error: ")):
            state["held"] += [""] * state["blank"] + [text]
            state["held_t"] = time.monotonic()
        elif text.strip():
            for shown in [""] * state["blank"] + [text]:
                say(shown)
        else:  # shown with the next line, unless that starts a held block (a KeyboardInterrupt's blank line)
            state["blank"] += 1
            return
        state["blank"] = 0

    def rank_event(self, rank: str, event: dict) -> None:
        state = self.rank(rank)  # "started": a rank of this group, even one that never writes a line
        if event.get("event") == "ended":
            state["end"] = event

    def torchrun_line(self, line: str) -> None:
        if self.traceback is not None:  # after its traceback torchrun prints only its report: ours replaces it
            self.traceback.append(line)
            return
        logged = GLOG.fullmatch(line)
        if logged and (failed := FAILED.search(logged[1])):
            self.group_failed(int(failed[1]), failed[2])
        elif logged and (received := RECEIVED.search(logged[1])):
            self.torchrun_signal = self.torchrun_signal or int(received[1])
        elif line.startswith("Traceback (most recent call last):"):
            self.traceback = [line]
        elif not (logged and any(quiet in logged[1] for quiet in QUIET)):
            say(line)

    def tick(self) -> None:
        """Release what a rank holds that turned out not to end it: a traceback it caught and printed."""
        now = time.monotonic()
        for state in self.ranks.values():
            held = state["held"]
            said = any(text.startswith("error: ") for text in held)  # the rank's last line: it is ending
            if held and state["end"] is None and now - state["held_t"] > RELEASE_S and not said:
                for text in held:
                    say(text)
                state["released"] = list(held)
                held.clear()

    def group_failed(self, exitcode: int, local_rank: str) -> None:
        """torchrun saw the group fail, after every rank of it ended: say why, once; note a restart."""
        self.failures += 1
        cause, traceback = explain(self.ranks, this_node=self.this_node, peer=self.peer)
        if cause is None:
            how = f"died of {signame(-exitcode)}" if exitcode < 0 else f"exited with code {exitcode}"
            cause = f"local rank {local_rank} {how}"
        if traceback and cause != self.shown and self.stop is None:
            for text in traceback:
                self.own(text)
            self.shown = cause
        self.ranks = {}
        if self.failures <= self.max_restarts and self.stop is None and self.torchrun_signal is None:
            restart = f"restart {self.failures} of MAX_RESTARTS={self.max_restarts}"
            failed = f"the group failed (exitcode {exitcode}): {shorten(cause)}"
            self.own(f"{self.note}: {failed}; restarting it ({restart})")
        else:
            self.cause = cause

    def peer(self) -> str:
        """Who a timed-out collective waited for: node 0 when this node cannot reach it, else a peer node."""
        if self.master is None or self.master.rsplit(":", 1)[0] == self.this_node:
            return "a peer node"
        host, port = self.master.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
            return "a peer node"
        except OSError:
            return f"node 0 at {host}"

    def finish(self, returncode: int) -> int:
        """The closing line, once torchrun has ended with `returncode`; returns this launcher's exit status."""
        stopped = self.stop or self.torchrun_signal or signal_in(self.traceback)
        if returncode == 0:
            for state in self.ranks.values():  # nothing failed: what a rank held was no failure either
                for text in state["held"]:
                    say(text)
            return 0
        if stopped:
            sent_to, multi_node = "the launcher" if self.stop else "torchrun", bool(self.this_node)
            self.own(stop_line(self.what, stopped, sent_to=sent_to, run_dir=self.run_dir, multi_node=multi_node))
            return 128 + stopped
        if returncode < 0:
            killed = f"torchrun was killed by {signame(-returncode)}, and its ranks ended with it"
            self.own(f"error: {self.what} failed: {killed}")
            return 128 - returncode
        cause = self.cause
        if cause is None and self.traceback:
            cause, show = torchrun_error(self.traceback)
            if show:
                for text in self.traceback:
                    self.own(text)
        if cause is None:
            cause = explain(self.ranks, this_node=self.this_node, peer=self.peer)[0]
        self.own(f"error: {self.what} failed: {shorten(cause or f'torchrun exited with code {returncode}')}")
        return returncode

    def own(self, text: str) -> None:
        """A line of the launcher's own: on stderr, and at the end of the run's train.log."""
        say(text)
        level = "ERROR" if text.startswith(("error: ", "Traceback", " ")) or EXCEPTION.fullmatch(text) else "WARNING"
        log_line(self.run_dir, text, level=level)


def signal_in(traceback: list[str] | None) -> int | None:
    """The signal torchrun's closing SignalException names, if that is how it ended."""
    match = re.search(r"SignalException: Process \d+ got signal: (\d+)", "\n".join(traceback or []))
    return int(match[1]) if match else None


def start_torchrun(command: list[str]) -> subprocess.Popen:
    """torchrun in a process group of its own (our signals reach it once, from us), dying with this process."""
    me = os.getpid()

    def die_with_us() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != me:
            os.kill(os.getpid(), signal.SIGTERM)

    return subprocess.Popen(command, stderr=subprocess.PIPE, process_group=0, preexec_fn=die_with_us)


def pump(fd: int, feed: Callable[[str], None], tick: Callable[[], None], *, until: Callable[[], bool]) -> None:
    """feed(line) for every line read from `fd` until its end or until(), and tick() at least twice a second."""
    pending = b""
    while not until():
        ready, _, _ = select.select([fd], [], [], 0.5)
        chunk = os.read(fd, 65536) if ready else None
        if chunk == b"":
            break
        if chunk:
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                feed(raw.decode(errors="replace"))
        tick()
    if pending:
        feed(pending.decode(errors="replace"))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tools/supervise.py", description=__doc__.split("\n")[0])
    parser.add_argument("--what", required=True, help="what the closing line names: the recipe, or this node")
    parser.add_argument("--note", required=True, help="the prefix of notes (the launcher's name)")
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--this-node", help="this node's address (multi-node)")
    parser.add_argument("--master", help="MASTER_ADDR:MASTER_PORT (multi-node)")
    parser.add_argument("--remove", help="a folder of the launcher's to remove at the end")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- torchrun ARGS...")
    opts = parser.parse_args(argv)
    opts.command = opts.command[1:] if opts.command[:1] == ["--"] else opts.command
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(sys.argv[1:] if argv is None else argv)
    watch = Supervisor(
        what=opts.what, note=opts.note, max_restarts=opts.max_restarts, this_node=opts.this_node, master=opts.master
    )
    try:
        torchrun = start_torchrun(opts.command)
    except OSError as err:
        say(f"error: cannot start {opts.command[0]}: {err.strerror or err}")
        return 127

    def on_signal(signum: int, _frame) -> None:
        if watch.stop is None:
            watch.stop = signum
            torchrun.send_signal(signum)  # torchrun stops the ranks
        else:
            torchrun.kill()  # a second one: no more waiting (the ranks die with torchrun)

    for signum in CLOSING:
        signal.signal(signum, on_signal)
    ended = []  # when torchrun was first seen ended

    def torchrun_gone_a_while() -> bool:  # a rank that outlives it (deaf to SIGTERM) holds the pipe open: go on
        if torchrun.poll() is not None and not ended:
            ended.append(time.monotonic())
        return bool(ended) and time.monotonic() - ended[0] > GRACE_S

    try:
        pump(torchrun.stderr.fileno(), watch.feed, watch.tick, until=torchrun_gone_a_while)
        code = watch.finish(torchrun.wait())
        if code and watch.run_dir is not None:  # the job ended: no write of its own is in flight on this node
            remove_temporaries(Path(watch.run_dir))
        return code
    finally:
        if opts.remove:
            shutil.rmtree(opts.remove, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
