"""Records and subprocess helpers shared by the operator-tool tests."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import numpy as np

from rlstream.config import parse_config
from rlstream.schemas import RolloutGroup, Sample, ScoredGroup

REPO = Path(__file__).resolve().parents[2]


def make_cfg(run: str, url: str, **sections):
    data = {
        "run": run,
        "training_mode": "RL_GRPO",
        "model_checkpoint_path": "unused",
        "nats": {"url": url},
        "metrics": {"prometheus_port": None, "interval_s": 0.2},
        "algorithm_params": {"group_size": 2},
    }
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return parse_config(data)


def rollout(i: int, version: int = 0, completion_ids=((5, 6, 7), (8, 9))) -> RolloutGroup:
    samples = [
        Sample(np.asarray(ids, np.int32), np.full(len(ids), -0.5, np.float32), "stop", f"text{i}-{j}")
        for j, ids in enumerate(completion_ids)
    ]
    return RolloutGroup.from_samples(id=f"g{i}", prompt_id=f"g{i}", prompt_text=f"prompt {i}", prompt_ids=np.asarray([1, 2, 3], np.int32),
                        samples=samples, policy_version=version, producer_id="p0")


def scored(i: int, version: int = 0, rewards=(1.0, 0.0), completion_ids=((5, 6, 7), (8, 9))) -> ScoredGroup:
    return ScoredGroup(rollout=rollout(i, version, completion_ids), rewards=np.asarray(rewards, np.float32),
                       components={"math": np.asarray(rewards, np.float32)}, scorer_id="s0")


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


async def start_cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rlstream.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(), cwd=str(REPO),
    )


async def run_cli(*args: str, timeout: float = 60.0) -> tuple[int, str, str]:
    proc = await start_cli(*args)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        raise AssertionError(f"rlstream {' '.join(args)} did not finish in {timeout}s\nstdout:\n{out.decode()}\nstderr:\n{err.decode()}") from None
    return proc.returncode, out.decode(), err.decode()


async def wait_stderr_line(proc: asyncio.subprocess.Process, needle: str, timeout: float = 30.0) -> str:
    """Read stderr lines until one contains ``needle`` (the command is then ready)."""
    seen = []

    async def read():
        while True:
            line = await proc.stderr.readline()
            if not line:
                raise AssertionError(f"process ended before printing {needle!r}; stderr:\n{''.join(seen)}")
            seen.append(line.decode())
            if needle in seen[-1]:
                return seen[-1]

    return await asyncio.wait_for(read(), timeout)


def sample_groups(model_dir: Path, n_groups: int, group_size: int, *, max_new_tokens: int = 6, seed: int = 0) -> list[ScoredGroup]:
    """Groups sampled from the tiny model (exact behaviour log-probs from the raw logits);
    reward: the fraction of even token ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(seed)
    groups = []
    for i in range(n_groups):
        prompt = f"Q: What is {i} + {2 * i}? A:"
        prompt_ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(prompt_ids.repeat(group_size, 1), do_sample=True, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id, top_k=0)
        completions = out.sequences[:, prompt_ids.shape[1]:]
        logprobs = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        samples = [Sample(np.asarray(ids, np.int32), lp.numpy().astype(np.float32), "length", tok.decode(ids))
                   for ids, lp in zip(completions.tolist(), logprobs)]
        rewards = np.asarray([np.mean(np.asarray(s.completion_ids) % 2 == 0) for s in samples], np.float32)
        gid = f"g{i:04d}"
        ro = RolloutGroup.from_samples(id=gid, prompt_id=gid, prompt_text=prompt, prompt_ids=prompt_ids[0].numpy().astype(np.int32),
                          samples=samples, policy_version=0)
        groups.append(ScoredGroup(rollout=ro, rewards=rewards))
    return groups


def record_learner_run(nats_server, model_dir: Path, tmp_path: Path, run_id: str, *, steps: int = 6, **sections) -> Path:
    """A real learner run of ``steps`` GRPO steps (2 groups each, a checkpoint every 2 steps) on
    groups sampled from the tiny model and published to ``rl.<run>.scored``; returns its run
    directory (``config.resolved.json``, ``metrics.jsonl``, ``checkpoints/``)."""
    import yaml

    from rlstream.broker import Publisher, connect, ensure_layout
    from rlstream.config import dump_resolved

    data = {
        "run": run_id,
        "training_mode": "RL_GRPO",
        "model_checkpoint_path": str(model_dir),
        "algorithm_params": {"group_size": 2, "kl_coefficient": 0.0, "max_staleness": 100},
        "learner": {"lr": 1e-3, "batch_groups": 2, "micro_batch_size": 2, "max_steps": steps},
        "checkpoint": {"interval": 2},
        "nats": {"url": nats_server.url, "ack_wait_s": 10.0},
        "metrics": {"interval_s": 0.5},
        **sections,
    }
    cfg = parse_config(data)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(data))
    dump_resolved(cfg, run_dir / "config.resolved.json")  # as `rlstream run` does

    async def record():
        groups = await asyncio.to_thread(sample_groups, model_dir, 2 * steps, 2)
        nc = await connect(url=nats_server.url, name="test-record")
        lay = await ensure_layout(nc.jetstream(), run_id)
        pub = Publisher(nc.jetstream())
        for g in groups:
            await pub.publish(lay.scored, g.encode(), g.id)
        await nc.close()
        return await run_cli("learner", str(config_path), "--nats", nats_server.url, "--run-dir", str(run_dir),
                             "--max-steps", str(steps), timeout=400)

    rc, out, err = asyncio.run(record())
    assert rc == 0, err[-3000:]
    return run_dir


def dashboard_link(line: str) -> tuple[str, str | None]:
    """(base URL, token) from the dashboard's "dashboard for run ... on URL" line: the URL
    carries the token the dashboard made (``/?token=...``), or none when the operator gave one."""
    m = re.search(r"(http://\S+/)(?:\?token=(\S+))?", line)
    assert m, line
    return m.group(1), m.group(2)
