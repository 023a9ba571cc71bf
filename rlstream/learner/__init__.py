"""The learner: buffer, advantages and losses (pure math), training engines, weight publishing, checkpoints.

Import the submodules directly (``rlstream.learner.losses``, ``rlstream.learner.advantages``);
this package module imports nothing so that ``import rlstream.learner`` stays cheap.
"""
