"""The live display of `rlstream run`: an ETA, a feeder that finished shown as done (not as a
missing process), and a note saying what the run waits for or why it stopped."""

from rlstream.config import parse_config
from rlstream.run.display import Display, LiveFigures


def test_plain_display_shows_eta_done_processes_and_note(capsys):
    cfg = parse_config({"training_mode": "RL_GRPO", "model_checkpoint_path": "m", "algorithm_params": {}})
    figures = LiveFigures()
    figures.learner["step"] = 5
    # 4 steps in 20 s: 0.2 steps/s; 25 - 5 = 20 steps to go -> 100 s
    figures.timeline = [{"step": 1, "elapsed_s": 10.0}, {"step": 5, "elapsed_s": 30.0}]
    assert figures.eta_s(25) == 100.0
    display = Display(False, cfg, 25)
    display.note = "resuming: groups the last learner held come back after nats.ack_wait_s (60s)"
    display.update(figures, alive=3, processes=3, done=["feeder"])
    display.update(figures, alive=3, processes=3, done=["feeder"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == display.note  # said once, not on every refresh
    assert "ETA 1m40s" in out[1] and out[1].endswith("processes 3/3 (feeder done)")
    assert len(out) == 2
