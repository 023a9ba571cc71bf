"""``learner.weights``: one settings class per transport, keyed on ``transport``; the flat keys
of before still load, moved, and the log names the new spelling."""

from __future__ import annotations

import logging
import os

import pytest

from rlstream.config import ConfigError, LearnerConfig, parse_config
from rlstream.weights import TRANSPORTS, transport_for

BASE = {"training_mode": "RL_GRPO", "model_checkpoint_path": "m"}


def learner(**keys) -> LearnerConfig:
    return parse_config({**BASE, "learner": keys}).learner


def test_each_transport_has_only_its_own_settings():
    assert learner().weights.transport == "object_store"
    w = learner(weights={"transport": "broadcast", "port": 5, "receivers": 3}).weights
    assert (w.transport, w.port, w.receivers, w.chunk_mb) == ("broadcast", 5, 3, 16)
    assert learner(weights={"transport": "local"}).weights.path == f"/dev/shm/rlstream-{os.getuid()}"  # this user's own
    with pytest.raises(ConfigError, match=r"learner\.weights\.path: not a setting of transport 'chunked' .*it belongs to 'local' or 'shared_path'"):
        learner(weights={"transport": "chunked", "path": "/x"})
    with pytest.raises(ConfigError, match=r"learner\.weights\.path: required, missing"):
        learner(weights={"transport": "shared_path"})
    with pytest.raises(ConfigError, match=r"learner\.weights\.transport: 'nfs' is not allowed; allowed: 'object_store'"):
        learner(weights={"transport": "nfs"})
    with pytest.raises(ConfigError, match=r"learner\.weights\.chunk_mb: 0 is not allowed"):
        learner(weights={"transport": "chunked", "chunk_mb": 0})


@pytest.mark.parametrize("old, new", [
    ({"weights_transport": "chunked", "weights_chunk_mb": 4, "keep_versions": 3},
     {"transport": "chunked", "chunk_mb": 4, "keep_versions": 3}),
    ({"weights_transport": "shared_path", "shared_path": "/v", "local_path": "/dev/shm/x"},  # local_path: not shared_path's
     {"transport": "shared_path", "path": "/v"}),
    ({"shared_path": "/v"}, {"transport": "shared_path", "path": "/v"}),  # the folder producers were told to accept
    ({"weights_transport": "local", "local_path": "/dev/shm/y", "shared_path": None},
     {"transport": "local", "path": "/dev/shm/y"}),
    ({"weights_transport": "broadcast", "broadcast_host": "h", "broadcast_port": 7, "broadcast_receivers": 2,
      "broadcast_join_s": 1.5, "broadcast_timeout_s": 9, "keep_versions": 2},
     {"transport": "broadcast", "host": "h", "port": 7, "receivers": 2, "join_s": 1.5, "timeout_s": 9, "backend": "gloo"}),
    ({"keep_versions": 4}, {"transport": "object_store", "keep_versions": 4}),
])
def test_the_old_flat_keys_load_into_the_union_and_the_log_names_the_new_spelling(old, new, caplog):
    with caplog.at_level(logging.WARNING, logger="rlstream.config"):
        got = learner(**old).weights
    assert got == type(got)(**new)
    assert "old spelling, read as learner.weights: {" in caplog.text and f'"transport": "{new["transport"]}"' in caplog.text


def test_an_old_key_beside_the_new_section_is_an_error_naming_the_new_one():
    with pytest.raises(ConfigError, match=r"learner\.keep_versions: an old spelling beside learner\.weights; move it into "
                                          r"learner\.weights \(learner\.weights\.keep_versions\)"):
        learner(weights={"transport": "chunked"}, keep_versions=3)


def test_every_transport_in_the_config_has_one_implementation():
    from rlstream.config import WEIGHTS_TRANSPORTS

    assert set(WEIGHTS_TRANSPORTS) == set(TRANSPORTS)
    for name, settings in WEIGHTS_TRANSPORTS.items():
        fields = {"path": "/x"} if "path" in settings.model_fields else {}
        assert transport_for(settings(**fields)).name == name


def test_a_broadcast_between_gpus_uses_nccl_and_between_cpus_gloo():
    assert learner(weights={"transport": "broadcast"}).weights.backend == "gloo"
    assert learner(device="cuda", weights={"transport": "broadcast"}).weights.backend == "nccl"
    assert learner(device="cuda", weights={"transport": "broadcast", "backend": "gloo"}).weights.backend == "gloo"


def test_a_config_resolved_before_the_union_still_loads():
    """config.resolved.json of an older run lists every flat weights key at its default (replay reads it)."""
    old = {"weights_transport": "object_store", "shared_path": None, "keep_versions": 2, "local_path": "/dev/shm/rlstream",
           "weights_chunk_mb": 16, "broadcast_host": None, "broadcast_port": 0, "broadcast_receivers": 1,
           "broadcast_join_s": 2.0, "broadcast_timeout_s": 120.0}
    assert learner(**old).weights == learner().weights


def test_delta_is_a_setting_of_the_object_store_transports_alone():
    for transport in ("object_store", "chunked"):
        w = learner(weights={"transport": transport, "delta": True}).weights
        assert (w.delta, w.full_every) == (True, 10)
        assert learner(weights={"transport": transport, "delta": True, "full_every": 4}).weights.full_every == 4
        assert learner(weights={"transport": transport}).weights.delta is False
    for transport in ("local", "shared_path", "broadcast", "cuda_ipc"):
        with pytest.raises(ConfigError, match=rf"^invalid config:\n  learner\.weights\.delta: not a setting of transport "
                                              rf"'{transport}' \(value True\); it belongs to 'object_store' or 'chunked'$"):
            path = {"path": "/x"} if transport in ("local", "shared_path", "cuda_ipc") else {}
            learner(device="cuda", weights={"transport": transport, **path, "delta": True})
    resolved = learner(weights={"transport": "chunked"}).weights.model_dump()  # as config.resolved.json lists it
    assert resolved["full_every"] == 10 and learner(weights=resolved).weights.delta is False
    with pytest.raises(ConfigError, match=r"learner\.weights\.full_every: 1 is not allowed"):
        learner(weights={"transport": "object_store", "delta": True, "full_every": 1})
