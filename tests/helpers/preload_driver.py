"""Drives a real preloader (``rlstream.run.preload``) the way ``rlstream run`` does, in a process of
its own (it becomes a child subreaper, which a test worker must not), and prints what it saw as
JSON. ``python preload_driver.py WORK_DIR PORT``: ``rlstream broker`` is the component forked,
a real long-running command that reads a secret from its environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from rlstream.run.preload import Preloader, become_subreaper

SECRET = "preload-token-7f3a"


def wait_for(path: Path, text: str, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.05)
    return False


def main() -> None:
    work, port = Path(sys.argv[1]), int(sys.argv[2])
    assert become_subreaper()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "rlstream.cli", "broker"]
    out: dict = {"driver": os.getpid()}

    cores = sorted(os.sched_getaffinity(0))
    pre = Preloader(env)
    # while it imports (seconds): it has a core of its own (it narrows itself once its OpenMP
    # runtime is loaded), and what this process starts stays off it
    deadline = time.monotonic() + 60
    while sorted(os.sched_getaffinity(pre.proc.pid)) == cores and len(cores) > 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    out["preloader_cpus"] = sorted(os.sched_getaffinity(pre.proc.pid))
    pre.split_cores()
    meanwhile = subprocess.Popen(["sleep", "300"])
    out["split"] = {"main": sorted(os.sched_getaffinity(0)), "started": sorted(os.sched_getaffinity(meanwhile.pid))}
    log = work / "broker.log"
    core = cores[-1]
    out.update(core=core, cores=cores)
    broker = pre.spawn(cmd + ["--port", str(port), "--store", str(work / "store"), "--token-env", "BROKER_TOKEN"],
                       {**env, "BROKER_TOKEN": SECRET}, log, [core], 1)
    early_log = work / "early.log"
    early = pre.spawn(cmd + ["--port", str(port + 1), "--store", str(work / "store-early")], env, early_log, None, 1)
    early.signal_group(signal.SIGTERM)  # before the preloader has reported its pid
    free_log = work / "free.log"
    free = pre.spawn(cmd + ["--port", str(port + 3), "--store", str(work / "store-free")], env, free_log, None, 1)
    pre.close()
    out["listening"] = wait_for(log, "listening") and wait_for(free_log, "listening")
    while broker.pid is None or free.pid is None:  # reported after the preloader said it had imported
        time.sleep(0.01)
    out["rejoined"] = {"main": sorted(os.sched_getaffinity(0)), "started": sorted(os.sched_getaffinity(meanwhile.pid)),
                       "forked_without_cores": sorted(os.sched_getaffinity(free.pid))}
    meanwhile.kill()
    meanwhile.wait()
    free.signal_group(signal.SIGTERM)
    free.wait(60)
    p = psutil.Process(broker.pid)
    out.update(pid=broker.pid, ppid=p.ppid(), cmdline=" ".join(p.cmdline()), cpus=sorted(os.sched_getaffinity(broker.pid)),
               session=os.getsid(broker.pid), secret_in_proc_environ=SECRET in Path(f"/proc/{broker.pid}/environ").read_bytes().decode(errors="replace"),
               nats_children=[" ".join(c.cmdline()) for c in p.children()])
    out["alive_before_signal"] = broker.poll() is None
    broker.signal_group(signal.SIGTERM)
    out["code"] = broker.wait(60)
    out["early_code"] = early.wait(60)
    out["early_log"] = early_log.read_text() if early_log.exists() else ""
    out["log"] = log.read_text()
    pre.stop()
    out["preloader_code"] = pre.proc.returncode

    gone = Preloader(env)  # a preloader that dies before it forks: the component exits with 1
    orphan = gone.spawn(cmd + ["--port", str(port + 2), "--store", str(work / "store-orphan")], env, work / "orphan.log", None, 1)
    gone.proc.kill()
    out["orphan_code"] = orphan.wait(60)
    out["orphan_pid"] = orphan.pid
    print(json.dumps(out))


if __name__ == "__main__":
    main()
