"""Multi-turn episodes with the real vLLM engine (vllm-cpu): every model turn is its own engine
request, and each turn's recorded log-probs are HF's teacher-forced ones over the prompt and
every token before it (environment tokens included), so the engine generated from exactly the
tokens the record holds. The same engine then serves an openai-client agent through the gateway,
whose records must be what the engine sampled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlstream.schemas import RolloutGroup

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_episode_turns_are_generated_from_the_recorded_tokens(tiny_model_dir, tmp_path):
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_episodes_script.py")), str(tiny_model_dir), str(tmp_path)],
                          capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"aborts": 0, "requests": 2 * 2 * 3, "closed": 4}  # one request per model turn
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    for path in sorted(tmp_path.glob("*.msgpack")):
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
    # The agent sends its reply back as text: when the chat template's re-tokenization of it is
    # not the sampled ids, the second call does not extend the first and trace() says so
    gw = json.loads((tmp_path / "gateway.json").read_text())
    assert len(gw["calls"]) == 2 and [c["policy_version"] for c in gw["calls"]] == [0, 0]
    for call, seen in zip(gw["calls"], gw["seen"]):
        assert 1 <= len(call["token_ids"]) <= 8 and seen["token_ids"] == call["token_ids"]
        assert seen["logprobs"] == pytest.approx(call["logprobs"], abs=1e-6)
        ids = torch.as_tensor(call["prompt_ids"] + call["token_ids"])[None]
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        n = len(call["prompt_ids"])
        forced = lp[n - 1:-1].gather(-1, ids[0, n:, None]).squeeze(-1).numpy()
        np.testing.assert_allclose(call["logprobs"], forced, atol=2e-4)
    first, second = gw["calls"]
    if second["prompt_ids"][:len(first["prompt_ids"]) + len(first["token_ids"])] == first["prompt_ids"] + first["token_ids"]:
        mask = np.asarray(gw["trace"]["mask"])
        assert np.asarray(gw["trace"]["token_ids"])[mask == 1].tolist() == first["token_ids"] + second["token_ids"]
    else:
        assert "does not extend the conversation" in gw["trace_error"]
