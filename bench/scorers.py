"""Scorer throughput: groups/s through ``rlstream scorer`` against calling the same reward
rule directly, in the same run.

Through the scorer: the groups (8 completions each) wait on the rollouts stream of an
embedded nats-server; one ``rlstream scorer`` process (``scorer.processes: 1`` for
math-verify) pulls, decodes, scores, publishes ScoredGroups and acks. Its rate is taken
between the first and the last scored group seen on the scored stream. Directly: the same
rule over the same completions with no broker at all, timed from the same event: the moment
as many groups are done as the scorer had published when it was first seen.

The direct path gets the scorer's processes. For ``exact_match`` (microseconds per group,
scored on the scorer's event loop) it is one Python loop in this process. For ``math``
(math-verify: the scoring dominates) it is the scorer's own pool, one worker process
(``rlstream.scorers.scoring.math_pool(1)``) running ``rewards.math_scores`` with its timeouts,
fed batches of ``MATH_BATCH`` groups, two in flight (``scorer.batch_groups`` and
``pipeline_batches``). This process only hands the batches over, as the scorer's main process
does between its pulls and publishes. Goal: ratio >= 0.9 (the final JSON's ``ratio`` and
``goal``: math-verify's).

A cheap rule cannot reach that goal through any broker: the rule costs microseconds per group,
one JetStream hop in Python hundreds. So for ``exact_match`` a third path shows what the loop
itself costs: a hand-written raw nats-py scorer in its own process. It decodes with plain
``msgpack.unpackb`` and no validation, scores with the same rule and publishes a plain msgpack
result with ``publish_async``. It acks each message once every publish of its batch is acked,
which is the scorer's at-least-once order. Its pull is the fastest nats-py has, tried both
ways in every round, and the faster is the baseline:

- ``pull``: the run's durable pull consumer, ``fetch`` of ``RAW_FETCH`` (256) messages a
  request (nats-py's ``fetch`` waits on a task per message);
- ``push``: a push consumer with a callback, which nats-py delivers from one task with no
  per-message wait. The callback scores batches of up to ``RAW_FETCH``, whatever has arrived.

It does less than the product must (no validation, dead letters, de-duplication by message id,
in-progress acks, origin header, metrics or reward components), so it is a ceiling for all of
that. The rlstream scorer's ratio against it is printed too (goal 0.8, ``exact_match_ok``); its
ratio against the direct loop is printed for the record, with no goal.

Each scorer process's CPU time per group (user + system, from the first scored group seen to
the last) is printed as well: a shared machine moves it far less than it moves groups/s.

Every round runs the sides in turn, in mirrored order from round to round (A B C, C B A, ...), so
drift on a shared machine favours none of them; each side's best round is kept.

    python bench/scorers.py [--quick]
"""

from __future__ import annotations

import asyncio
import itertools
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
from rlstream.scorers.scoring import math_pool  # noqa: E402

G = 8
MATH_BATCH, EXACT_BATCH = 16, 64
"""The scorer's ``batch_groups`` for each rule, and the direct math path's batches."""
IN_FLIGHT = 2
"""Batches in the math pool at once: the scorer's ``pipeline_batches`` default."""
RAW_FETCH = 256
"""Messages a raw scorer takes at once: a ``fetch`` batch, or the most a push callback scores."""
RAW_WAYS = ("pull", "push")


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


def direct_times(rule: str, groups: list[RolloutGroup], pool) -> list[float]:
    """The ``perf_counter`` time at which each group was scored, on the direct path: ``exact_match``
    in a loop here, ``math`` in ``pool`` (one worker, ``IN_FLIGHT`` batches of ``MATH_BATCH``)."""
    if rule == "math":
        _score_in_pool(pool, groups[:MATH_BATCH])  # the scorer's warm-up: imports and first-call caches
        return _score_in_pool(pool, groups)
    _score_in_loop(groups[:8])
    return _score_in_loop(groups)


def direct_rate(done: list[float], first: int) -> float:
    """Groups/s of the direct path, timed like the scorer: from the moment its first ``first``
    groups are scored (the first batch the scorer was seen to publish) to its last."""
    k = min(max(first, 1), len(done) - 1)
    return (len(done) - k) / (done[-1] - done[k - 1])


