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
