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
- A run directory that holds anything is refused unless ``--resume`` (continue it) or
  ``--overwrite`` (empty it first) is given: a new run there would train the old run's
  leftover groups and overwrite its metrics and checkpoints. The embedded broker's address
  is recorded in ``RUN_DIR/broker.json``, so operator commands can take ``RUN_DIR``.
- :mod:`rlstream.run.summary` writes ``summary.json`` and the reward curve at the end,
  next to the learner's ``metrics.jsonl`` and checkpoints (file names in
  :mod:`rlstream.rundir.files`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlstream.run.preload import Preloader


def start_preloader(resume: bool) -> Preloader | None:
    """The preloader (:mod:`rlstream.run.preload`), started before the config is even read: its
    import is the longest part of a start. None on ``--resume`` (a resumed learner starts on
    its own) and where this process cannot adopt the components it forks (not Linux)."""
    # imported here: `python -m rlstream.run.preload` imports this package first
    from rlstream.run.preload import Preloader, become_subreaper, preload_env

    if resume or not become_subreaper():
        return None
    return Preloader(preload_env())


def forks_from_preloader(cfg) -> bool:
    """Whether ``cfg`` has a component whose first start the preloader forks."""
    from rlstream.run.preload import preloadable

    kinds = [kind for kind in ("learner", "producer") if getattr(cfg.placement, kind).preload and preloadable(cfg, kind)]
    return bool(kinds) and (kinds != ["producer"] or cfg.is_online)


def main(args) -> int:
    preloader = start_preloader(bool(getattr(args, "resume", False)))
    try:
        from rlstream.config import ConfigError, load_config

        try:
            cfg = load_config(args.config, args.set)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if not getattr(args, "skip_preflight", False):
            # before the broker or any component starts: a problem here would only make them fail in turn
            from rlstream.cli import run_preflight

            code = run_preflight(cfg, endpoints=getattr(args, "check_endpoints", False))
            if code:
                return code
        if preloader is not None:
            if not forks_from_preloader(cfg):  # vLLM producers and no learner to fork, or preload off
                preloader.stop()
                preloader = None
            elif any(getattr(cfg.placement, kind).cpus for kind in type(cfg.placement).model_fields):
                preloader.share_cores()  # the config places its components itself
            else:
                preloader.split_cores()  # the rest of the start stays off the preloader's core
        return _run(cfg, args, preloader)  # the rest of this package is imported there, after the preloader started
    finally:
        if preloader is not None:
            preloader.stop()


