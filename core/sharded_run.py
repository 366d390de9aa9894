"""ShardedRun: a Run whose checkpoints are sharded, for models no rank holds whole.

    with ShardedRun.start(cfg, topo, recipe="fsdp", global_batch=..., mesh=...) as run:

DTensor models (fully_shard, tensor parallel) and pipeline stages save through core.dcp: every
rank writes its own shard into ckpt/step-N/, so no rank gathers the model to save it, and an
fsdp run resumes at another world size. A model that turns out not to be sharded (a world of
one with a plain model) still gets ddp's one-file checkpoint; a one-file checkpoint resumes too.
"""

from __future__ import annotations

from pathlib import Path

from core import ckpt, dcp
from core.run import Run


class ShardedRun(Run):
    @staticmethod
    def newest_checkpoint(run_dir: Path) -> Path | None:
        return ckpt.newest_good(run_dir / "ckpt") or dcp.latest_sharded(run_dir)

    @staticmethod
    def checkpoint_header(path: Path) -> dict[str, str]:
        if path.is_dir():  # checkpoint.json: what the shards were saved with
            found = dcp.check_sharded(path)
            return {**found["metadata"], "world_size": str(found["world_size"])}
        return Run.checkpoint_header(path)

    def _load(self, **state) -> dict:
        if self.resume_from.is_dir():  # every rank reads its own part, resharded to this mesh
            return dcp.load_sharded(self.resume_from, **state)
        return super()._load(**state)

    def _save(self, *, model, progress: dict, metadata: dict, **state) -> None:
        if ckpt.sharded(model):
            dcp.save_sharded(
                self.run_dir / "ckpt", model=model, progress=progress, keep=self.cfg.keep, metadata=metadata, **state
            )
        else:
            super()._save(model=model, progress=progress, metadata=metadata, **state)
