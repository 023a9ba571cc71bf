"""The openai backend where no server is needed: the endpoint forms it accepts, and a
server that never answers. (test_openai_backend.py runs it against a real ``vllm serve``.)"""

from __future__ import annotations

import time

import numpy as np
import pytest

from rlstream.broker import free_port
from rlstream.producers.backends.base import ProducerError, SamplingSpec
from rlstream.producers.backends.openai import OpenAIBackend, completions_url


def test_endpoint_forms():
    assert completions_url("http://h:8000") == "http://h:8000/v1/completions"
    assert completions_url("http://h:8000/v1/") == "http://h:8000/v1/completions"
    assert completions_url("http://h:8000/v1/completions") == "http://h:8000/v1/completions"
    assert completions_url("http://rl-lb:8000/generate") == "http://rl-lb:8000/v1/completions"


async def test_unreachable_server_fails_after_retries():
    backend = OpenAIBackend(f"http://127.0.0.1:{free_port()}", model_name="m", retries=1, timeout_s=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(ProducerError, match="ClientConnectorError|Cannot connect"):
            await backend.generate([np.array([1, 2], np.int32)], SamplingSpec(n=1, max_new_tokens=2))
        assert time.monotonic() - t0 >= 0.5  # one backoff before giving up
    finally:
        await backend.close()
