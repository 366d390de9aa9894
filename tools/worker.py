"""One rank under the launchers: torchrun starts this file (--no-python), and it starts the rank.

    torchrun --no-python ... python tools/worker.py python -m recipes run ddp --epochs 3

It ties the rank's life to torchrun's, passes on torchrun's closing signals, and tags the rank's stderr lines and its
start, stop and end for tools/supervise.py (docs/multinode.md). Standard library only: it starts before every rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

LINE, EVENT = "\x1f", "\x1d"  # "\x1e" RANK LINE text, or "\x1e" RANK EVENT json (started, stopped, ended)
CLOSING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # what torchrun closes a group with


def die_with_parent(signum: int, *, parent: int) -> None:
    """Have the kernel send `signum` to this process when `parent` (the thread that started it) exits."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signum), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent or parent == 1:  # it died before prctl: no signal would ever come
        os.kill(os.getpid(), signum)


def send(rank: str, kind: str, text: str) -> None:
    """One tagged line in one write (atomic on a pipe up to 4 KiB): lines of several ranks never mix."""
    with contextlib.suppress(OSError):  # the supervisor is gone: keep draining the rank's pipe all the same
        os.write(2, f"\x1e{rank}{kind}{text}\n".encode(errors="replace"))


def relay(pipe, rank: str) -> None:
    """Copy the rank's stderr to ours, line by line, each tagged with the rank."""
    for raw in iter(pipe.readline, b""):
        send(rank, LINE, raw.decode(errors="replace").rstrip("\r\n"))


def supervise(argv: list[str], *, rank: str) -> tuple[int, dict]:
    """Run the rank to its end; returns its wait status and what happened to it."""
    me = os.getpid()
    state = {"closed_by": None, "stopped": None, "stopped_when_closed": None, "ended": False}
    child = subprocess.Popen(
        argv,
        stderr=subprocess.PIPE,
        process_group=0,  # torchrun's signals reach this process only: each gets to the rank exactly once, below
        preexec_fn=lambda: die_with_parent(signal.SIGKILL, parent=me),  # we die only after the rank, or by SIGKILL
    )

    def on_closing(signum, _frame) -> None:
        if state["closed_by"] is None:
            state["closed_by"], state["stopped_when_closed"] = signum, state["stopped"]
        if not state["ended"]:  # reaped: its group id may be another's by now
            for sig in (signum, signal.SIGCONT):  # a stopped rank acts on it now, not never
                with contextlib.suppress(ProcessLookupError):  # the rank and what it started, as torchrun would
                    os.killpg(child.pid, sig)

    for signum in CLOSING:
        signal.signal(signum, on_closing)
    send(rank, EVENT, json.dumps({"event": "started", "pid": child.pid, "t": time.time()}))
    reader = threading.Thread(target=relay, args=(child.stderr, rank), daemon=True)
    reader.start()
    while True:
        _, status = os.waitpid(child.pid, os.WUNTRACED | os.WCONTINUED)
        if os.WIFSTOPPED(status):
            state["stopped"] = os.WSTOPSIG(status)
            send(rank, EVENT, json.dumps({"event": "stopped", "signal": state["stopped"], "t": time.time()}))
        elif os.WIFCONTINUED(status):
            state["stopped"] = None
        else:
            state["ended"] = True
            break
    reader.join(timeout=2)  # a process the rank started may still hold its stderr open
    return status, state


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python tools/worker.py PROGRAM [ARGS...] (started by the launchers' torchrun)")
    die_with_parent(signal.SIGTERM, parent=os.getppid())  # passed on to the rank, as any closing signal
    rank = os.environ.get("RANK", "?")
    status, state = supervise(argv, rank=rank)
    code = os.waitstatus_to_exitcode(status)
    ended = {
        "event": "ended",
        "local_rank": os.environ.get("LOCAL_RANK"),
        "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
        "code": code if code >= 0 else None,
        "signal": -code if code < 0 else None,
        "closed_by": state["closed_by"],
        "stopped": state["stopped_when_closed"] or state["stopped"],
        "t": time.time(),
    }
    send(rank, EVENT, json.dumps(ended))
    if code < 0:  # end as the rank ended, so that torchrun reports what it would have reported
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv[1:])
