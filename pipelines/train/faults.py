"""Test hook for the resume tests: ``$DFLASH_FAIL_AT_STEP`` (with ``$DFLASH_FAIL_MARKER``)
makes the rank-0 training worker exit once at that step, as a killed worker would; the
marker file lets the restarted worker live on. Off unless both are set."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class FaultInjector:
    step: int = 0  # 0: never
    marker: str | None = None

    @classmethod
    def from_env(cls, rank: int) -> "FaultInjector":
        if rank != 0:
            return cls()
        return cls(int(os.environ.get("DFLASH_FAIL_AT_STEP", "0") or 0), os.environ.get("DFLASH_FAIL_MARKER"))

    def after_step(self, step: int) -> None:
        if not (self.step and step == self.step and self.marker) or os.path.exists(self.marker):
            return
        Path(self.marker).write_text(str(os.getpid()))
        log.warning("[train] DFLASH_FAIL_AT_STEP reached: worker %d exits", os.getpid())
        os._exit(1)
