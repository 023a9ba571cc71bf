"""Replay bundles: steps of a real learner run packed into a tar on a real broker, then replayed
from the tar alone (no run directory, no broker) bitwise; rescored with the same and with a
changed reward function; one micro-batch dumped; bad and hostile tars refused in one line."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import tarfile
import uuid

import pytest
from helpers.observe import record_learner_run, run_cli
from safetensors.torch import load_file

from rlstream.cli import main as rlstream_main

pytestmark = pytest.mark.slow

REWARD = {"type": "python", "terms": [{"function": "tests.helpers.bundle_rewards:even_share"}]}
DEAD_BROKER = "nats://127.0.0.1:9"


@pytest.fixture(scope="module")
def recorded_run(nats_server, tiny_model_dir, tmp_path_factory):
    return record_learner_run(nats_server, tiny_model_dir, tmp_path_factory.mktemp("bundle"), "bundle" + uuid.uuid4().hex[:8],
                              reward_function=REWARD)


@pytest.fixture(scope="module")
def bundle_3_4(recorded_run, nats_server, tmp_path_factory):
    """Steps 3-4: the run's step_2 checkpoint goes in as it is."""
    out = tmp_path_factory.mktemp("bundles") / "steps_3_4.tar"
    rc, text, err = asyncio.run(run_cli("replay", str(recorded_run), "--nats", nats_server.url, "--bundle", str(out),
                                        "--steps", "3-4", "--json", timeout=300))
    assert rc == 0, err[-3000:]
    assert json.loads(text)["checkpoint"] == "step_2"
    return out


def recorded(run_dir) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_a_bundle_replays_bitwise_from_the_tar_alone(recorded_run, bundle_3_4, nats_server, tmp_path, monkeypatch):
    # steps 4-6: no checkpoint of step 3, so step_2 is replayed through step 3 (which must reproduce) into the bundle
    later = tmp_path / "steps_4_6.tar"
    rc, text, err = asyncio.run(run_cli("replay", str(recorded_run), "--nats", nats_server.url, "--bundle", str(later),
                                        "--steps", "4-6", "--json", timeout=300))
    assert rc == 0, err[-3000:]
    assert json.loads(text)["replayed_to_start"] == [3]

    expected = recorded(recorded_run)
    monkeypatch.setenv("RLSTREAM_NATS_URL", DEAD_BROKER)  # nothing to connect to: the tar is all there is
    for bundle, steps in ((bundle_3_4, [3, 4]), (later, [4, 5, 6])):
        alone = tmp_path / "elsewhere" / bundle.name
        alone.parent.mkdir(exist_ok=True)
        shutil.copy(bundle, alone)
        with tarfile.open(alone) as tf:
            names = tf.getnames()
            manifest = json.load(tf.extractfile("bundle/manifest.json"))
        assert manifest["version"] == 1 and [s["step"] for s in manifest["steps"]] == steps
        assert "bundle/checkpoint/model.safetensors" in names and "bundle/checkpoint/trainer/optimizer.safetensors" in names
        assert not [n for n in names if n.endswith((".bin", ".pt", ".pkl", ".pickle"))]
        for s in steps:
            assert [f"bundle/groups/{q}.msgpack" in names for q in expected[s]["scored_seqs"]] == [True, True]

        rc, text, err = asyncio.run(run_cli("replay", str(alone), "--json", timeout=300))
        assert rc == 0, err[-3000:]
        result = json.loads(text)
        assert result["ok"] and [row["step"] for row in result["steps"]] == steps
        for row in result["steps"]:
            assert row["replayed"]["loss/total"] == expected[row["step"]]["loss/total"]  # bitwise
            assert row["replayed"]["optim/grad_norm"] == expected[row["step"]]["optim/grad_norm"]
            assert row["differs"] == []

    # a different learning rate: the first update after the checkpoint differs, so step 4 does
    rc, text, err = asyncio.run(run_cli("replay", str(bundle_3_4), "--set", "learner.lr=0.05", timeout=300))
    assert rc == 1, err[-3000:]
    assert "first differing step: 4" in text


def test_rescore_names_exactly_the_groups_a_changed_reward_changes(bundle_3_4, tmp_path):
    with tarfile.open(bundle_3_4) as tf:
        inputs = [json.loads(line) for line in tf.extractfile("bundle/reward_inputs.jsonl").read().splitlines()]
    assert len(inputs) == 4 and all(len(r["completions"]) == 2 and r["prompt"].startswith("Q: What is ") for r in inputs)

    rc, text, err = asyncio.run(run_cli("replay", str(bundle_3_4), "--rescore", "--json", timeout=300))
    assert rc == 0, err[-3000:]
    result = json.loads(text)
    assert result["groups"] == 4 and result["differs"] == []

    # bump two of the bundled groups' sums (and one sum the bundle does not hold)
    bumped = [int(r["prompt"].split()[3]) for r in inputs[1:3]]
    changed = ('reward_function.terms=[{function: "tests.helpers.bundle_rewards:even_share_bumped", '
               f'params: {{bump: {bumped + [99]}}}}}]')
    rc, text, err = asyncio.run(run_cli("replay", str(bundle_3_4), "--rescore", "--set", changed, "--json", timeout=300))
    assert rc == 1, err[-3000:]
    result = json.loads(text)
    assert [d["id"] for d in result["differs"]] == [r["id"] for r in inputs[1:3]]
    for d, r in zip(result["differs"], inputs[1:3]):
        assert d["recorded"] == r["rewards"] and d["rescored"] == pytest.approx([v + 1.0 for v in r["rewards"]], abs=1e-6)

    rc, text, err = asyncio.run(run_cli("replay", str(bundle_3_4), "--rescore", "--set", changed, timeout=300))
    assert rc == 1 and "2 of 4 groups differ" in text and inputs[1]["id"] in text


