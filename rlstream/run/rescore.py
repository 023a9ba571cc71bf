"""``rlstream replay BUNDLE.tar --rescore``: run the config's reward terms again on the bundled
groups and name the groups whose rewards differ from the recorded ones.

The rollouts in the bundle's records go through the scorer stage's own :class:`Scorer` (the
same flattening into prompts, completions and columns, the same terms and weights), in this
process, no broker. ``--set reward_function...`` tries another reward on the same inputs. A
group differs when any sample's total reward differs (bitwise by default, NaN equal to NaN,
or within ``--rtol``/``--atol``), or when a term raised on it. Exit 0 when none differs, 1
when some do, 2 when the bundle or the config cannot be used.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

from rlstream.config import Config
from rlstream.learner.bundle import Bundle, open_bundle
from rlstream.learner.replay import ReplayError, command
from rlstream.schemas import ScoredGroup
from rlstream.scorers.functions import RewardError


async def score_again(cfg: Config, groups: list[ScoredGroup]) -> list[ScoredGroup | str]:
    from rlstream.scorers.loop import text_decoder
    from rlstream.scorers.scoring import Scorer

    scorer = Scorer(cfg, decode=text_decoder(cfg))
    await scorer.start()
    try:
        return await scorer.score([g.rollout for g in groups], scorer_id="rescore")
    finally:
        await scorer.close()


def same_reward(recorded: float, rescored: float, rtol: float, atol: float) -> bool:
    if math.isnan(recorded) or math.isnan(rescored):
        return math.isnan(recorded) and math.isnan(rescored)
    if rtol == 0 and atol == 0:
        return recorded == rescored
    return math.isclose(recorded, rescored, rel_tol=rtol, abs_tol=atol)


def rescore(bundle: Bundle, overrides: list[str], *, rtol: float = 0.0, atol: float = 0.0) -> dict[str, Any]:
    cfg = bundle.config(overrides)
    seqs = bundle.seqs()
    groups = [bundle.group(q) for q in seqs]
    try:
        again = asyncio.run(score_again(cfg, groups))
    except RewardError as exc:  # a term that cannot be built (an unknown function, bad params)
        raise ReplayError(str(exc)) from None
    differs = []
    for q, g, new in zip(seqs, groups, again):
        recorded = [float(v) for v in g.rewards.tolist()]
        if isinstance(new, str):
            differs.append({"seq": q, "id": g.id, "recorded": recorded, "rescored": None, "error": new})
            continue
        rescored = [float(v) for v in new.rewards.tolist()]
        if not all(same_reward(a, b, rtol, atol) for a, b in zip(recorded, rescored, strict=True)):
            differs.append({"seq": q, "id": g.id, "recorded": recorded, "rescored": rescored,
                            "components": {k: [float(x) for x in v.tolist()] for k, v in new.components.items()}})
    return {"bundle": str(bundle.path), "groups": len(groups), "differs": differs, "ok": not differs,
            "terms": [t.name for t in cfg.reward_function.terms]}


def cli(args) -> int:
    def work() -> dict[str, Any]:
        with open_bundle(Path(args.run_dir)) as bundle:
            return rescore(bundle, args.set, rtol=getattr(args, "rtol", 0.0) or 0.0, atol=getattr(args, "atol", 0.0) or 0.0)

    def show(result: dict[str, Any]) -> None:
        for d in result["differs"]:
            if d["rescored"] is None:
                print(f"group {d['id']} (seq {d['seq']}): recorded {d['recorded']}, rescoring raised:\n{d['error']}")
            else:
                print(f"group {d['id']} (seq {d['seq']}): recorded {d['recorded']}, rescored {d['rescored']}")
        n = len(result["differs"])
        print(f"{n} of {result['groups']} groups differ" if n else f"all {result['groups']} groups score as recorded")

    return command(work, args.json, show)
