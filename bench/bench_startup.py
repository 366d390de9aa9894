"""What a user waits for before anything trains: importing the package and the commands that only read.

    python bench/bench_startup.py               # 7 interleaved repeats, ~1 minute

Each command is a fresh `python` process, timed wall-clock from start to exit; the commands take
turns, repeat after repeat, so a noisy machine slows them alike. Printed: the median seconds and
the ratio to `python -c "import torch"` measured in the same run (the goal: `import recipes` and
`python -m recipes ls` at most 1.2x; a recipe's --help imports torch and that recipe only).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "import recipes": [sys.executable, "-c", "import recipes"],
    "python -m recipes ls": [sys.executable, "-m", "recipes", "ls"],
    "run ddp --help": [sys.executable, "-m", "recipes", "run", "ddp", "--help"],
    "run fsdp --help": [sys.executable, "-m", "recipes", "run", "fsdp", "--help"],
    "run ddp --dry-run": [sys.executable, "-m", "recipes", "run", "ddp", "--dry-run"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for repeat in range(args.repeats):
        names = list(COMMANDS)[repeat % len(COMMANDS) :] + list(COMMANDS)[: repeat % len(COMMANDS)]  # rotate
        for name in names:
            started = time.perf_counter()
            subprocess.run(COMMANDS[name], cwd=REPO, check=True, capture_output=True)
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times["import torch"])
    print(f"{'command':<24} {'median s':>9} {'x import torch':>15}")
    for name, values in times.items():
        print(f"{name:<24} {statistics.median(values):>9.3f} {statistics.median(values) / base:>15.2f}")


if __name__ == "__main__":
    main()
