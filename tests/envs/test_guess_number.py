"""The guess_number environment: plain reward, and partial credit for guesses the feedback allows."""

from __future__ import annotations

import asyncio

import pytest

from rlstream.envs.guess_number import GuessNumber
from rlstream.schemas import Prompt


def play(env: GuessNumber, secret: int, replies: list[str]):
    async def go():
        ep = await env.start(Prompt(id="p", text="", columns={"secret": secret}))
        turns = []
        for r in replies:
            turns.append(await ep.step(r))
            if turns[-1].done:
                break
        return turns
    return asyncio.run(go())


def test_plain_game_rewards_only_the_find():
    turns = play(GuessNumber(1, 8), 6, ["4", "7", "6"])
    assert [t.messages[0]["content"] for t in turns] == ["higher", "lower", "correct"]
    assert turns[-1].done and turns[-1].reward == 1.0
    assert not turns[0].done and turns[0].reward is None


def test_partial_credit_ends_the_game_at_max_guesses():
    env = GuessNumber(1, 8, max_guesses=4, consistency_credit=0.4)
    # secret 6: "4" is the first guess (consistent: nothing known yet); "higher" -> 5..8 allowed.
    # "2" is not allowed (below 5); "7" is (5..8) -> "lower" leaves 5..6; "8" is not allowed.
    # Consistent 2 of 4 guesses: reward 0.4 * 2/4 = 0.2, and the 4th wrong guess ends the game.
    turns = play(env, 6, ["4", "2", "7", "8"])
    assert [t.done for t in turns] == [False, False, False, True]
    assert turns[-1].reward == pytest.approx(0.2)
    assert turns[-1].info["consistent"] == 2


def test_partial_credit_win_is_one_and_a_reply_without_a_number_counts_as_a_guess():
    env = GuessNumber(1, 8, max_guesses=2, consistency_credit=0.4)
    assert play(env, 3, ["3"])[-1].reward == 1.0
    # no number: not consistent, and it uses up a guess; 0 of 2 consistent -> 0.0
    turns = play(env, 3, ["what?", "9"])
    assert turns[-1].done and turns[-1].reward == 0.0


def test_partial_credit_needs_max_guesses():
    with pytest.raises(ValueError, match="max_guesses"):
        GuessNumber(1, 8, consistency_credit=0.3)


def test_show_range_names_the_numbers_the_feedback_still_allows():
    env = GuessNumber(1, 16, show_range=True)
    # secret 11: "8" -> higher, 9..16; "14" -> lower, 9..13; "3" (ignores the feedback) -> higher,
    # and the range stays 9..13 (3 tells nothing new); "10" -> higher, 11..13; "11" -> correct
    turns = play(env, 11, ["8", "14", "3", "10", "11"])
    assert [t.messages[0]["content"] for t in turns] == [
        "higher, 9 to 16", "lower, 9 to 13", "higher, 9 to 13", "higher, 11 to 13", "correct"]
    assert turns[-1].done and turns[-1].reward == 1.0


def test_show_range_is_off_by_default_and_leaves_the_reward_alone():
    assert [t.messages[0]["content"] for t in play(GuessNumber(1, 16), 11, ["8", "14"])] == ["higher", "lower"]
    env = GuessNumber(1, 8, max_guesses=2, consistency_credit=0.4, show_range=True)
    # secret 6: "4" -> higher, 5..8 (consistent); "2" is below 5 (not consistent): 0.4 * 1/2 = 0.2
    turns = play(env, 6, ["4", "2"])
    assert [t.messages[0]["content"] for t in turns] == ["higher, 5 to 8", "higher, 5 to 8"]
    assert turns[-1].done and turns[-1].reward == pytest.approx(0.2)
