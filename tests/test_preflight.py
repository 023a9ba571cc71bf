"""Preflight: `validate` (and `run`) find what a run needs and lacks, in seconds, before
any process starts; Hub ids stay ids and load from a Hub cache laid out by the test."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlstream.config import load_config

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"

REWARDS = '''
def strict_signature(prompts, completions):
    return [0.0 for _ in completions]


def conversational(completions, **kwargs):
    # TRL's conversational format: each completion is a list of messages
    return [1.0 if c[0]["content"] else 0.0 for c in completions]


def fine(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]
'''


def _cli(args: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    """Run the CLI; returns the process and the CPU seconds it used (user + system: unlike wall
    time, not stretched by other work on a shared machine)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "rlstream.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    """An offline Hub cache holding model ``org/tiny`` and dataset ``org/arith`` (two
    configurations), laid out as huggingface_hub writes it: ``<kind>s--org--name/refs/main``
    naming a snapshot folder."""
    root = tmp_path_factory.mktemp("hf-home")
    cache = root / "hub"
    model = cache / "models--org--tiny"
    shutil.copytree(tiny_model_dir, model / "snapshots" / COMMIT)
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text(COMMIT)
    data = cache / "datasets--org--arith"
    snap = data / "snapshots" / COMMIT
    for config, offset in (("easy", 0), ("hard", 100)):
        (snap / config).mkdir(parents=True)
        (snap / config / "train.jsonl").write_text("".join(
            json.dumps({"prompt": f"{i + offset}+1=", "answer": str(i + offset + 1)}) + "\n" for i in range(6)))
    (snap / "README.md").write_text("---\nconfigs:\n- config_name: easy\n  data_files:\n  - split: train\n    path: easy/train.jsonl\n"
                                    "- config_name: hard\n  data_files:\n  - split: train\n    path: hard/train.jsonl\n---\n")
    (data / "refs").mkdir()
    (data / "refs" / "main").write_text(COMMIT)
    mods = root / "mods"
    mods.mkdir()
    (mods / "pf_rewards.py").write_text(REWARDS)
    env = {**os.environ, "HF_HOME": str(root), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(mods), os.environ.get("PYTHONPATH", "")])}
    return env


def _write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def _grpo(**over) -> dict:
    cfg = {"run": "pf", "training_mode": "RL_GRPO", "model_checkpoint_path": "org/tiny",
           "data_source": {"type": "on_policy", "path": "org/arith", "name": "hard", "split": "train"},
           "reward_function": {"terms": [{"rule": "math"}, {"function": "pf_rewards:fine"}]},
           "algorithm_params": {"group_size": 2}}
    cfg.update(over)
    return cfg


def test_hub_ids_stay_ids(tmp_path):
    cfg = load_config(_write(tmp_path / "c.yaml", _grpo()))
    assert cfg.model_checkpoint_path == "org/tiny"
    assert cfg.data_source.path == "org/arith"
    cfg = load_config(_write(tmp_path / "q.yaml", _grpo(model_checkpoint_path="Qwen/Qwen2.5-0.5B-Instruct")))
    assert cfg.model_checkpoint_path == "Qwen/Qwen2.5-0.5B-Instruct"
    # a relative path that exists next to the config is still resolved against the config's folder
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = load_config(_write(tmp_path / "r.yaml", _grpo(data_source={"path": "data/p.jsonl"})))
    assert cfg.data_source.path == str(tmp_path / "data" / "p.jsonl")


def test_validate_loads_hub_model_and_dataset_offline(hub, tmp_path):
    proc, _ = _cli(["validate", str(_write(tmp_path / "c.yaml", _grpo()))], hub, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok:"), proc.stdout


def test_hub_dataset_with_name_and_split_offline(hub, tmp_path):
    code = ("from rlstream.data.rows import read_rows; import json; "
            "print(json.dumps(read_rows('org/arith', 'train', 2, name='hard')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=hub, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [{"prompt": "100+1=", "answer": "101"}, {"prompt": "101+1=", "answer": "102"}]


def test_validate_names_every_problem_in_seconds(hub, tmp_path):
    """Old behaviour: `validate` said ok to all of this, and `run` restarted components for a minute."""
    (tmp_path / "prompts.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    (tmp_path / "ds.json").write_text("{not json")
    cfg = _grpo(model_checkpoint_path="./no-such-model",
                data_source={"type": "on_policy", "path": "prompts.jsonl"},
                reward_function={"terms": [{"function": "no_such_module:reward"}, {"function": "pf_rewards:strict_signature"},
                                           {"function": "pf_rewards:conversational"}]},
                learner={"deepspeed": "ds.json"})
    proc, cpu_s = _cli(["validate", str(_write(tmp_path / "c.yaml", cfg))], hub, tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    text = "\n".join(lines)
    assert f"model_checkpoint_path: {tmp_path / 'no-such-model'} does not exist" in text
    assert "data_source: " in text and "no column 'prompt'" in text
    assert "cannot import 'no_such_module'" in text
    assert "pf_rewards:strict_signature does not accept ['completion_ids', 'trainer_state', 'question', 'answer']" in text
    assert "pf_rewards:conversational raised TypeError" in text
    assert "learner.deepspeed: " in text and "is not valid JSON" in text
    assert len(lines) == 6, text
    assert cpu_s < 10, f"preflight took {cpu_s:.1f} CPU seconds"


def test_hub_id_missing_from_cache_is_named(hub, tmp_path):
    proc, _ = _cli(["validate", str(_write(tmp_path / "c.yaml", _grpo(model_checkpoint_path="org/absent")))], hub, tmp_path)
    assert proc.returncode == 2
    assert "model_checkpoint_path: 'org/absent' is no local directory and not in the Hub cache" in proc.stderr


def test_copied_example_config_says_why(hub, tmp_path):
    """The examples point at ../../runs/demo: a copy elsewhere must fail validate, naming the path."""
    shutil.copy(ROOT / "examples" / "arithmetic" / "grpo.yaml", tmp_path / "grpo.yaml")
    proc, _ = _cli(["validate", str(tmp_path / "grpo.yaml")], hub, tmp_path)
    assert proc.returncode == 2
    assert "model_checkpoint_path: " in proc.stderr and "does not exist (relative paths in a config are relative to its folder)" in proc.stderr
    assert "data_source.path: dataset " in proc.stderr


def test_run_refuses_to_start_on_preflight_problems(hub, tmp_path):
    cfg = _grpo(model_checkpoint_path="./no-such-model")
    proc, _ = _cli(["run", str(_write(tmp_path / "c.yaml", cfg)), "--run-dir", str(tmp_path / "run"), "--no-live"], hub, tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "model_checkpoint_path: " in proc.stderr
    assert not (tmp_path / "run").exists()  # no run directory, no broker, no component was started


def test_export_model_writes_a_clean_directory(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_4"
    shutil.copytree(tiny_model_dir, ckpt)
    (ckpt / "trainer").mkdir()
    (ckpt / "trainer" / "optimizer.safetensors").write_bytes(b"x")
    (ckpt / "learner_state.json").write_text(json.dumps({"step": 4, "policy_version": 4, "samples_trained": 64}))
    (run / "checkpoints" / "latest").symlink_to("step_4")
    (run / "config.resolved.json").write_text(json.dumps({"training_mode": "RL_GRPO", "model_checkpoint_path": "org/tiny",
                                                          "learner": {"lr": 1e-5}, "algorithm_params": {"group_size": 8}}))
    (run / "summary.json").write_text(json.dumps({"reward_first": 0.25, "reward_last": 0.75}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc, _ = _cli(["export-model", str(run / "checkpoints" / "latest"), str(tmp_path / "out")], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert not (out / "trainer").exists() and not (out / "learner_state.json").exists()
    card = (out / "README.md").read_text()
    assert "base_model: org/tiny" in card and "RL_GRPO" in card and "0.2500 -> 0.7500" in card and "| learner step | 4 |" in card
    AutoModelForCausalLM.from_pretrained(str(out))
    # an output directory in the way is refused
    proc, _ = _cli(["export-model", str(run), str(out)], env, tmp_path)
    assert proc.returncode == 2 and "is not an empty directory" in proc.stderr


def test_validate_passes_trl_s_conversational_data_and_rewards(hub, tmp_path):
    """Conversational prompts: the trial call passes the turns and assistant-turn completions,
    as the scorer does; a DPO dataset may leave the prompt implicit."""
    turns = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": turns, "answer": "2"}) + "\n")
    cfg = _grpo(data_source={"type": "on_policy", "path": "chat.jsonl"},
                reward_function={"terms": [{"function": "pf_rewards:conversational"}]})
    proc, _ = _cli(["validate", str(_write(tmp_path / "c.yaml", cfg))], hub, tmp_path)
    assert proc.returncode == 0, proc.stderr
    pair = {"chosen": turns + [{"role": "assistant", "content": "2"}], "rejected": turns + [{"role": "assistant", "content": "3"}]}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair) + "\n")
    dpo = {"run": "pf", "training_mode": "DPO", "model_checkpoint_path": "org/tiny",
           "data_source": {"type": "off_policy", "path": "pairs.jsonl"}}
    proc, _ = _cli(["validate", str(_write(tmp_path / "d.yaml", dpo))], hub, tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_local_model_checked_without_transformers(tiny_model_dir, tmp_path):
    """A local model directory is checked from its files: importing transformers (and torch)
    would cost seconds of CPU before `rlstream run` starts any process."""
    code = ("import sys\nfrom rlstream.run.preflight import check_model, check_tokenizer\n"
            f"print(check_model('m', {str(tiny_model_dir)!r}) + check_tokenizer('m', {str(tiny_model_dir)!r}))\n"
            "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "[]"]


def test_local_config_without_model_type_is_named(tiny_model_dir, tmp_path):
    from rlstream.run.preflight import check_model

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    del config["model_type"]
    (model / "config.json").write_text(json.dumps(config))
    assert check_model("model_checkpoint_path", str(model)) == [
        f"model_checkpoint_path: {model}: the model config does not load (config.json names no model_type)"]
    (model / "config.json").write_text("{not json")
    (problem,) = check_model("model_checkpoint_path", str(model))
    assert problem.startswith(f"model_checkpoint_path: {model}: the model config does not load (JSONDecodeError")


HIDDEN = '''
import sys

# This interpreter has neither package (they are installed here for other tests): a None entry
# in sys.modules is how Python marks a module absent (find_spec gives None, import raises).
for name in ("vllm", "wandb"):
    sys.modules[name] = None
'''


def test_validate_refuses_a_backend_or_sink_whose_package_is_missing(hub, tmp_path):
    """Old behaviour: `validate` said ok to `producer.backend: vllm` without vLLM; the run then
    restarted the producer 6 times over about 55 s and gave up with the message it could have
    given at once."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDDEN)
    env = {**hub, "PYTHONPATH": os.pathsep.join([str(site), hub.get("PYTHONPATH", "")])}
    cfg = _grpo(producer={"backend": "vllm"}, report_to=["wandb"])
    proc, _ = _cli(["validate", str(_write(tmp_path / "c.yaml", cfg))], env, tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert any("producer.backend: 'vllm' needs the vllm package" in ln and "rlstream[vllm]" in ln for ln in lines), lines
    assert any("report_to: 'wandb' needs the wandb package" in ln for ln in lines), lines
    assert len(lines) == 2, lines
    proc, _ = _cli(["validate", str(_write(tmp_path / "hf.yaml", _grpo()))], env, tmp_path)  # the hf backend needs neither
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
