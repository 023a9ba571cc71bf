"""WebDataset shards as a data source: `rlstream shards` writes them from jsonl and parquet,
the shard stream resumes at any position exactly where it was (shard, sample, shuffle buffer),
parts split the shards between feeders, the feeder publishes them as prompts, and an SFT
learner killed with SIGKILL in the middle of a shard then `--resume`d trains every sample
exactly once per epoch, checked by id, the same batches as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers.groups import make_cfg

from rlstream.data.shards import ShardStream, expand_urls, split_shards

ROWS = 23


def _rows(n: int = ROWS) -> list[dict]:
    return [{"prompt": f"Q: What is {i} + {i}? A:", "completion": f" {2 * i}", "answer": str(2 * i)} for i in range(n)]


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "RLSTREAM_LOG": "WARNING"}
    out = subprocess.run([sys.executable, "-m", "rlstream.cli", *args], env=env, capture_output=True, text=True, timeout=240)
    assert not check or out.returncode == 0, out.stderr[-3000:]
    return out


def _write(tmp_path: Path, n: int = ROWS, per_shard: int = 5, fmt: str = "jsonl") -> str:
    rows = _rows(n)
    if fmt == "jsonl":
        src = tmp_path / "rows.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        src = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(rows), src)
    out = _cli("shards", str(src), "--out", str(tmp_path / f"shards-{fmt}"), "--per-shard", str(per_shard))
    pattern = out.stdout.split('urls: "')[1].split('"')[0]
    return pattern


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_shards_command_writes_every_row_once_with_its_index_as_key(tmp_path, fmt):
    pattern = _write(tmp_path, fmt=fmt)
    shards = expand_urls(pattern)
    assert [Path(s).name for s in shards] == [f"train-{i:06d}.tar" for i in range(5)]  # 23 rows / 5 per shard
    assert all(Path(s).exists() for s in shards)
    got = list(ShardStream(shards, epochs=1, seed=None, buffer=0))
    assert [s.key for s in got] == [f"{i:09d}" for i in range(ROWS)]
    assert [s.row for s in got] == _rows()


def _all(stream) -> list[tuple[int, str]]:
    return [(s.epoch, s.key) for s in stream]


def test_resume_from_any_position_gives_exactly_the_rest(tmp_path):
    shards = expand_urls(_write(tmp_path))
    make = lambda state=None: ShardStream(shards, epochs=2, seed=3, buffer=7, state=state)  # noqa: E731
    full = _all(make())
    keys = {f"{i:09d}" for i in range(ROWS)}
    for epoch in (0, 1):  # each epoch is a permutation of the whole dataset ...
        got = [k for e, k in full if e == epoch]
        assert len(got) == ROWS and set(got) == keys
    assert [k for e, k in full if e == 0] != [k for e, k in full if e == 1]  # ... a different one each epoch
    assert [k for e, k in full if e == 0] != sorted(keys)  # and shuffled
    for k in range(0, 2 * ROWS + 1):
        first = make()
        head = [(s.epoch, s.key) for _, s in zip(range(k), first)]
        state = json.loads(json.dumps(first.state()))  # what a checkpoint keeps
        assert len(state["buffer"]) <= 7
        assert head + _all(make(state)) == full, k


def test_parts_split_the_shards_between_feeders(tmp_path):
    shards = expand_urls(_write(tmp_path))
    parts = [split_shards(shards, i, 2) for i in range(2)]
    assert sorted(parts[0] + parts[1]) == shards and not set(parts[0]) & set(parts[1])
    keys = [s.key for p in parts for s in ShardStream(p, epochs=1, seed=1, buffer=4)]
    assert sorted(keys) == [f"{i:09d}" for i in range(ROWS)]


async def test_feeder_publishes_its_part_of_the_shards_as_prompts(tmp_path, nats_server, run_id, tiny_model_dir):
    from rlstream.broker import connect, ensure_layout
    from rlstream.config import NatsConfig, parse_config
    from rlstream.producers.feeder import feed
    from rlstream.schemas import Prompt

    pattern = _write(tmp_path)
    nc = await connect(url=nats_server.url, name="wds-feed")
    js = nc.jetstream()
    try:
        lay = await ensure_layout(js, run_id, NatsConfig())
        counts = []
        for part in range(2):
            cfg = parse_config({"run": run_id, "training_mode": "RL_GRPO", "model_checkpoint_path": str(tiny_model_dir),
                                "data_source": {"type": "webdataset", "urls": pattern, "epochs": 2, "shuffle_buffer": 4,
                                                "part_index": part, "part_count": 2}})
            counts.append(await feed(js, lay, cfg, progress=False))
        assert await feed(js, lay, cfg, progress=False) == counts[1]  # fed again: nothing new is stored
        last = (await js.stream_info(lay.prompts_stream)).state.last_seq
        prompts = [Prompt.decode((await js.get_msg(lay.prompts_stream, seq)).data) for seq in range(1, last + 1)]
    finally:
        await nc.close()
    assert sum(counts) == 2 * ROWS and len(prompts) == 2 * ROWS
    assert len({p.id for p in prompts}) == 2 * ROWS
    for epoch in (0, 1):
        assert sorted(p.index for p in prompts if p.epoch == epoch) == list(range(ROWS))
    by_index = {p.index: p for p in prompts}
    assert by_index[7].text == "Q: What is 7 + 7? A:" and by_index[7].columns["answer"] == "14"


# ---- kill -9 in the middle of a shard, then --resume --------------------------------------

STEPS = 12  # 23 samples x 2 epochs / 4 per step


def _sft_config(tmp_path: Path, model_dir: Path, pattern: str, name: str) -> Path:
    cfg = make_cfg(model_dir, "SFT", run=name, data_source={"type": "webdataset", "urls": pattern, "epochs": 2,
                                                           "shuffle_seed": 11, "shuffle_buffer": 6},
                   learner={"batch_groups": 4, "micro_batch_size": 4, "lr": 1e-3}, checkpoint={"interval": 2, "keep_last": 10})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.e2e
@pytest.mark.slow
def test_sft_killed_mid_shard_resumes_and_trains_every_sample_once_per_epoch(tmp_path, tiny_model_dir):
    pattern = _write(tmp_path, per_shard=6)  # 4 shards: 6, 6, 6, 5 samples
    cfg_path = _sft_config(tmp_path, tiny_model_dir, pattern, "wds")

    ref_dir = tmp_path / "ref"
    _cli("learner", str(cfg_path), "--run-dir", str(ref_dir))

    run_dir = tmp_path / "crash"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "RLSTREAM_LOG": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "rlstream.cli", "learner", str(cfg_path), "--run-dir", str(run_dir)], env=env)
    marker = run_dir / "checkpoints" / "step_4" / "learner_state.json"
    deadline = time.monotonic() + 180
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, "the learner finished before it could be killed"
    # the checkpoint's position is inside a shard: 16 samples trained, 5 in the shuffle buffer
    # (filled to 6 before each pick), so 21 read: shard 3 (in the epoch's order) at sample 3 of 5
    cursor = json.loads(marker.read_text())["data_cursor"]
    assert (cursor["epoch"], cursor["emitted"], cursor["shard"], cursor["offset"], len(cursor["buffer"])) == (0, 16, 3, 3, 5), cursor
    assert not (run_dir / "learner_summary.json").exists()

    _cli("learner", str(cfg_path), "--run-dir", str(run_dir), "--resume")

    got, ref = _metrics(run_dir), _metrics(ref_dir)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [m["group_ids"] for m in got] == [m["group_ids"] for m in ref]
    assert [m["loss/total"] for m in got] == [m["loss/total"] for m in ref]
    summary = json.loads((run_dir / "learner_summary.json").read_text())
    assert summary["epochs"] == [
        {"epoch": e, "examples_used": ROWS, "unique_ids": ROWS, "repeated_ids": 0, "dataset_size": None} for e in (0, 1)
    ]
    for epoch in (0, 1):  # by id, from what was trained
        ids = [i for m in got for i in m["group_ids"]]
        per_epoch = ids[epoch * ROWS:(epoch + 1) * ROWS]
        assert sorted(i.rsplit("-", 1)[1] for i in per_epoch) == [f"{k:09d}" for k in range(ROWS)]


def test_preflight_reads_the_first_shard_and_names_a_missing_one(tmp_path, tiny_model_dir):
    from rlstream.config import parse_config
    from rlstream.run.preflight import preflight

    pattern = _write(tmp_path)
    base = {"model_checkpoint_path": str(tiny_model_dir)}
    sft = {**base, "training_mode": "SFT", "data_source": {"type": "webdataset", "urls": pattern}}
    assert preflight(parse_config(sft)) == []
    rl = {**base, "training_mode": "RL_GRPO", "reward_function": {"terms": [{"rule": "exact_match"}]},
          "data_source": {"type": "webdataset", "urls": pattern}}
    assert preflight(parse_config(rl)) == []  # the rows have prompt and answer
    dpo = {**base, "training_mode": "DPO", "data_source": {"type": "webdataset", "urls": pattern}}
    assert any("'chosen'" in p for p in preflight(parse_config(dpo)))  # SFT rows are no preference pairs
    gone = {**sft, "data_source": {"type": "webdataset", "urls": str(tmp_path / "nope-{0..3}.tar")}}
    (problem,) = preflight(parse_config(gone))
    assert problem.startswith("data_source.urls: shard ") and "nope-0.tar does not exist" in problem