def test_a_micro_batch_is_dumped_as_safetensors(bundle_3_4, tmp_path, capsys):
    out = tmp_path / "mb.safetensors"
    assert rlstream_main(["replay", str(bundle_3_4), "--micro-batch", "1", "--step", "4", "--out", str(out), "--json"]) == 0
    dumped = json.loads(capsys.readouterr().out)
    assert dumped["step"] == 4 and dumped["micro_batch"] == 1 and dumped["micro_batches"] == 2  # 2 groups x 2 samples, 2 a micro-batch
    tensors = load_file(str(out))
    assert tensors["input_ids"].shape[0] == 2 and tensors["logprobs"].shape == tensors["mask"].shape
    assert (tensors["logprobs"] * tensors["mask"] <= 0).all()

    assert rlstream_main(["replay", str(bundle_3_4), "--micro-batch", "7", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # after transformers' loading bar
    assert err[-1] == "error: step 3 has 2 micro-batches (0..1), not 7"


def tar_with(path, files: dict[str, bytes], extra=()):
    with tarfile.open(path, "w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for info in extra:
            tf.addfile(info)
    return path


MANIFEST = json.dumps({"format": "rlstream-replay-bundle", "version": 1, "steps": []}).encode()


def hostile_link(name: str, target: str, kind=tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize("case, message", [
    ("missing", ": no such file"),
    ("not_a_tar", " is not a replay bundle (not a tar file)"),
    ("no_manifest", " is a tar but not a replay bundle (no bundle/manifest.json)"),
    ("newer", " is bundle format version 2; this rlstream (0.1.0) reads up to version 1: upgrade rlstream"),
    ("traversal", ": refused: member 'bundle/../../evil.txt' lies outside bundle/"),
    ("absolute", ": refused: member '/tmp/evil.txt' lies outside bundle/"),
    ("symlink", ": refused: member 'bundle/link' is not a regular file or directory"),
    ("hardlink", ": refused: member 'bundle/hard' is not a regular file or directory"),
])
def test_bad_and_hostile_bundles_are_refused_in_one_line(case, message, tmp_path, capsys):
    path = tmp_path / f"{case}.tar"
    evil = tmp_path / "evil.txt"
    if case == "not_a_tar":
        path.write_bytes(b"not a tar at all\n" * 64)
    elif case == "no_manifest":
        tar_with(path, {"bundle/config.resolved.json": b"{}"})
    elif case == "newer":
        tar_with(path, {"bundle/manifest.json": json.dumps({"format": "rlstream-replay-bundle", "version": 2}).encode()})
    elif case == "traversal":
        tar_with(path, {"bundle/manifest.json": MANIFEST, "bundle/../../evil.txt": b"x"})
    elif case == "absolute":
        tar_with(path, {"bundle/manifest.json": MANIFEST, "/tmp/evil.txt": b"x"})
    elif case == "symlink":
        tar_with(path, {"bundle/manifest.json": MANIFEST}, [hostile_link("bundle/link", str(evil))])
    elif case == "hardlink":
        tar_with(path, {"bundle/manifest.json": MANIFEST}, [hostile_link("bundle/hard", "/etc/passwd", tarfile.LNKTYPE)])
    for extra in ([], ["--rescore"], ["--micro-batch", "0"]):
        assert rlstream_main(["replay", str(path), *extra]) == 2
        err = capsys.readouterr().err
        assert err == f"error: {path}{message}\n", err
    assert not evil.exists() and not (tmp_path.parent / "evil.txt").exists()


def test_a_range_the_run_does_not_hold_is_refused(recorded_run, nats_server, tmp_path, capsys):
    out = tmp_path / "b.tar"
    for steps, message in (("5-9", "metrics.jsonl has no step 7 (it records steps 1..6)"),
                           ("4-x", "--steps '4-x': expected a range A-B (e.g. 120-130) or a count N"),
                           ("0-2", "--steps 0-2: the range must be A-B with 1 <= A <= B")):
        assert rlstream_main(["replay", str(recorded_run), "--nats", nats_server.url, "--bundle", str(out), "--steps", steps]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not out.exists()
    assert rlstream_main(["replay", str(recorded_run), "--nats", nats_server.url]) == 2
    assert capsys.readouterr().err == "error: give --from-step K (with --steps N, default 4) or --steps A-B\n"
