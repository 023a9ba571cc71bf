"""Multi-turn episodes in the learner: the loss mask reaches every mode's loss, and per-turn
advantages, against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlstream.config import DAPOParams, GRPOParams, GSPOParams, parse_config
from rlstream.learner import advantages as adv
from rlstream.learner.batching import Row, collate, pack
from rlstream.learner.losses import PolicyBatch, dapo_loss, grpo_loss, gspo_loss
from rlstream.learner.steps import group_rows
from rlstream.schemas import RolloutGroup, Sample, ScoredGroup

LN2 = math.log(2.0)


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), torch.as_tensor(expected, dtype=torch.float32),
                               atol=tol, rtol=0)


def test_collate_and_pack_carry_the_loss_mask():
    model_env = Row(np.array([1, 2]), np.array([10, 11, 12, 13]), np.zeros(4, np.float32), loss_mask=np.array([1, 0, 0, 1], np.uint8))
    plain = Row(np.array([3]), np.array([14, 15]), np.zeros(2, np.float32))
    dropped = Row(np.array([3]), np.array([16, 17]), np.zeros(2, np.float32), keep=False, loss_mask=np.array([1, 1], np.uint8))
    tb = collate([model_env, plain, dropped], pad_id=0, max_len=16)
    assert tb.mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert tb.targets[0].tolist() == [10, 11, 12, 13]  # environment tokens are inputs and targets, only masked
    (packed,) = pack([model_env, plain], pad_id=0, max_len=16, rows_per_batch=4)
    assert packed.mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]


# One sequence of 4 tokens: model, env, env, model. Behaviour log-probs as recorded (0.0 on the
# environment's tokens). The current policy moved by ln 1.1 on token 0 and ln 0.5 on token 3; the
# environment's tokens get garbage that would change every figure if they counted.
MASK = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
OLD = torch.tensor([[-1.0, 0.0, 0.0, -1.0]])
LOGP = torch.tensor([[-1.0 + math.log(1.1), -0.3, -0.2, -1.0 - LN2]], requires_grad=True)
REF = torch.tensor([[-1.0 + math.log(1.1) - LN2, 4.0, 4.0, -1.0 - 2 * LN2]])  # model tokens: ref/pi = 1/2


def batch(**kw) -> PolicyBatch:
    return PolicyBatch(logprobs=LOGP, old_logprobs=OLD, advantages=torch.tensor([1.0]), mask=MASK, **kw)


def test_grpo_and_dapo_count_only_model_tokens():
    # ratios 1.1 and 0.5, A = 1, clip 0.2: -min(1.1, 1.1) = -1.1 and -min(0.5, 0.8) = -0.5; token mean -0.8
    loss, m = grpo_loss(batch(), GRPOParams(kl_coefficient=0.0, off_policy_correction="none", clip_range=0.2))
    close(loss, -0.8)
    assert m["policy/tokens"] == 2.0
    close(m["policy/ratio_mean"], (1.1 + 0.5) / 2)
    loss, _ = dapo_loss(batch(), DAPOParams(off_policy_correction="none", clip_low=0.2, clip_high=0.28))
    close(loss, -0.8)


def test_kl_and_entropy_count_only_model_tokens():
    # k3 with ref/pi = 1/2 on both model tokens: exp(-ln2) + ln2 - 1 = 0.193147; the env tokens' ref is far off
    k3 = 0.5 + LN2 - 1.0
    entropy = torch.tensor([[1.0, 50.0, 50.0, 3.0]])
    loss, m = grpo_loss(batch(ref_logprobs=REF, entropy=entropy),
                        GRPOParams(kl_coefficient=0.1, off_policy_correction="none", clip_range=0.2))
    close(m["policy/kl"], k3)
    close(m["loss/kl"], 0.1 * k3)
    close(loss, -0.8 + 0.1 * k3)
    close(m["policy/entropy"], 2.0)


def test_gspo_sequence_ratio_uses_only_model_tokens():
    # s = exp(mean over the model tokens of logp - old) = exp((ln 1.1 + ln 0.5) / 2) = sqrt(0.55) = 0.741620;
    # A = 1, clip [0.8, 1.2]: -min(s, 0.8) = -0.741620 on each model token; seq-mean-token-mean -> -0.741620
    loss, m = gspo_loss(batch(), GSPOParams(off_policy_correction="none", clip_low=0.2, clip_high=0.2))
    close(loss, -math.sqrt(0.55))
    close(m["policy/ratio_mean"], math.sqrt(0.55))


def test_ppo_gae_skips_environment_tokens():
    # terminal reward 1 on the last model token (3); V = [0.5, 9, 9, 0.25], gamma = lam = 1:
    # A3 = 1 + 0 - 0.25 = 0.75; A0 = (0 + V3 - V0) + A3 = (0.25 - 0.5) + 0.75 = 0.5; env tokens 0
    rewards = adv.place_terminal_reward(torch.tensor([1.0]), MASK)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    a, r = adv.gae(rewards, torch.tensor([[0.5, 9.0, 9.0, 0.25]]), MASK, gamma=1.0, lam=1.0)
    close(a, [[0.5, 0.0, 0.0, 0.75]])
    close(r, [[1.0, 0.0, 0.0, 1.0]])


def test_turn_returns_and_per_turn_group_relative_by_hand():
    # r = [0.5, 0, 1], gamma 0.5: R2 = 1, R1 = 0 + 0.5 * 1 = 0.5, R0 = 0.5 + 0.5 * 0.5 = 0.75
    assert adv.turn_returns([0.5, 0.0, 1.0], 0.5) == [0.75, 0.5, 1.0]
    # over the group's turns [0.75, 0.5, 1, 0]: mean 0.5625, population var 0.546875 / 4 = 0.13671875, std 0.369755
    std = math.sqrt(0.13671875)
    out = adv.per_turn_group_relative([[0.75, 0.5, 1.0], [0.0]])
    close(out[0], [0.1875 / std, -0.0625 / std, 0.4375 / std], 1e-4)
    close(out[1], [-0.5625 / std], 1e-4)
    # centred only: mean of [0.75, 0.5, 0] = 5/12 -> [1/3, 1/12], [-5/12]
    centred = adv.per_turn_group_relative([[0.75, 0.5], [0.0]], scale=False)
    close(centred[0], [1 / 3, 1 / 12])
    close(centred[1], [-5 / 12])


def episode_group() -> ScoredGroup:
    """Sample 0: model (2 tokens), env (3), model (1), turn rewards [0.5, 0, x]; sample 1: one model turn of 2."""
    ro = RolloutGroup.from_samples(
        [Sample(np.array([10, 11, 20, 21, 22, 12], np.int32), np.array([-.5, -.25, 0, 0, 0, -1], np.float32), "stop", "7"),
         Sample(np.array([13, 14], np.int32), np.array([-.1, -.2], np.float32), "stop", "5")],
        id="e", prompt_id="e", prompt_ids=np.array([5, 6], np.int32), policy_version=0,
        loss_mask=np.array([1, 1, 0, 0, 0, 1, 1, 1], np.uint8), turn_counts=np.array([3, 1], np.int32),
        turn_ends=np.array([2, 5, 6, 2], np.int32), turn_rewards=np.array([0.5, 0, 1, 0], np.float32),
        env_rewards=np.array([1, 0], np.float32))
    return ScoredGroup(rollout=ro, rewards=np.array([1.0, 0.0], np.float32))


@pytest.mark.parametrize("per_turn", [False, True])
def test_group_rows_mask_and_per_turn_advantages(tiny_model_dir, per_turn):
    cfg = parse_config({"training_mode": "RL_GRPO", "model_checkpoint_path": str(tiny_model_dir),
                        "algorithm_params": {"group_size": 2},
                        "env": {"name": "guess_number", "per_turn_rewards": per_turn, "gamma": 1.0}})
    rows, rewards = group_rows(cfg, [episode_group()])
    assert rows[0].loss_mask.tolist() == [1, 1, 0, 0, 0, 1] and rows[1].loss_mask.tolist() == [1, 1]
    if not per_turn:  # one advantage per episode: rewards [1, 0] -> (+1, -1) / (0.5 + eps)
        assert [r.advantage for r in rows] == pytest.approx([1.0, -1.0], abs=1e-4)
        assert rows[0].token_advantages is None
        return
    # model turns: sample 0 rewards [0.5, 1 (its scored reward)] -> returns [1.5, 1]; sample 1 [0]
    # over [1.5, 1, 0]: mean 5/6, population std sqrt(((2/3)^2 + (1/6)^2 + (5/6)^2) / 3) = 0.62361
    std = math.sqrt(((2 / 3) ** 2 + (1 / 6) ** 2 + (5 / 6) ** 2) / 3)
    a0, a1, b0 = (1.5 - 5 / 6) / std, (1 - 5 / 6) / std, (0 - 5 / 6) / std
    close(rows[0].token_advantages, [a0, a0, 0, 0, 0, a1], 1e-4)
    close(rows[1].token_advantages, [b0, b0], 1e-4)
    tb = collate(rows, pad_id=0, max_len=32)
    close(tb.token_advantages, [[a0, a0, 0, 0, 0, a1], [b0, b0, 0, 0, 0, 0]], 1e-4)
