"""Run in a subprocess by test_report_sinks.py (each sink reads its settings from the
environment at import): ``write RUN_DIR SINK`` logs three steps and a completions table;
``read-trackio PROJECT RUN`` prints what trackio stored, as JSON."""

import json
import sys
from pathlib import Path

if sys.argv[1] == "write":
    from rlstream.rundir.report import Reports

    run_dir, sink = Path(sys.argv[2]), sys.argv[3]
    reports = Reports([sink], "sinkrun", run_dir, {"training_mode": "RL_GRPO", "learner": {"lr": 0.001}})
    for step in (1, 2, 3):
        reports.log({"loss/total": 1.0 / step, "reward/mean": 0.25 * step, "not_finite": float("nan")}, step)
    prompt = [{"role": "user", "content": "1 + 1?"}]
    reports.log_samples([
        {"step": 2, "prompt": prompt, "completion": "2", "reward": 1.0, "exact_match": 1.0, "policy_version": 1, "staleness": 0},
        {"step": 2, "prompt": prompt, "completion": "3", "reward": 0.0, "exact_match": 0.0, "policy_version": 0, "staleness": 1},
    ], 2)
    reports.close()
elif sys.argv[1] == "read-trackio":
    from trackio.sqlite_storage import SQLiteStorage

    print(json.dumps(SQLiteStorage.get_logs(sys.argv[2], sys.argv[3]), default=str))
