"""Shared-memory weights (``transport: local``, ``cuda_ipc``) live in this user's own folder:
``/dev/shm/rlstream-<uid>`` by default, made 0700, and refused when another user could have
planted it (a link, a directory of another uid, or one open to others)."""

from __future__ import annotations

import os
import stat

import pytest

from rlstream.config import LocalWeights
from rlstream.weights import WeightsRefused
from rlstream.weights.folders import private_root
from rlstream.weights.local import LocalTransport


def test_the_learner_makes_its_folder_private(tmp_path):
    root = tmp_path / "shm" / "rlstream-test"
    staged = LocalTransport(LocalWeights(path=str(root))).staged("run1", 1)
    staged.alloc(16)[:] = b"x" * 16
    staged.discard()
    st = os.lstat(root)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()


@pytest.mark.parametrize("plant", ["link", "open-to-others", "file"])
def test_a_planted_folder_is_refused_by_the_learner_and_the_producer(tmp_path, plant):
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir(mode=0o700)
    root = tmp_path / "rlstream-shm"
    if plant == "link":
        root.symlink_to(elsewhere)
    elif plant == "open-to-others":
        root.mkdir()
        root.chmod(0o777)
    else:
        root.write_text("not a folder")
    transport = LocalTransport(LocalWeights(path=str(root)))
    with pytest.raises(WeightsRefused, match=str(root)):
        transport.staged("run1", 1)  # the learner writes nothing there
    with pytest.raises(WeightsRefused, match=str(root)):
        private_root(root, create=False)  # what a producer checks before it reads
    assert list(elsewhere.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another uid needs root")
def test_another_users_folder_is_refused(tmp_path):
    root = tmp_path / "rlstream-shm"
    root.mkdir(mode=0o700)
    os.chown(root, 4242, 4242)
    with pytest.raises(WeightsRefused, match="owned by uid 4242"):
        private_root(root, create=True)


def test_a_missing_folder_is_made_only_by_the_learner(tmp_path):
    with pytest.raises(WeightsRefused, match="does not exist"):
        private_root(tmp_path / "none", create=False)
    assert private_root(tmp_path / "made", create=True).is_dir()


def test_the_default_folder_is_this_users_own():
    assert LocalWeights().path == f"/dev/shm/rlstream-{os.getuid()}"
