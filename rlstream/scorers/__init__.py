"""Reward scoring: rule rewards, Python reward functions, reward models over HTTP, the
scorer loop and the reward-model server."""
