"""One thread for a process's torch work.

Under torch, OpenMP gives every thread that starts a parallel region a team of worker
threads of its own, and a team's workers spin for a while after each region ends. With
``asyncio.to_thread`` each call lands on whichever worker of the loop's default pool is free,
so a loop that collates, steps and publishes in threads has its steps run on two or more
threads in turn, and their teams take turns on the same cores. On 2 cores a GRPO learner
step at 2 threads took 69-100 ms when its steps alternated between two threads, and 40 ms
on one (the demo's model, 64 samples). :func:`run` is ``asyncio.to_thread`` on one thread
for the whole process, in call order: the learner's build, resume, steps, weight gathers
and saves, and a producer's generation and weight loads (in flight too: the running
generation loads them at a chunk boundary, else a call queued here does), go through it.
Work that must run beside it (collating the next batch, which makes no parallel region)
stays on the default pool.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _reset() -> None:
    """A forked child has no copy of the parent's thread: it makes its own on first use."""
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_reset)


def executor() -> ThreadPoolExecutor:
    """The process's torch thread (made on first use)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlstream-torch")
        return _pool


async def run(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the torch thread, awaited (context variables carried, as
    ``asyncio.to_thread`` carries them). Calls queue: one waits for those before it."""
    ctx = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(executor(), functools.partial(ctx.run, fn, *args, **kwargs))
