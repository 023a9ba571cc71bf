"""Scorer throughput: groups/s through ``rlstream scorer`` against calling the same reward
rule directly, in the same run.

Through the scorer: the groups (8 completions each) wait on the rollouts stream of an
embedded nats-server; one ``rlstream scorer`` process (``scorer.processes: 1`` for
math-verify) pulls, decodes, scores, publishes ScoredGroups and acks. Its rate is taken
between the first and the last scored group seen on the scored stream. Directly: the same
rule over the same completions in one Python loop (math-verify in the main thread, with
its timeouts, as a pool worker runs it), with no broker at all, timed from the same event:
the moment as many groups are done as the scorer had published when it was first seen.

Two rules: ``exact_match`` (microseconds per group: the figure shows the broker's cost
per group) and ``math`` (math-verify: the scoring dominates). Goal: ratio >= 0.9.

A cheap rule cannot reach that goal through any broker: the rule costs microseconds per group,
one JetStream hop in Python hundreds. So for ``exact_match`` a third path shows what the loop
itself costs: a hand-written raw nats-py scorer in its own process (pulls of 64 as the
scorer's, plain ``msgpack.unpackb`` without validation, the same rule, a plain msgpack
result published with ``publish_async``, each ack once every publish of its batch is acked:
the scorer's at-least-once order), against which the rlstream scorer's ratio is printed too.
It does less than the product must (no validation, dead letters, de-duplication by message
id, in-progress acks, origin header, metrics, reward components): a ceiling for all of that,
but not for the pull, which it makes with nats-py's ``fetch`` (a task per message, ~33 us of
CPU each, where rlstream's consumer takes ~10 us).

Each scorer process's CPU time per group (user + system, from the first scored group seen to
the last) is printed as well: a shared machine moves it far less than it moves groups/s.

    python bench/scorers.py [--quick]
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, verdict  # noqa: E402

from rlstream.broker import EmbeddedServer, Outgoing, Publisher, connect, ensure_layout  # noqa: E402
from rlstream.schemas import RolloutGroup, Sample  # noqa: E402
from rlstream.scorers import rewards  # noqa: E402

G = 8


def completions_of(i: int) -> list[str]:
    a, b = i % 97, (i * 7) % 89
    forms = [f"The answer is {a + b}", f"so \\boxed{{{a + b}}}", f"{a} + {b} = {a + b + 1}", f"\\boxed{{\\frac{{{2 * (a + b)}}}{{2}}}}",
             "I am not sure", f"The answer is {a + b}.5", f"#### {a + b}", f"we get \\boxed{{{a + b - 1}}}"]
    return forms[:G]


def make_groups(n: int, run: str) -> list[RolloutGroup]:
    out = []
    for i in range(n):
        texts = completions_of(i)
        samples = [Sample(np.arange(24, dtype=np.int32), np.full(24, -0.5, np.float32), "stop", t) for t in texts]
        out.append(RolloutGroup.from_samples(samples, id=f"g{i}", prompt_id=f"g{i}", prompt_text=f"Q: What is {i % 97} + {(i * 7) % 89}?",
                                             prompt_ids=np.arange(12, dtype=np.int32), policy_version=0,
                                             columns={"answer": str(i % 97 + (i * 7) % 89)}, run=run))
    return out


def direct_rate(rule: str, groups: list[RolloutGroup], first: int) -> float:
    """Groups/s of the direct loop, timed like the scorer: from the moment its first ``first``
    groups are scored (the first batch the scorer was seen to publish) to its last."""
    _score_directly(rule, groups[:8])  # imports and first-call caches, as the scorer's warm-up does
    done = _score_directly(rule, groups)
    k = min(max(first, 1), len(groups) - 1)
    return (len(groups) - k) / (done[-1] - done[k - 1])


def _score_directly(rule: str, groups: list[RolloutGroup]) -> list[float]:
    """Score each group; the perf_counter time at which each was done."""
    done = []
    for g in groups:
        texts = [s.text for s in g.samples]
        answer = g.columns["answer"]
        if rule == "math":
            rewards.math_scores(texts, [answer] * len(texts))
        else:
            [rewards.exact_match(t, answer) for t in texts]
        done.append(time.perf_counter())
    return done


async def staged(server_url: str, groups: list[RolloutGroup], run: str):
    """A connection, and the run's layout with ``groups`` waiting on its rollouts stream."""
    nc = await connect(url=server_url, name="bench")
    js = nc.jetstream()
    lay = await ensure_layout(js, run)
    pub = Publisher(js)
    for i in range(0, len(groups), 256):
        await pub.publish_many([Outgoing(lay.rollouts, g.encode(), g.id) for g in groups[i:i + 256]])
    return nc, js, lay


