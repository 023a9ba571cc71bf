"""``transport: shared_path``: an HF folder per version under ``path``, a volume every
producer mounts; written under a ``.tmp`` name, fsynced, renamed into place. The learner's
snapshot is serialised in memory and the disk is written after it, in the background: into
its page cache the copy took 1.5 s at 512 MB, not 0.3."""

from __future__ import annotations

from rlstream.weights.folders import FolderTransport


class SharedPathTransport(FolderTransport):
    name = "shared_path"
    durable = True
