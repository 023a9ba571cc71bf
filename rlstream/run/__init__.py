"""``rlstream run``: the whole pipeline on one machine.

Starts the embedded nats-server (unless ``nats.url`` is set), creates the run's layout,
then the feeder, scorers, producers and the learner as separate processes (counts from
the config). Three parts:

- :mod:`rlstream.run.supervisor` starts the processes and watches them: a process that
  exits with an error, or whose heartbeat goes stale, is restarted (the learner with
  ``--resume``). Ctrl-C stops everything cleanly (components drain, the learner writes a
  checkpoint) and leaves a resumable run.
- :mod:`rlstream.run.display` shows step, reward, KL, staleness, producer tokens/s,
  buffer depth and DLQ count live.
- :mod:`rlstream.run.summary` writes ``summary.json`` and the reward curve at the end,
  next to the learner's ``metrics.jsonl`` and checkpoints (file names in
  :mod:`rlstream.rundir`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from rlstream.broker import EmbeddedServer, Layout
from rlstream.config import ConfigError, SecretMaskingFormatter, dump_resolved, load_config, mask_secrets
from rlstream.run.summary import broker_accounting, read_metrics, reward_curve, summarize
from rlstream.run.supervisor import plan_children, streaming, supervise
from rlstream.rundir import RunDir, default_run_dir


def main(args) -> int:
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or default_run_dir(cfg.run)).resolve()
    rd = RunDir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    rd.logs.mkdir(exist_ok=True)
    dump_resolved(cfg, rd.config)
    file_log = logging.FileHandler(rd.log("run"))
    file_log.setFormatter(SecretMaskingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(file_log)

    server = None
    nats_url = cfg.nats.url
    if not nats_url:
        server = EmbeddedServer(rd.nats_store, log_file=rd.log("nats-server"), max_payload_mb=cfg.nats.max_payload_mb,
                                port=int(os.environ["RLSTREAM_BROKER_PORT"]) if os.environ.get("RLSTREAM_BROKER_PORT") else None)
        server.start()
        nats_url = server.url
    config_path = str(Path(args.config).resolve())
    children = plan_children(cfg, config_path, args.set or [], nats_url, run_dir, args.max_steps)
    live = sys.stdout.isatty() and not getattr(args, "no_live", False)
    print(f"rlstream run {cfg.run}: {cfg.training_mode}, broker {mask_secrets(nats_url)}, run directory {run_dir}", flush=True)
    t0 = time.monotonic()
    ok = False
    accounting: dict[str, Any] = {}
    try:
        ok = asyncio.run(supervise(cfg, args, run_dir, nats_url, children, live))
        accounting = asyncio.run(broker_accounting(cfg.nats, nats_url, Layout(cfg.run)))
    finally:
        if server is not None:
            server.stop()
    summary = summarize(cfg, run_dir, time.monotonic() - t0, accounting, {c.name: c.restarts for c in children}, ok,
                        streaming(cfg))
    curve = reward_curve(read_metrics(run_dir), rd.reward_curve, f"{cfg.run} · {cfg.training_mode}")
    first, last = summary["reward_first"], summary["reward_last"]
    verdict = "finished" if ok else "stopped (resumable: rlstream run --resume --run-dir ...)"
    print(f"run {verdict}: {summary['steps']} steps, {summary['samples_trained']} samples in {summary['wall_s']:.0f}s", flush=True)
    if first is not None:
        print(f"reward: first 10% of steps {first:.3f} -> last 10% {last:.3f}", flush=True)
    print(f"summary: {rd.summary}", flush=True)
    if curve:
        print(f"curve:   {curve}", flush=True)
    return 0 if ok else 1
