"""`rlstream run` for a few steps with each training mode: the run directory, summary.json,
the reward curve, a checkpoint that loads with from_pretrained, and one sign per mode that it
learned: the SFT loss falls, the DPO margin grows from zero, and in every RL mode the trained
policy puts more log-probability than the initial one on the above-average completions it
trained on, relative to the below-average ones."""

import asyncio
import json
import subprocess

import pytest
from helpers.groups import advantage_logprob_gap
from helpers.runs import read_jsonl, run_cmd, write_data
from transformers import AutoModelForCausalLM

from rlstream.broker import EmbeddedServer, Layout, connect
from rlstream.schemas import ScoredGroup

MODES = [
    ("sft.yaml", "SFT", "sft", []),
    ("dpo.yaml", "DPO", "dpo", []),
    ("ppo.yaml", "RL_PPO", "rl", ["producer.batch_prompts=16", "learner.batch_groups=16"]),
    ("grpo.yaml", "RL_GRPO", "rl", []),
    ("dapo.yaml", "RL_DAPO", "rl", []),
    ("gspo.yaml", "RL_GSPO", "rl", []),
]
# `make test` keeps GRPO, the demo's mode; the other modes are `make test-all`'s (slow)
MODE_PARAMS = [pytest.param(*m, id=m[1], marks=() if m[1] == "RL_GRPO" else pytest.mark.slow) for m in MODES]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("arith-data"))


@pytest.fixture(scope="module")
def warm_model(data, tiny_model_dir, tmp_path_factory):
    """The tiny model after a short SFT on the task, so RL rewards vary within groups
    (DAPO's dynamic sampling drops groups whose rewards are all equal)."""
    run_dir = tmp_path_factory.mktemp("warm") / "sft"
    r = subprocess.run(run_cmd("sft.yaml", run_dir, tiny_model_dir, data["sft"], 60), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return run_dir / "checkpoints" / "latest"


@pytest.mark.e2e
@pytest.mark.parametrize("config, mode, dataset, extra", MODE_PARAMS)
def test_run_each_mode(config, mode, dataset, extra, data, tiny_model_dir, request, tmp_path):
    run_dir = tmp_path / "run"
    steps = 4
    model_dir = tiny_model_dir if mode == "SFT" else request.getfixturevalue("warm_model")
    cmd = run_cmd(config, run_dir, model_dir, data[dataset], steps, ["checkpoint.interval=2", *extra])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + (run_dir / "logs" / "learner.log").read_text()[-3000:]
    resolved = json.loads((run_dir / "config.resolved.json").read_text())
    assert resolved["training_mode"] == mode
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("run", "training_mode", "steps", "samples_trained", "wall_s", "reward_first", "reward_last",
                "dropped_stale", "dlq", "redelivered", "policy_version", "ok"):
        assert key in summary, key
    assert summary["ok"] is True and summary["steps"] == steps and summary["training_mode"] == mode
    assert summary["samples_trained"] > 0
    if mode.startswith("RL_"):
        assert summary["groups_trained_twice"] == 0
        assert summary["reward_first"] is not None and 0.0 <= summary["reward_last"] <= 1.0  # the math rule's range
        assert summary["accounting"]["lost_prompts"] == 0 and summary["accounting"]["lost_rollouts"] == 0
        assert summary["policy_version"] >= steps
    assert (run_dir / "reward_curve.png").stat().st_size > 1000
    assert (run_dir / "logs" / "learner.log").exists()
    ckpt = run_dir / "checkpoints" / "latest"
    assert ckpt.is_symlink() and ckpt.resolve().name == f"step_{steps}"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert model.config.hidden_size == 128
    # what the mode learned
    if mode == "SFT":  # from random weights at lr 1e-3, four steps take the loss down by far more than batch noise
        assert rows[-1]["loss/sft"] < rows[0]["loss/sft"] - 0.1, [r["loss/sft"] for r in rows]
    elif mode == "DPO":  # step 1's policy is the reference: margin 0; then it separates chosen from rejected
        assert abs(rows[0]["rewards/margin"]) < 1e-6 and rows[-1]["rewards/margin"] > 0, [r["rewards/margin"] for r in rows]
    else:
        trained = [g for r in rows for g in r["group_ids"]]
        groups = recorded_groups(run_dir, resolved["run"], set(trained))
        baseline = "batch" if mode == "RL_PPO" else "group"  # PPO's advantage: reward less a value (zero at first)
        rewards = [r for g in groups for r in g.rewards.tolist()] if baseline == "batch" else None
        assert (len(set(rewards)) > 1) if rewards else any(len(set(g.rewards.tolist())) > 1 for g in groups), "no reward signal"
        before, after = advantage_logprob_gap(model_dir, groups, baseline), advantage_logprob_gap(ckpt, groups, baseline)
        assert after > before, (before, after)


@pytest.mark.slow
@pytest.mark.e2e
def test_run_distill_with_reference_and_teacher_stages(data, tiny_model_dir, warm_model, tmp_path):
    """`rlstream run` starts the reference and teacher stages from the config; the fresh student
    trains on the teacher's link with the recorded reference in its KL term."""
    run_dir = tmp_path / "run"
    steps = 3
    cmd = run_cmd("distill.yaml", run_dir, tiny_model_dir, data["rl"], steps,
                  [f"teacher.model_path={warm_model}", "reference.replicas=1", "algorithm_params.kl_coefficient=0.01"])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + (run_dir / "logs" / "learner.log").read_text()[-3000:]
    assert {p.name for p in (run_dir / "logs").iterdir()} >= {"reference-0.log", "teacher-0.log", "learner.log"}
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all("distill/reverse_kl" in r and "loss/kl" in r for r in rows)
    assert rows[0]["distill/reverse_kl"] > 0.01  # a fresh student is far from the warmed-up teacher
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] is True and summary["training_mode"] == "DISTILL" and summary["groups_trained_twice"] == 0
    # every link of the chain is accounted for: scored -> reference -> teacher -> learner
    acc = summary["accounting"]
    assert acc["reference_published"] > 0 and acc["teacher_published"] > 0, acc
    assert acc["lost_prompts"] == acc["lost_rollouts"] == acc["lost_scored"] == acc["lost_reference"] == 0, acc
    assert acc["lost"] == 0, acc


def recorded_groups(run_dir, run: str, ids: set[str]) -> list[ScoredGroup]:
    """The scored groups the run trained on, read back from its broker's store on disk."""
    async def read(url):
        nc = await connect(url=url)
        try:
            js = nc.jetstream()
            stream = Layout(run).scored_stream
            last = (await js.stream_info(stream)).state.last_seq
            out = [ScoredGroup.decode((await js.get_msg(stream, seq)).data) for seq in range(1, last + 1)]
            return [g for g in out if g.id in ids]
        finally:
            await nc.close()

    server = EmbeddedServer(run_dir / "nats").start()
    try:
        return asyncio.run(read(server.url))
    finally:
        server.stop()
