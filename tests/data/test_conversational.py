"""TRL's conversational format, rendered exactly as TRL 1.x renders it, in every mode.

The references are TRL's own helpers (``trl.data_utils.apply_chat_template`` and its SFT and
DPO tokenisation, reproduced from TRL's ``tokenize_fn``s with TRL's ``_tokenize`` and
``common_prefix_length``); the tests are skipped when trl is not installed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from rlstream.config import DataSource
from rlstream.learner.offline import load_dpo, load_sft

SYSTEM = {"role": "system", "content": "You add numbers."}
USER = {"role": "user", "content": "What is 2 + 3?"}
ASSISTANT = {"role": "assistant", "content": "5"}
WRONG = {"role": "assistant", "content": "7"}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def trl_data():
    return pytest.importorskip("trl.data_utils")


def _write(tmp_path, rows) -> str:
    p = tmp_path / "data.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def test_tiny_tokenizer_has_a_chatml_template_that_keeps_every_role(tok):
    text = tok.apply_chat_template([SYSTEM, USER, ASSISTANT], tokenize=False)
    assert text == ("<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                    "<|im_start|>assistant\n5<|im_end|>\n")
    assert tok.apply_chat_template([USER], tokenize=False, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    # the markers are single tokens, as in Qwen's tokenizer
    assert len(tok("<|im_start|>", add_special_tokens=False)["input_ids"]) == 1


def _trl_prompt_completion_ids(trl_data, tok, prompt, completion):
    """TRL 1.16 SFTTrainer / DPOTrainer tokenize_fn for one conversational prompt + completion."""
    prompt_ids = trl_data._tokenize(tok, prompt, add_generation_prompt=True)["input_ids"]
    full = trl_data._tokenize(tok, prompt + completion)["input_ids"]
    n = trl_data.common_prefix_length(prompt_ids, full)
    return full[:n], full[n:]


def test_sft_conversational_prompt_completion_matches_trl(tmp_path, tok, trl_data):
    row = {"prompt": [SYSTEM, USER], "completion": [ASSISTANT]}
    (ex,) = load_sft(DataSource(type="off_policy", path=_write(tmp_path, [row])), tok)
    want_prompt, want_completion = _trl_prompt_completion_ids(trl_data, tok, row["prompt"], row["completion"])
    assert ex.prompt_ids.tolist() == want_prompt and ex.completion_ids.tolist() == want_completion
    rendered = trl_data.maybe_apply_chat_template(row, tok)
    assert (ex.prompt_text, ex.completion_text) == (rendered["prompt"], rendered["completion"])
    assert "[{" not in ex.prompt_text + ex.completion_text  # not the Python repr of the list


def test_sft_messages_is_the_template_s_rendering_with_loss_on_the_last_assistant_turn(tmp_path, tok, trl_data):
    msgs = [SYSTEM, USER, ASSISTANT, {"role": "user", "content": "And 1 + 1?"}, {"role": "assistant", "content": "2"}]
    (ex,) = load_sft(DataSource(type="off_policy", path=_write(tmp_path, [{"messages": msgs}])), tok)
    # TRL's language-modeling case: the whole conversation as the template renders it, no EOS added by hand
    full = trl_data._tokenize(tok, msgs)["input_ids"]
    assert np.concatenate([ex.prompt_ids, ex.completion_ids]).tolist() == full
    assert tok.decode(ex.completion_ids.tolist()) == "2<|im_end|>\n"
    assert ex.prompt_text + ex.completion_text == trl_data.maybe_apply_chat_template({"messages": msgs}, tok)["text"]


def test_dpo_conversational_keeps_the_system_turn_and_matches_trl(tmp_path, tok, trl_data):
    row = {"prompt": [SYSTEM, USER], "chosen": [ASSISTANT], "rejected": [WRONG]}
    (pair,) = load_dpo(DataSource(type="off_policy", path=_write(tmp_path, [row])), tok)
    prompt_ids = trl_data._tokenize(tok, row["prompt"], add_generation_prompt=True)["input_ids"]
    chosen = trl_data._tokenize(tok, row["prompt"] + row["chosen"])["input_ids"]
    rejected = trl_data._tokenize(tok, row["prompt"] + row["rejected"])["input_ids"]
    n = min(trl_data.common_prefix_length(prompt_ids, chosen), trl_data.common_prefix_length(prompt_ids, rejected))
    assert pair.prompt_ids.tolist() == prompt_ids[:n]
    assert pair.chosen_ids.tolist() == chosen[n:] and pair.rejected_ids.tolist() == rejected[n:]
    assert "You add numbers." in pair.prompt_text
    rendered = trl_data.maybe_apply_chat_template(row, tok)
    assert (pair.prompt_text, pair.chosen_text, pair.rejected_text) == (rendered["prompt"], rendered["chosen"], rendered["rejected"])


def test_dpo_implicit_prompt_is_extracted_as_trl_does(tmp_path, tok, trl_data):
    row = {"chosen": [SYSTEM, USER, ASSISTANT], "rejected": [SYSTEM, USER, WRONG]}
    (pair,) = load_dpo(DataSource(type="off_policy", path=_write(tmp_path, [row])), tok)
    explicit = trl_data.extract_prompt(dict(row))
    assert explicit["prompt"] == [SYSTEM, USER]
    rendered = trl_data.apply_chat_template(explicit, tok)
    assert (pair.prompt_text, pair.chosen_text, pair.rejected_text) == (rendered["prompt"], rendered["chosen"], rendered["rejected"])


def test_rl_prompt_as_messages_is_fed_and_rendered_as_trl_grpo_does(tok, trl_data):
    from rlstream.config import Config
    from rlstream.producers.backends.base import Backend
    from rlstream.producers.feeder import build_prompts

    cfg = Config.model_validate({"training_mode": "RL_GRPO", "model_checkpoint_path": "m"})
    (p,) = build_prompts([{"prompt": [SYSTEM, USER], "answer": "5"}], cfg)
    assert p.messages == [SYSTEM, USER] and p.columns == {"answer": "5"}
    backend = Backend()
    backend.tokenizer = tok
    ids, text = backend.encode_prompt(p)
    # GRPOTrainer._tokenize_prompts: apply_chat_template(add_generation_prompt=True, tokenize=True)
    want = tok.apply_chat_template([[SYSTEM, USER]], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"][0]
    assert ids.tolist() == list(want)
    assert text == trl_data.maybe_apply_chat_template({"prompt": [SYSTEM, USER]}, tok)["prompt"]
