"""``transport: local``: one file per version in shared memory (``path``, default
``/dev/shm/rlstream-<uid>``, this user's own, 0700) on the learner's machine, read in place by producers on that machine.
The announcement names the machine (``host``); a producer elsewhere refuses it at once. The
learner's snapshot is serialised straight into the file (no copy in memory first), and the
run's versions are removed at the learner's clean exit, since they would hold RAM until the
machine restarts."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rlstream.broker.layout import Layout
from rlstream.broker.weights import host_id
from rlstream.config import LocalWeights
from rlstream.schemas import WeightsAnnouncement
from rlstream.weights.base import Version, WeightsRefused, where
from rlstream.weights.folders import FolderTransport, StagedFile


class LocalTransport(FolderTransport):
    name = "local"
    durable = False
    default_settings = LocalWeights

    def staging(self, run: str, version: int) -> StagedFile | None:
        return self.staged(run, version)

    async def put(self, comp, data, version: Version) -> dict[str, Any]:
        return {**await super().put(comp, data, version), "host": host_id()}

    def check(self, cfg, layout: Layout, ann: WeightsAnnouncement) -> None:
        super().check(cfg, layout, ann)
        if ann.host != host_id():
            raise WeightsRefused(f"{where(ann)}: local to the learner's machine {ann.host.split('/')[0]!r}, and this "
                                 f"producer runs on {host_id().split('/')[0]!r} (learner.weights.transport local "
                                 "serves producers on the learner's machine; use chunked or shared_path)")

    def release(self, run: str) -> None:
        shutil.rmtree(Path(self.settings.path) / run, ignore_errors=True)
