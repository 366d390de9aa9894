"""Logging per rank with loguru: every line says which rank wrote it.

Rank 0 logs INFO and up (the job's story); the other ranks only WARNING and up, so a
problem on any rank is seen while N copies of the same progress line are not.
"""

from __future__ import annotations

import sys

from loguru import logger


def setup_logging(rank: int, *, level: str = "INFO", sink=None):
    """Configure loguru for this process and return the logger."""
    logger.remove()
    logger.configure(extra={"rank": rank})
    logger.add(
        sink or sys.stderr,
        level=level if rank == 0 else "WARNING",
        format="[rank {extra[rank]}] {time:HH:mm:ss} {level: <7} {message}",
        colorize=False,
    )
    return logger
