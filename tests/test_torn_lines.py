"""Every reader of a run directory's JSON-lines files survives a torn or garbled line.

A kill or a full disk can leave ``metrics.jsonl`` (or ``samples.jsonl``, ``timeline.jsonl``)
with a half-written last line; the chaos run found the learner crash-looping on its resume
because the truncation parsed every line. Each reader skips such a line and counts it; each
resume drops it from the file, so the next append starts on a line of its own."""

import json
import logging
import time
from pathlib import Path

from rlstream.learner import loop as learner_loop
from rlstream.learner import replay
from rlstream.run import summary
from rlstream.rundir.files import RunDir, append_jsonl, read_jsonl
from rlstream.rundir.report import read_samples, truncate_samples

TORN = '{"step": 3, "policy_version": 3, "loss/tot'  # the kill landed mid-write: no newline
GARBLED = "\x00\x00\x00\x00"  # a block of zeros after a crash of the file system


def _write(path: Path, rows: list[dict], tail: str = TORN, middle: str | None = None) -> None:
    lines = [json.dumps(r) for r in rows]
    if middle is not None:
        lines.insert(1, middle)
    path.write_text("".join(line + "\n" for line in lines) + tail)


def _step_rows(n: int) -> list[dict]:
    return [{"step": s, "policy_version": s, "loss/total": 1.0 / s, "reward/mean": 0.1 * s,
             "scored_seqs": [s], "group_ids": [f"g{s}"]} for s in range(1, n + 1)]


def test_the_shared_reader_skips_and_counts_torn_and_garbled_lines(tmp_path, caplog):
    p = tmp_path / "metrics.jsonl"
    _write(p, _step_rows(2), middle=GARBLED)
    (tmp_path / "bad_utf8.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe{"step"\n[1, 2]\n')
    with caplog.at_level(logging.WARNING):
        got = read_jsonl(p)
    assert [r["step"] for r in got.rows] == [1, 2] and got.torn == 2
    assert "metrics.jsonl" in caplog.text and "2" in caplog.text
    bad = read_jsonl(tmp_path / "bad_utf8.jsonl")  # bytes that are not UTF-8; a line that is not an object
    assert bad.rows == [{"step": 1}] and bad.torn == 2
    assert read_jsonl(tmp_path / "absent.jsonl").rows == [] and read_jsonl(tmp_path / "absent.jsonl").torn == 0


def test_learner_resume_truncates_a_torn_metrics_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    _write(p, _step_rows(4), middle=GARBLED)
    learner_loop._truncate_metrics(p, 2)  # raised JSONDecodeError: the learner crash-looped
    assert p.read_text() == "".join(json.dumps(r) + "\n" for r in _step_rows(2))
    assert read_jsonl(p).torn == 0


def test_samples_survive_a_torn_line_and_resume_drops_it(tmp_path):
    p = tmp_path / "samples.jsonl"
    rows = [{"step": s, "completion": f"c{s}"} for s in (1, 2, 3)]
    _write(p, rows)
    assert [r["step"] for r in read_samples(p, after_step=1)] == [2, 3]  # the dashboard's samples view
    truncate_samples(p, 2)
    assert p.read_text() == "".join(json.dumps(r) + "\n" for r in rows[:2])


def test_run_summary_and_eval_rows_skip_a_torn_line(tmp_path):
    rows = _step_rows(3) + [{"kind": "eval", "step": 3, "policy_version": 3, "eval/pass@1": 0.5}]
    _write(RunDir(tmp_path).metrics, rows, middle=GARBLED)
    assert [r["step"] for r in summary.read_metrics(tmp_path)] == [1, 2, 3]
    assert [r["policy_version"] for r in summary.read_eval(tmp_path)] == [3]
    assert summary.torn_lines(tmp_path) == {"metrics.jsonl": 2}


def test_run_summary_survives_a_torn_learner_summary(tmp_path, run_id):
    # the learner was killed while writing its summary at exit: the run's summary goes on without it
    from rlstream.config import load_config

    RunDir(tmp_path).metrics.write_text(json.dumps({"step": 1, "group_ids": ["g0"], "samples": 4}) + "\n")
    RunDir(tmp_path).learner_summary.write_text('{"policy_version": 1, "trained_ids_co')
    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "arithmetic" / "grpo.yaml", [f"run={run_id}"])
    out = summary.summarize(cfg, tmp_path, 1.0, {}, {}, True, True)
    assert out["learner"] == {} and out["steps"] == 1
    assert out["torn_lines"] == {"learner_summary.json": 1}


def test_replay_reads_metrics_with_a_torn_line(tmp_path):
    _write(RunDir(tmp_path).metrics, _step_rows(3), middle=GARBLED)
    assert sorted(replay.read_metrics(tmp_path)) == [1, 2, 3]  # raised ReplayError ("not JSON")


def test_appending_after_a_torn_line_starts_a_line_of_its_own(tmp_path):
    # the run appends its timeline at each end; a resumed run must not glue its first point
    # onto the torn tail of the last one (that would garble both)
    p = RunDir(tmp_path).timeline
    _write(p, [{"step": 1, "elapsed_s": 1.0}], tail='{"step": 2, "elap')
    append_jsonl(p, [{"step": 3, "elapsed_s": 3.0}])
    got = read_jsonl(p)
    assert got.rows == [{"step": 1, "elapsed_s": 1.0}, {"step": 3, "elapsed_s": 3.0}] and got.torn == 0



def test_the_time_since_the_last_step_skips_a_torn_timeline_line(tmp_path):
    p = RunDir(tmp_path).timeline
    _write(p, [{"step": 1, "elapsed_s": 1.0, "ts": time.time() - 5.0}], tail='{"step": 2, "elapsed_s": 2.0, "ts": 17')
    assert 5.0 <= summary.seconds_since_last_step(p) < 60.0
    assert summary.seconds_since_last_step(tmp_path / "absent.jsonl") is None