def _texts_and_answers(groups: list[RolloutGroup]) -> tuple[list[str], list[str]]:
    texts = [s.text for g in groups for s in g.samples]
    answers = [g.columns["answer"] for g in groups for _ in g.samples]
    return texts, answers


def _score_in_loop(groups: list[RolloutGroup]) -> list[float]:
    done = []
    for g in groups:
        answer = g.columns["answer"]
        [rewards.exact_match(s.text, answer) for s in g.samples]
        done.append(time.perf_counter())
    return done


def _score_in_pool(pool, groups: list[RolloutGroup]) -> list[float]:
    """math-verify over ``groups`` in ``pool``, ``IN_FLIGHT`` batches submitted at a time, as the
    scorer's pipeline keeps them; each group's time is its batch's."""
    batches = iter([groups[i:i + MATH_BATCH] for i in range(0, len(groups), MATH_BATCH)])
    pending = [(len(b), pool.submit(rewards.math_scores, *_texts_and_answers(b))) for b in itertools.islice(batches, IN_FLIGHT)]
    done: list[float] = []
    while pending:
        size, future = pending.pop(0)
        future.result()
        done += [time.perf_counter()] * size
        if (batch := next(batches, None)) is not None:
            pending.append((len(batch), pool.submit(rewards.math_scores, *_texts_and_answers(batch))))
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
        "scorer": {"batch_groups": MATH_BATCH if rule == "math" else EXACT_BATCH, "processes": 1, "pipeline_batches": IN_FLIGHT},
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


async def raw_scorer(server_url: str, run: str, n: int, way: str) -> None:
    """The baseline scorer: nats-py and msgpack only, no validation, no dedupe, no DLQ. ``way``:
    ``pull`` (``fetch`` of ``RAW_FETCH`` on the run's durable consumer) or ``push`` (a push
    consumer whose callback scores what has arrived, up to ``RAW_FETCH`` at a time)."""
    import msgpack
    import nats.errors
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    nc = await connect(url=server_url, name="raw-scorer")
    js = nc.jetstream()
    lay = await ensure_layout(js, run)
    scored = asyncio.Event()
    count = 0

    async def score(msgs) -> None:
        nonlocal count
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
        count += len(msgs)
        if count >= n:
            scored.set()

    if way == "pull":
        sub = await js.pull_subscribe_bind("scorers", lay.rollouts_stream)
        while count < n:
            try:
                msgs = await sub.fetch(RAW_FETCH, timeout=2.0)
            except nats.errors.TimeoutError:
                continue
            await score(msgs)
    else:
        held, subs = [], []

        async def on_message(m) -> None:  # nats-py calls it for one message at a time, in order
            held.append(m)
            if len(held) >= RAW_FETCH or not subs or subs[0].pending_msgs == 0:
                batch = held[:]
                held.clear()
                await score(batch)

        subs.append(await js.subscribe(lay.rollouts, stream=lay.rollouts_stream, cb=on_message, manual_ack=True,
                                       config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                                                             max_ack_pending=-1)))
        await scored.wait()
    await nc.close()