async def scorer_rate(server_url: str, rule: str, groups: list[RolloutGroup], run: str, workdir: Path) -> tuple[float, int]:
    nc, js, lay = await staged(server_url, groups, run)
    cfg = workdir / f"{run}.yaml"
    cfg.write_text(yaml.safe_dump({
        "run": run, "training_mode": "RL_GRPO", "model_checkpoint_path": "unused",
        "reward_function": {"terms": [{"rule": rule}]},
        "scorer": {"batch_groups": 16 if rule == "math" else 64, "processes": 1},
    }))
    env = {**os.environ, "RLSTREAM_LOG": "WARNING"}
    proc = subprocess.Popen([sys.executable, "-m", "rlstream.cli", "scorer", str(cfg), "--nats", server_url, "--id", "bench"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        return await _watch(js, lay, proc, len(groups), rule if rule == "exact_match" else "")
    finally:
        proc.terminate()
        proc.wait(30)
        await nc.close()


async def raw_scorer(server_url: str, run: str, n: int) -> None:
    """The baseline scorer: nats-py and msgpack only, no validation, no dedupe, no DLQ."""
    import msgpack

    nc = await connect(url=server_url, name="raw-scorer")
    js = nc.jetstream()
    lay = await ensure_layout(js, run)
    sub = await js.pull_subscribe_bind("scorers", lay.rollouts_stream)
    done = 0
    while done < n:
        try:
            msgs = await sub.fetch(64, timeout=2.0)
        except Exception:
            continue
        futures = []
        for m in msgs:
            g = msgpack.unpackb(m.data)
            answer = g["columns"]["answer"]
            scores = [rewards.exact_match(t, answer) for t in g["texts"]]
            out = msgpack.packb({"id": g["id"], "rollout": g, "rewards": scores})
            futures.append(await js.publish_async(lay.scored, out))
        await asyncio.gather(*futures)
        for m in msgs:
            await m.ack()
        done += len(msgs)
    await nc.close()


async def raw_rate(server_url: str, groups: list[RolloutGroup], run: str) -> tuple[float, int]:
    """Groups/s of :func:`raw_scorer` in its own process, timed like the scorer."""
    nc, js, lay = await staged(server_url, groups, run)
    proc = subprocess.Popen([sys.executable, __file__, "--raw-scorer", server_url, run, str(len(groups))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        return await _watch(js, lay, proc, len(groups), "raw")
    finally:
        proc.terminate()
        proc.wait(30)
        await nc.close()


CPU_US: dict[str, list[float]] = {}
"""CPU microseconds per group of each scorer process (user + system), per round: the figure a
shared machine does not skew the way it skews wall time."""


def _cpu_s(proc) -> float | None:
    try:
        t = psutil.Process(proc.pid).cpu_times()
    except psutil.Error:  # already gone: no figure this round
        return None
    return t.user + t.system


async def _watch(js, lay, proc, n: int, side: str = "") -> tuple[float, int]:
    """Groups/s between the first and the last scored group seen on the scored stream, and how
    many were already scored at the first sighting (the direct loop's clock starts there too).
    The process's CPU time over the same span, per group, goes to ``CPU_US[side]``."""
    first = last = None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        done = (await js.stream_info(lay.scored_stream)).state.messages
        now = time.perf_counter()
        if done and first is None:
            first = (now, done, _cpu_s(proc))
        if done >= n:
            last = (now, done, _cpu_s(proc))
            break
        if proc.poll() is not None and proc.returncode != 0:
            raise RuntimeError(f"scorer exited: {proc.stderr.read().decode()[-2000:]}")
        await asyncio.sleep(0.05)  # light polling: the scorer and the server share these cores
    if last is None or first is None or last[0] <= first[0]:
        raise RuntimeError("the scorer did not finish")
    if side and last[1] > first[1] and first[2] is not None and last[2] is not None:
        CPU_US.setdefault(side, []).append(1e6 * (last[2] - first[2]) / (last[1] - first[1]))
    return (last[1] - first[1]) / (last[0] - first[0]), first[1]


async def run(sizes: dict[str, int], rounds: int) -> dict[str, tuple[float, float]]:
    out = {}
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(Path(d) / "store") as server:
        for rule, n in sizes.items():
            ours, direct, raw = [], [], []
            for r in range(rounds):  # interleaved, best of each: drift on a shared machine hits both
                groups = make_groups(n, f"b{rule}{r}")
                rate, first = await scorer_rate(server.url, rule, groups, f"b{rule.replace('_', '')}{r}", Path(d))
                ours.append(rate)
                direct.append(direct_rate(rule, groups, first))
                if rule == "exact_match":
                    raw.append((await raw_rate(server.url, groups, f"braw{r}"))[0])
            out[rule] = (max(ours), max(direct), max(raw) if raw else None)
    return out


def main() -> None:
    args = parser(__doc__).parse_args()
    sizes, rounds = ({"exact_match": 2000, "math": 120}, 2) if args.quick else ({"exact_match": 20000, "math": 1000}, 3)
    res = asyncio.run(run(sizes, rounds))
    rows = []
    for rule, (ours, direct, raw) in res.items():
        rows.append((f"{rule}: direct call", direct, direct * G, 1.0, "-"))
        if raw is not None:
            rows.append((f"{rule}: raw nats-py scorer", raw, raw * G, raw / direct, 1.0))
        rows.append((f"{rule}: rlstream scorer", ours, ours * G, ours / direct, ours / raw if raw else "-"))
    table(f"scoring groups of {G} completions", rows, ("path", "groups/s", "completions/s", "vs direct", "vs raw nats-py"))
    cpu = {side: min(v) for side, v in CPU_US.items() if v}
    for side, label in (("raw", "raw nats-py scorer"), ("exact_match", "rlstream scorer")):
        if side in cpu:
            rounds = ", ".join(f"{v:.1f}" for v in CPU_US[side])
            print(f"exact_match: {label}: {cpu[side]:.1f} CPU us/group (each round: {rounds})")
    (m_ours, m_direct, _), (c_ours, c_direct, c_raw) = res["math"], res["exact_match"]
    verdict("scorers", math_scorer_groups_per_s=m_ours, math_direct_groups_per_s=m_direct, math_ratio=m_ours / m_direct,
            exact_match_scorer_groups_per_s=c_ours, exact_match_direct_groups_per_s=c_direct,
            exact_match_raw_groups_per_s=c_raw, exact_match_vs_raw=c_ours / c_raw,
            exact_match_cpu_us_per_group=cpu.get("exact_match"), exact_match_raw_cpu_us_per_group=cpu.get("raw"),
            exact_match_ratio=c_ours / c_direct, exact_match_ok=c_ours / c_direct >= 0.9,
            ratio=min(m_ours / m_direct, c_ours / c_direct), goal=0.9)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--raw-scorer":
        asyncio.run(raw_scorer(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    else:
        main()
