"""The feeder: deterministic ids, epochs, seeded shuffling, idempotent re-feeding, clear errors."""

from __future__ import annotations

import json

import pytest
from helpers.broker import layout_for

from rlstream.broker import Consumer, Layout
from rlstream.data.rows import DatasetError
from rlstream.producers.feeder import build_prompts, feed
from rlstream.schemas import Prompt


async def drain(js, lay, expect: int) -> list[Prompt]:
    consumer = await Consumer(js, lay, Layout.PRODUCERS, Prompt, stage="producer").start()
    out = []
    while len(out) < expect:
        got = await consumer.fetch(256, timeout=2)
        if not got:
            break
        out.extend(d.record for d in got)
    return out


async def test_feed_publishes_epochs_with_columns_and_twice_is_harmless(js, run_id, config, dataset):
    cfg, _ = config(data_source={"path": str(dataset(5)), "epochs": 2})
    lay = await layout_for(js, run_id)
    assert await feed(js, lay, cfg) == 10
    assert await feed(js, lay, cfg) == 10  # the same ids again: de-duplicated by JetStream
    assert (await js.stream_info(lay.prompts_stream)).state.messages == 10
    prompts = await drain(js, lay, 10)
    assert len({p.id for p in prompts}) == 10
    assert sorted((p.epoch, p.index) for p in prompts) == [(e, i) for e in range(2) for i in range(5)]
    p3 = next(p for p in prompts if p.index == 3 and p.epoch == 1)
    assert p3.text == "Q: What is 3 + 3? A:" and p3.columns == {"answer": "6"} and p3.run == run_id


def test_ids_are_deterministic_and_shuffling_is_seeded(config, dataset):
    rows = [{"prompt": f"q{i}"} for i in range(50)]
    cfg, _ = config(data_source={"epochs": 2, "shuffle_seed": 7})
    a, b = build_prompts(rows, cfg, key="k"), build_prompts(rows, cfg, key="k")
    assert [p.id for p in a] == [p.id for p in b]
    assert a[0].id == f"pk-0-{a[0].index}" and a[0].text == f"q{a[0].index}"
    first, second = [p.index for p in a[:50]], [p.index for p in a[50:]]
    assert sorted(first) == list(range(50)) and first != list(range(50))  # shuffled, all there
    assert first != second  # each epoch its own order (seed + epoch)
    cfg2, _ = config(data_source={"epochs": 1, "shuffle_seed": 8})
    assert [p.index for p in build_prompts(rows, cfg2, key="k")] != first
    cfg3, _ = config(data_source={"epochs": 1, "shuffle_seed": None})
    assert [p.index for p in build_prompts(rows, cfg3, key="k")] == list(range(50))


def test_chat_messages_and_bad_rows(config):
    cfg, _ = config()
    msgs = [{"role": "user", "content": "2 + 2?"}]
    (p,) = build_prompts([{"messages": msgs, "answer": 4}], cfg)
    assert p.messages == msgs and p.text == "" and p.columns == {"answer": 4}
    with pytest.raises(DatasetError, match=r"row 1 has no column 'prompt' \(nor 'messages'\)"):
        build_prompts([{"prompt": "ok"}, {"question": "where?"}], cfg)
    with pytest.raises(DatasetError, match=r"row 0 column 'prompt' is empty"):
        build_prompts([{"prompt": "  "}], cfg)
    with pytest.raises(DatasetError, match=r"row 0 column 'messages' turn 0"):
        build_prompts([{"messages": [{"role": "user"}]}], cfg)


async def test_feed_command_exits_2_on_a_bad_dataset(nats_server, config, tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"q": "no prompt"}) + "\n")
    _, path = config(data_source={"path": str(bad)})
    proc = subprocess.run([sys.executable, "-m", "rlstream.cli", "feed", str(path), "--nats", nats_server.url],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "row 1 has no column 'prompt'" in proc.stderr


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"Q: What is {i} + {i}? A:", "answer": str(2 * i)} for i in range(n)]


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _datasets_dir(path, rows, split: str | None = "train"):
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list(rows)
    (DatasetDict({split: ds}) if split else ds).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["parquet", "datasets-dict", "datasets-plain"])
async def test_feed_reads_parquet_and_datasets_directories(js, run_id, config, tmp_path, kind):
    rows = _rows(6)
    path = {"parquet": lambda: _parquet(tmp_path / "prompts.parquet", rows),
            "datasets-dict": lambda: _datasets_dir(tmp_path / "ds", rows, split="train"),
            "datasets-plain": lambda: _datasets_dir(tmp_path / "ds", rows, split=None)}[kind]()
    cfg, _ = config(data_source={"path": str(path)})
    lay = await layout_for(js, run_id)
    assert await feed(js, lay, cfg) == 6
    prompts = sorted(await drain(js, lay, 6), key=lambda p: p.index)
    assert [(p.text, p.columns) for p in prompts] == [(r["prompt"], {"answer": r["answer"]}) for r in rows]


async def test_feed_command_names_a_missing_split(nats_server, config, tmp_path):
    import subprocess
    import sys

    path = _datasets_dir(tmp_path / "ds", _rows(3), split="test")
    _, cfg_path = config(data_source={"path": str(path)})
    proc = subprocess.run([sys.executable, "-m", "rlstream.cli", "feed", str(cfg_path), "--nats", nats_server.url],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "has no split 'train' (has ['test'])" in proc.stderr


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "cut off', "line 2: not valid JSON"),
    ('["a", "list"]', "line 2: expected a JSON object, got list"),
])
async def test_feed_command_names_the_bad_json_line_and_publishes_nothing(js, nats_server, run_id, config, tmp_path, line, message):
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_rows(1)[0]) + "\n" + line + "\n" + json.dumps(_rows(2)[1]) + "\n")
    _, path = config(data_source={"path": str(bad)})
    lay = await layout_for(js, run_id)
    proc = subprocess.run([sys.executable, "-m", "rlstream.cli", "feed", str(path), "--nats", nats_server.url],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{bad} {message}" in proc.stderr
    assert (await js.stream_info(lay.prompts_stream)).state.messages == 0  # not half a dataset
