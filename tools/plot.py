"""`python -m recipes plot RUN_DIR [RUN_DIR...] -o out.png`: loss, validation accuracy and throughput
against step, one line per run, from each run's metrics.jsonl (headless: matplotlib's Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path

from core.kernel.job import RecipeError

PANELS = (
    ("train", "loss", "train loss"),
    ("eval", "val_acc", "validation accuracy"),
    ("train", "samples_per_s", "throughput (samples/s, or tokens/s)"),
)


def read_records(run_dir: str | Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl (a torn last line, from a crash mid-write, is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise RecipeError(f"{run_dir}: no metrics.jsonl there; pass a run folder such as runs/ddp-1")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def series(records: list[dict], kind: str, key: str) -> tuple[str, list[float], list[float]]:
    """(the key read, steps, values) of `key` in the records of `kind`; tokens/s stands in for samples/s if logged."""
    if key == "samples_per_s" and any("tokens_per_s" in r for r in records):
        key = "tokens_per_s"
    points = [(r["step"], r[key]) for r in records if r.get("kind") == kind and key in r and "step" in r]
    return key, [p[0] for p in points], [p[1] for p in points]


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Write a PNG with one panel per metric and one line per run; returns its path."""
    try:
        import matplotlib
    except ImportError:
        raise RecipeError("plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot as plt

    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if Path(out).suffix.lstrip(".").lower() not in formats:  # before any folder is made or record read
        raise RecipeError(
            f"-o {out}: matplotlib cannot write {Path(out).suffix or 'a file without a suffix'}; use .png, .svg or .pdf"
        )
    names = [Path(d).name for d in run_dirs]
    names = names if len(set(names)) == len(names) else [str(d) for d in run_dirs]  # runs/ddp-1 vs old/ddp-1
    runs = {name: read_records(d) for name, d in zip(names, run_dirs)}
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4), constrained_layout=True)
    for ax, (kind, key, title) in zip(axes, PANELS):
        for name, records in runs.items():
            read, steps, values = series(records, kind, key)
            if steps:
                label = f"{name} (tokens/s)" if read == "tokens_per_s" else name
                ax.plot(steps, values, marker="o" if len(steps) < 20 else None, label=label)
        ax.set(title=title, xlabel="step")
        if ax.get_legend_handles_labels()[0]:  # a panel with no data (no eval records) gets no legend
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
