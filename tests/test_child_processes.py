"""Child processes (nats-server nodes, the run's components) die with the process that
started them, and only then: not when the thread that started them ends. Linux ties
PR_SET_PDEATHSIG to the forking thread, so a broker node restarted from ``asyncio.to_thread``
was killed when ``asyncio.run`` shut its executor down (bench/chaos.py lost a node that way
right before its checker ran, and printed no verdict)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import psutil
import pytest

from rlstream.broker.server import popen_tied


def test_a_child_started_from_a_worker_thread_outlives_the_thread():
    procs: list[subprocess.Popen] = []

    async def main():
        await asyncio.to_thread(lambda: procs.append(popen_tied(["sleep", "60"])))

    asyncio.run(main())  # joins the executor's threads: the one that started the child has ended
    child = procs[0]
    try:
        # a PDEATHSIG tied to that thread was sent as it ended, and kills `sleep` at once;
        # 2 s is ample for a signal already sent to land
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=2)
    finally:
        child.kill()
        child.wait()


def test_a_child_started_from_a_worker_thread_dies_with_the_process():
    code = ("import asyncio, sys\n"
            "from rlstream.broker.server import popen_tied\n"
            "async def main():\n"
            "    p = await asyncio.to_thread(popen_tied, ['sleep', '60'])\n"
            "    print(p.pid, flush=True)\n"
            "asyncio.run(main())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            psutil.Process(pid).kill()
            pytest.fail("the child outlived the process that started it")
        time.sleep(0.1)