def _run(cfg, args, preloader: Preloader | None) -> int:
    from rlstream.broker import EmbeddedServer, Layout
    from rlstream.config import SecretMaskingFormatter, dump_resolved, mask_secrets
    from rlstream.observe.rundir import run_broker_token, with_token, write_broker_record
    from rlstream.run.summary import (
        eval_headline,
        read_eval,
        read_metrics,
        reward_curve,
        seconds_since_last_step,
        settled_accounting,
        summarize,
    )
    from rlstream.run.supervisor import EXIT_USAGE, Outcome, check_placement, plan_children, streaming, supervise
    from rlstream.rundir.files import RunDir, default_run_dir

    placement_problems = check_placement(cfg)
    for line in placement_problems:
        print(f"error: {line}", file=sys.stderr)
    if placement_problems:
        return EXIT_USAGE
    run_dir = Path(args.run_dir or default_run_dir(cfg.run)).resolve()
    rd = RunDir(run_dir)
    resume, overwrite = bool(getattr(args, "resume", False)), bool(getattr(args, "overwrite", False))
    if run_dir.is_dir() and any(run_dir.iterdir()) and not resume:
        if not overwrite:
            print(f"error: run directory {run_dir} is not empty (a previous run?): pass --resume to continue it, "
                  "--overwrite to delete its contents and start over, or another --run-dir", file=sys.stderr)
            return EXIT_USAGE
        for item in run_dir.iterdir():
            shutil.rmtree(item) if item.is_dir() and not item.is_symlink() else item.unlink()
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    run_dir.chmod(0o700)  # it holds the broker's token, checkpoints and logs: its owner's alone
    rd.logs.mkdir(exist_ok=True)
    dump_resolved(cfg, rd.config)
    file_log = logging.FileHandler(rd.log("run"))
    file_log.setFormatter(SecretMaskingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(file_log)

    server = None
    nats_url = cfg.nats.url
    if not nats_url:
        # a per-run token, not an anonymous broker: another user of this host can reach loopback
        # too. The components get the URL with it in their environment; operator commands read it
        # from RUN_DIR/broker.token (0600).
        token = run_broker_token(run_dir)
        server = EmbeddedServer(rd.nats_store, log_file=rd.log("nats-server"), max_payload_mb=cfg.nats.max_payload_mb,
                                port=int(os.environ["RLSTREAM_BROKER_PORT"]) if os.environ.get("RLSTREAM_BROKER_PORT") else None,
                                authorization={"token": token})
        server.start()
        nats_url = with_token(server.url, token)
    write_broker_record(run_dir, nats_url, store=rd.nats_store if server is not None else None)
    config_path = str(Path(args.config).resolve())
    children = plan_children(cfg, config_path, args.set or [], nats_url, run_dir, args.max_steps)
    live = sys.stdout.isatty() and not getattr(args, "no_live", False)
    print(f"rlstream run {cfg.run}: {cfg.training_mode}, broker {mask_secrets(nats_url)}, run directory {run_dir}", flush=True)
    t0 = time.monotonic()
    outcome = Outcome(1, "not started")
    after_last_step_s = None
    accounting: dict[str, Any] = {}
    try:
        outcome = asyncio.run(supervise(cfg, args, run_dir, nats_url, children, live, preloader))
        after_last_step_s = seconds_since_last_step(rd.timeline)
        accounting = asyncio.run(settled_accounting(cfg.nats, nats_url, Layout(cfg.run, cfg.annotators)))
    finally:
        if server is not None:
            server.stop()
    ok = outcome.ok
    summary = summarize(cfg, run_dir, time.monotonic() - t0, accounting, {c.name: c.restarts for c in children}, ok,
                        streaming(cfg), after_last_step_s=after_last_step_s)
    curve = reward_curve(read_metrics(run_dir), rd.reward_curve, f"{cfg.run} · {cfg.training_mode}", read_eval(run_dir))
    first, last = summary["reward_first"], summary["reward_last"]
    if ok:
        verdict = "finished"
    elif any(p.is_dir() and p.name.split("_", 1)[1].isdigit() and int(p.name.split("_", 1)[1]) > 0
             for p in rd.checkpoints.glob("step_*")):  # a checkpoint of step 0 holds no training
        verdict = f"stopped (resumable: rlstream run {args.config} --resume --run-dir {run_dir})"
    else:
        verdict = "stopped before its first checkpoint (nothing to resume; fix the cause and run again with --overwrite)"
    ended = f" (every process ended {after_last_step_s:.1f}s after the last step)" if after_last_step_s is not None else ""
    print(f"run {verdict}: {summary['steps']} steps, {summary['samples_trained']} samples in {summary['wall_s']:.0f}s{ended}",
          flush=True)
    for problem in summary["problems"]:
        print(f"error: accounting: {problem}", file=sys.stderr, flush=True)
    if first is not None:
        print(f"reward: first 10% of steps {first:.3f} -> last 10% {last:.3f}", flush=True)
    e0, e1 = summary.get("eval_first"), summary.get("eval_last")
    key = eval_headline(e1) if e1 else None
    if key is not None:
        print(f"held-out {key}: policy v{e0['policy_version']} {e0.get(key, float('nan')):.3f} -> "
              f"v{e1['policy_version']} {e1[key]:.3f}", flush=True)
    print(f"summary: {rd.summary}", flush=True)
    if curve:
        print(f"curve:   {curve}", flush=True)
    if summary["problems"] and outcome.code == 0:
        return 1  # the promise broken: no exit 0, however well the processes ran
    return outcome.code
