"""Environments: multi-turn episodes a producer runs with the policy.

An :class:`~rlstream.envs.base.Environment` starts an :class:`~rlstream.envs.base.Episode`
from a dataset row; the producer samples the model's turn, hands its text to the episode,
and appends what comes back (a tool result, a user turn, a game state) until the episode
ends with a reward or ``max_turns`` is reached.
"""

from rlstream.envs.base import Environment, Episode, Turn

__all__ = ["Environment", "Episode", "Turn"]