async def raw_rate(server_url: str, groups: list[RolloutGroup], run: str, way: str) -> tuple[float, int]:
    """Groups/s of :func:`raw_scorer` in its own process, timed like the scorer."""
    nc, js, lay = await staged(server_url, groups, run)
    proc = subprocess.Popen([sys.executable, __file__, "--raw-scorer", way, server_url, run, str(len(groups))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        return await _watch(js, lay, proc, len(groups), f"raw_{way}")
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


async def run(sizes: dict[str, int], rounds: int) -> dict[str, dict[str, float]]:
    """Each rule's best groups/s per side over ``rounds``: ``scorer``, ``direct`` and, for
    ``exact_match``, ``raw_pull`` and ``raw_push``."""
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(Path(d) / "store") as server:
        pool = math_pool(1)
        try:
            pool.submit(rewards.warm_up).result()
            for rule, n in sizes.items():
                rates: dict[str, list[float]] = {}
                for r in range(rounds):
                    groups = make_groups(n, f"b{rule}{r}")
                    tag = rule.replace("_", "")
                    sides = ["scorer", "direct"] + ([f"raw_{way}" for way in RAW_WAYS] if rule == "exact_match" else [])
                    done: list[float] = []
                    first = 0
                    for side in (sides if r % 2 == 0 else sides[::-1]):
                        if side == "scorer":
                            rate, first = await scorer_rate(server.url, rule, groups, f"b{tag}{r}", Path(d))
                            rates.setdefault(side, []).append(rate)
                        elif side == "direct":
                            done = direct_times(rule, groups, pool)
                        else:
                            way = side.removeprefix("raw_")
                            rates.setdefault(side, []).append((await raw_rate(server.url, groups, f"braw{way}{tag}{r}", way))[0])
                    # the direct path's clock starts where the scorer's did, whichever ran first
                    rates.setdefault("direct", []).append(direct_rate(done, first))
                out[rule] = {side: max(v) for side, v in rates.items()}
        finally:
            pool.shutdown()
    return out


def main() -> None:
    args = parser(__doc__).parse_args()
    sizes, rounds = ({"exact_match": 2000, "math": 120}, 2) if args.quick else ({"exact_match": 20000, "math": 1000}, 4)
    res = asyncio.run(run(sizes, rounds))
    math_res, exact = res["math"], res["exact_match"]
    raw_best = max(RAW_WAYS, key=lambda way: exact[f"raw_{way}"])
    raw = exact[f"raw_{raw_best}"]
    rows = []
    for rule, sides in res.items():
        direct, ours = sides["direct"], sides["scorer"]
        rows.append((f"{rule}: direct call", direct, direct * G, 1.0, "-"))
        for way in RAW_WAYS if rule == "exact_match" else ():
            x = sides[f"raw_{way}"]
            rows.append((f"{rule}: raw nats-py scorer, {way}" + (" (baseline)" if way == raw_best else ""), x, x * G,
                         x / direct, x / raw))
        rows.append((f"{rule}: rlstream scorer", ours, ours * G, ours / direct, ours / raw if rule == "exact_match" else "-"))
    table(f"scoring groups of {G} completions ({rounds} rounds, mirrored order, best of each; math: one worker process "
          "on both paths)", rows, ("path", "groups/s", "completions/s", "vs direct", "vs raw nats-py (faster pull)"))
    cpu = {side: min(v) for side, v in CPU_US.items() if v}
    for side, label in ((f"raw_{way}", f"raw nats-py scorer, {way}") for way in RAW_WAYS):
        if side in cpu:
            print(f"exact_match: {label}: {cpu[side]:.1f} CPU us/group (each round: {', '.join(f'{v:.1f}' for v in CPU_US[side])})")
    if "exact_match" in cpu:
        print(f"exact_match: rlstream scorer: {cpu['exact_match']:.1f} CPU us/group "
              f"(each round: {', '.join(f'{v:.1f}' for v in CPU_US['exact_match'])})")
    m_ratio, c_ratio = math_res["scorer"] / math_res["direct"], exact["scorer"] / exact["direct"]
    verdict("scorers", math_scorer_groups_per_s=math_res["scorer"], math_direct_groups_per_s=math_res["direct"],
            math_ratio=m_ratio, math_direct_processes="one pool worker, as the scorer's",
            exact_match_scorer_groups_per_s=exact["scorer"], exact_match_direct_groups_per_s=exact["direct"],
            exact_match_raw_pull_groups_per_s=exact["raw_pull"], exact_match_raw_push_groups_per_s=exact["raw_push"],
            exact_match_raw_groups_per_s=raw, exact_match_raw_way=raw_best, exact_match_vs_raw=exact["scorer"] / raw,
            exact_match_vs_raw_goal=0.8, exact_match_cpu_us_per_group=cpu.get("exact_match"),
            exact_match_raw_cpu_us_per_group=cpu.get(f"raw_{raw_best}"), exact_match_ratio=c_ratio,
            exact_match_ok=exact["scorer"] / raw >= 0.8, ratio=m_ratio, goal=0.9)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--raw-scorer":
        asyncio.run(raw_scorer(sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[2]))
    else:
        main()
