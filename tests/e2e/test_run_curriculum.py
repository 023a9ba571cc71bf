"""`rlstream run` with a difficulty curriculum on the real broker: the learner draws the prompts
(no feeder), keeps ``lead`` of them ahead, nothing is lost or trained twice, and the per-prompt
state in the checkpoint survives a restart (``--resume`` continues the same counts)."""

import json
import re
import subprocess

import pytest
from helpers.runs import finished_summary, read_jsonl, run_cmd, write_data

LEAD = 24
BATCH = 8  # grpo.yaml's learner.batch_groups


def _state(run_dir, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step}" / "learner_state.json").read_text())


@pytest.mark.e2e
def test_curriculum_run_draws_prompts_and_its_state_survives_a_restart(tiny_model_dir, tmp_path):
    data = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    sets = ["data_source.epochs=1", "data_source.curriculum.enabled=true", f"data_source.curriculum.lead={LEAD}",
            "checkpoint.interval=1", "eval.path=null", "nats.ack_wait_s=10"]

    r = subprocess.run(run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], 2, sets), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    finished_summary(run_dir, 2)
    assert not (run_dir / "logs" / "feeder.log").exists()  # the learner draws the prompts
    first = _state(run_dir, 2)
    cur = first["curriculum"]
    handled = len(first["trained_ids"]) + len(first["dropped_ids"])
    assert cur["observed"] == handled == 2 * BATCH  # GRPO drops nothing: every group consumed was trained
    assert cur["draws"] == handled + LEAD  # the lead is kept: one prompt drawn per group consumed
    # the untrained model rarely answers: most groups are all 0, and their prompts are drawn less
    assert cur["settled_groups"] >= 1 and set(cur["streak"]) == set(cur["settled_at"])

    r = subprocess.run(run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], 4, sets) + ["--resume"],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = finished_summary(run_dir, 4)  # nothing lost, nothing trained twice
    assert "resumed from" in (run_dir / "logs" / "learner.log").read_text()
    final = _state(run_dir, 4)["curriculum"]
    # the resumed learner went on from the checkpoint's state: a fresh state would have
    # observed only the groups consumed after the restart
    assert final["observed"] == len(_state(run_dir, 4)["trained_ids"]) == 4 * BATCH
    assert final["draws"] >= cur["draws"] + 2 * BATCH
    assert final["settled_groups"] >= cur["settled_groups"]
    ids = [g for row in read_jsonl(run_dir / "metrics.jsonl") for g in row["group_ids"]]
    assert len(ids) == len(set(ids)) == 4 * BATCH == summary["groups_trained"]
    assert all(re.fullmatch(r"p[0-9a-f]{10}-c\d+-\d+", g) for g in ids)  # every prompt was a curriculum draw
    learner = json.loads((run_dir / "learner_summary.json").read_text())
    assert learner["curriculum"]["draws"] == final["draws"]


@pytest.mark.e2e
def test_a_curriculum_learner_without_its_dataset_exits_2_naming_it(nats_server, tiny_model_dir, tmp_path, run_id):
    import yaml
    from helpers.groups import make_cfg
    from helpers.learner_runs import learner_cmd, learner_env

    cfg = make_cfg(tiny_model_dir, run=run_id)
    data = cfg.model_dump(mode="json")
    data["data_source"].update(path=str(tmp_path / "missing.jsonl"), curriculum={"enabled": True})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    r = subprocess.run(learner_cmd(path, nats_server.url, tmp_path / "run"), env=learner_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]  # a usage error: not restarted
    assert f"error: dataset {tmp_path / 'missing.jsonl'} does not exist" in r.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_a_curriculum_learner_killed_after_a_checkpoint_resumes_with_nothing_lost_or_trained_twice(tiny_model_dir, tmp_path):
    from helpers.runs import kill_child, last_step, wait_for_step

    data = write_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    steps = 40  # far past the kill, so the run cannot end before it lands
    sets = ["data_source.epochs=1", "data_source.curriculum.enabled=true", f"data_source.curriculum.lead={LEAD}",
            "checkpoint.interval=2", "eval.path=null", "nats.ack_wait_s=4"]
    proc = subprocess.Popen(run_cmd("grpo.yaml", run_dir, tiny_model_dir, data["rl"], steps, sets), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run_dir, 3, proc)  # the checkpoint of step 2 is on disk
        assert last_step(run_dir) < steps - 10, "the run got too far before the learner could be killed"
        kill_child(proc.pid, " learner ")
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    summary = finished_summary(run_dir, steps)  # lost prompts and rollouts 0, nothing trained twice
    assert summary["restarts"] == {"learner": 1}
    assert "resumed from" in (run_dir / "logs" / "learner.log").read_text()
    final = _state(run_dir, steps)
    cur = final["curriculum"]
    # the restored state went on: every group handled over both lives observed once
    # (groups sampled before the restart may come back too stale to train: dropped, observed too)
    assert cur["observed"] == len(final["trained_ids"]) + len(final["dropped_ids"])
    assert len(final["trained_ids"]) == steps * BATCH
    # prompts drawn after the checkpoint were drawn again with the same uniforms: mostly the
    # same ids (stored once); any other adds one prompt beyond the lead, at most the draws lost
    fed = summary["accounting"]["prompts_fed"]
    assert cur["draws"] <= fed <= cur["draws"] + LEAD + 2 * BATCH * 2
