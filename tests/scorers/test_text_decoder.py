"""The scorer's decode of completions that carry no text: ``tokenizers`` read directly where it
decodes as transformers does, transformers otherwise."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from rlstream.config import Config
from rlstream.scorers.loop import plain_tokenizer, text_decoder


def cfg_for(model_dir) -> Config:
    return Config.model_validate({"model_checkpoint_path": str(model_dir), "data_source": {"path": "p.jsonl"},
                                  "training_mode": "RL_GRPO", "reward_function": {"type": "rule_based", "answer_column": "answer",
                                                                                  "terms": [{"rule": "exact_match"}]}})


def sequences(vocab: int, specials: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = [rng.integers(0, vocab, int(n)).astype(np.int32) for n in rng.integers(1, 24, 40)]
    out.append(np.array(specials, np.int32))  # only special tokens: decodes to ""
    out.append(np.array([specials[0], *out[0], specials[-1]], np.int32))
    return out


def test_plain_tokenizer_decodes_as_transformers(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert plain_tokenizer(tiny_model_dir) is not None
    decode = text_decoder(cfg_for(tiny_model_dir))
    specials = tok.all_special_ids
    assert len(specials) >= 3  # <s>, </s>, <pad>, the chat markers
    seqs = sequences(len(tok), specials)
    assert decode(seqs[-2]) == ""
    assert [decode(ids) for ids in seqs] == [tok.decode(ids.tolist(), skip_special_tokens=True) for ids in seqs]


def test_a_special_token_that_tokenizer_json_does_not_mark_goes_through_transformers(tiny_model_dir, tmp_path):
    """Files that disagree on what is special are left to transformers, whatever it makes of them."""
    from transformers import AutoTokenizer

    d = tmp_path / "tok"
    shutil.copytree(tiny_model_dir, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    marker = next(t for t in tj["added_tokens"] if t["content"] == "<|im_end|>")
    marker["special"] = False
    (d / "tokenizer.json").write_text(json.dumps(tj))
    assert plain_tokenizer(d) is None
    tok = AutoTokenizer.from_pretrained(str(d))
    ids = np.array([*tok("12", add_special_tokens=False)["input_ids"], tok.convert_tokens_to_ids("<|im_end|>")], np.int32)
    assert text_decoder(cfg_for(d))(ids) == tok.decode(ids.tolist(), skip_special_tokens=True)


@pytest.mark.parametrize("change", [{"tokenizer_class": "LlamaTokenizer"}, {"clean_up_tokenization_spaces": True}])
def test_model_specific_classes_and_space_clean_up_go_through_transformers(tiny_model_dir, tmp_path, change):
    d = tmp_path / "tok"
    shutil.copytree(tiny_model_dir, d)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**conf, **change}))
    assert plain_tokenizer(d) is None


def test_the_plain_decoder_does_not_import_transformers(tiny_model_dir):
    """The point of the plain path: a scorer whose first batch needs a decode does not spend
    seconds importing transformers (and torch) on the run's critical path."""
    code = ("import sys, numpy as np; from tests.scorers.test_text_decoder import cfg_for; "
            "from rlstream.scorers.loop import text_decoder; "
            f"d = text_decoder(cfg_for({str(tiny_model_dir)!r})); d(np.array([5, 6, 7], np.int32)); "
            "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
