"""Fixtures for the scorer tests: a JetStream connection and ``rlstream reward-server``
serving the tiny reward model in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
from helpers.http import wait_http

from rlstream.broker.server import free_port


@dataclass
class RewardServer:
    url: str
    token: str
    proc: subprocess.Popen


@pytest.fixture(scope="session")
def reward_server(tiny_reward_model_dir):
    """``rlstream reward-server`` on a free loopback port, with a token and batches of 8."""
    port = free_port()
    token = "test-token-123"
    proc = subprocess.Popen(  # the token through the environment: never on a command line
        [sys.executable, "-m", "rlstream.cli", "reward-server", "--model", str(tiny_reward_model_dir), "--port", str(port),
         "--max-batch", "8"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "RLSTREAM_REWARD_TOKEN": token},
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
        yield RewardServer(f"http://127.0.0.1:{port}", token, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def direct_scores(tiny_reward_model_dir):
    """Score texts with the reward model loaded here, one text at a time (no padding)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_reward_model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_reward_model_dir), dtype=torch.float32).eval()

    def score(texts: list[str]) -> list[float]:
        out = []
        with torch.inference_mode():
            for t in texts:
                out.append(float(model(**tok(t, return_tensors="pt")).logits[0, 0]))
        return out

    return score

