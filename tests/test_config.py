"""The config: the seed format as is, per-mode knobs, errors that name the field."""

import subprocess
import sys

import pytest
import yaml

from rlstream.config import ConfigError, apply_overrides, load_config, parse_config

SEED = {
    "training_mode": "RL_GRPO",
    "model_checkpoint_path": "/mnt/storage/base_model",
    "data_source": {"type": "on_policy", "sampling_endpoint": "http://rl-lb:8000/generate"},
    "reward_function": {"type": "model_based", "endpoint": "http://reward-service:8000/score"},
    "algorithm_params": {"kl_coefficient": 0.05, "advantage_type": "group_relative"},
}


def test_seed_config_is_accepted_as_is():
    cfg = parse_config(SEED)
    assert cfg.training_mode == "RL_GRPO"
    assert cfg.algorithm_params.kl_coefficient == 0.05
    assert cfg.algorithm_params.clip_range == 0.2
    assert cfg.producer.backend == "openai"  # a sampling endpoint selects the HTTP backend


def test_each_mode_has_its_own_knobs():
    base = {"model_checkpoint_path": "m", "data_source": {"type": "off_policy"}}
    assert parse_config({**base, "training_mode": "DPO", "algorithm_params": {"beta": 0.2}}).algorithm_params.beta == 0.2
    assert parse_config({**base, "training_mode": "SFT"}).algorithm_params.type == "SFT"
    rl = {"model_checkpoint_path": "m"}
    dapo = parse_config({**rl, "training_mode": "RL_DAPO", "algorithm_params": {"clip_high": 0.3}}).algorithm_params
    assert (dapo.clip_low, dapo.clip_high, dapo.dynamic_sampling) == (0.2, 0.3, True)
    gspo = parse_config({**rl, "training_mode": "RL_GSPO"}).algorithm_params
    assert (gspo.clip_low, gspo.clip_high) == (3e-4, 4e-4)
    ppo = parse_config({**rl, "training_mode": "RL_PPO", "algorithm_params": {"gamma": 0.99, "lam": 0.9}}).algorithm_params
    assert ppo.advantage_type == "gae" and ppo.clip_range == 0.2
    with pytest.raises(ConfigError, match=r"algorithm_params\.beta: unknown key"):
        parse_config({**rl, "training_mode": "RL_GRPO", "algorithm_params": {"beta": 0.1}})
    with pytest.raises(ConfigError, match=r"algorithm_params\.clip_range: unknown key"):
        parse_config({**rl, "training_mode": "RL_DAPO", "algorithm_params": {"clip_range": 0.1}})


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"training_mode": "RL_FOO"}, r"training_mode: 'RL_FOO' is not allowed; allowed: .*RL_GRPO"),
        ({"algorithm_params": {"kl_coefficient": -1}}, r"algorithm_params\.kl_coefficient: -1 is not allowed; input should be greater than or equal to 0"),
        ({"learner": {"lrr": 1e-5}}, r"learner\.lrr: unknown key"),
        ({"nats": {"replicas": 9}}, r"nats\.replicas: 9 is not allowed"),
        ({"producer": {"backend": "tgi"}}, r"producer\.backend: 'tgi' is not allowed; allowed: 'hf', 'vllm'"),
        ({"reward_function": {"type": "model_based"}}, r"needs an endpoint"),
        ({"run": "bad run!"}, r"run: 'bad run!' must match"),
    ],
)
def test_errors_name_field_value_and_allowed(change, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_config({**SEED, **change})


def test_set_overrides_and_deepspeed_consistency(tmp_path):
    data = apply_overrides(SEED, ["learner.lr=3e-4", "algorithm_params.group_size=4", "nats.url=nats://x:1"])
    cfg = parse_config(data)
    assert cfg.learner.lr == 3e-4 and cfg.algorithm_params.group_size == 4 and cfg.nats.url == "nats://x:1"
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 1.0}
    cfg = parse_config({**SEED, "learner": {"engine": "deepspeed", "deepspeed": ds, "micro_batch_size": 4}})
    out = cfg.learner.deepspeed_config()
    assert out["train_micro_batch_size_per_gpu"] == 4 and out["zero_optimization"]["stage"] == 3
    with pytest.raises(ConfigError, match=r"gradient_clipping = 5.0 disagrees"):
        parse_config({**SEED, "learner": {"engine": "deepspeed", "deepspeed": {**ds, "gradient_clipping": 5.0}}})


def test_secrets_are_masked_in_the_resolved_config():
    cfg = parse_config({**SEED, "nats": {"password": "hunter2", "user": "u", "token": "tok3n"}})
    text = str(cfg.resolved())
    assert "hunter2" not in text and "tok3n" not in text
    assert cfg.nats.password.get_secret_value() == "hunter2"


def test_cli_validate(tmp_path):
    good = tmp_path / "seed.yaml"
    good.write_text(yaml.safe_dump(SEED))
    r = subprocess.run([sys.executable, "-m", "rlstream.cli", "validate", str(good), "--schema-only"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "valid RL_GRPO config" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**SEED, "algorithm_params": {"clip_range": 1.5}}))
    r = subprocess.run([sys.executable, "-m", "rlstream.cli", "validate", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "algorithm_params.clip_range: 1.5 is not allowed" in r.stderr
    r = subprocess.run([sys.executable, "-m", "rlstream.cli", "validate", str(good), "--set", "learner.lr=-1"], capture_output=True, text=True)
    assert r.returncode == 2 and "learner.lr: -1" in r.stderr


def test_load_config_reports_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
    p = tmp_path / "x.yaml"
    p.write_text("training_mode: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_an_explicit_value_that_conflicts_is_an_error_not_rewritten():
    # a sampling endpoint selects the openai backend only when producer.backend is not given
    with pytest.raises(ConfigError, match=r"producer\.backend 'hf'.*sampling_endpoint"):
        parse_config({**SEED, "producer": {"backend": "hf"}})
    assert parse_config({**SEED, "producer": {"backend": "openai"}}).producer.backend == "openai"
    # DeepSpeed's accumulation: batch_groups 8 x group_size 8 = 64 sequences / micro 4 = 16 passes
    learner = {"engine": "deepspeed", "micro_batch_size": 4, "batch_groups": 8}
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps = 3 disagrees.*16"):
        parse_config({**SEED, "learner": {**learner, "deepspeed": {"gradient_accumulation_steps": 3}}})
    cfg = parse_config({**SEED, "learner": {**learner, "deepspeed": {"gradient_accumulation_steps": 16, "train_batch_size": "auto"}}})
    ds = cfg.learner.deepspeed_config(world_size=2, accumulation=cfg.accumulation_steps)
    assert (ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (16, 4 * 16 * 2)
    with pytest.raises(ConfigError, match=r"train_batch_size = 64 disagrees.*128"):
        cfg.learner.deepspeed = {"train_batch_size": 64}
        cfg.learner.deepspeed_config(world_size=2, accumulation=cfg.accumulation_steps)


# ---- hostile or broken configs: refused fast, one line per problem -------------------------------


def _validate(path, cwd=None, extra=(), bounded=True):
    """``rlstream validate`` in a subprocess held to 1 GiB of memory and 20 s, so an expansion
    bomb fails the test instead of the machine. Returns (rc, stderr lines, CPU seconds)."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        r = subprocess.run([sys.executable, "-m", "rlstream.cli", "validate", str(path), *extra], capture_output=True,
                           text=True, timeout=20 if bounded else 180, preexec_fn=limit if bounded else None, cwd=cwd)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rlstream validate {path} ran past 20 s")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return r.returncode, [line for line in r.stderr.splitlines() if line.strip()], cpu


def _existing(tmp_path, model_dir) -> dict:
    """Paths that exist, for configs `rlstream validate` must accept (it checks them)."""
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    return {"model_checkpoint_path": str(model_dir), "data_source": {"type": "on_policy", "path": str(tmp_path / "prompts.jsonl")}}


def test_yaml_alias_bomb_is_refused_at_once(tmp_path, tiny_model_dir):
    # 9 levels of 9 aliases: 9**9 (387 million) strings once expanded, from a ~600-byte file
    lines = ["training_mode: RL_GRPO", "model_checkpoint_path: m", 'l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    assert bomb.stat().st_size < 700
    rc, err, cpu = _validate(bomb)
    assert rc == 2, err
    assert len(err) == 1 and "aliases" in err[0] and "bomb.yaml" in err[0], err
    assert cpu < 1.0, f"{cpu:.2f} s of CPU"
    # anchors used the ordinary way still work
    ok = tmp_path / "anchors.yaml"
    ok.write_text(yaml.safe_dump({"training_mode": "RL_GRPO", **_existing(tmp_path, tiny_model_dir)}) + "producer: &p {max_new_tokens: 8}\n")
    assert _validate(ok, bounded=False)[0] == 0  # a valid config is also checked against its model (not held to 1 GiB)
    # a self-referencing alias is refused too
    loop = tmp_path / "loop.yaml"
    loop.write_text("training_mode: RL_GRPO\nmodel_checkpoint_path: m\nproducer: &p {vllm: *p}\n")
    rc, err, _ = _validate(loop)
    assert rc == 2 and len(err) == 1, err


def test_deepspeed_path_is_read_from_the_config_folder_with_a_size_limit(tmp_path, tiny_model_dir):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    cfg = {**SEED, **_existing(tmp_path, tiny_model_dir), "reward_function": {"type": "rule_based"},
           "learner": {"engine": "deepspeed", "deepspeed": "ds.json"}}
    (folder / "run.yaml").write_text(yaml.safe_dump(cfg))
    rc, err, _ = _validate(folder / "run.yaml", cwd=tmp_path, bounded=False)  # the working directory has no ds.json
    assert rc == 0, err
    assert load_config(folder / "run.yaml").learner.deepspeed_config()["zero_optimization"]["stage"] == 2
    (folder / "big.json").write_text('{"zero_optimization": {"stage": 2}}' + " " * (2 << 20))
    (folder / "big.yaml").write_text(yaml.safe_dump({**cfg, "learner": {"engine": "deepspeed", "deepspeed": "big.json"}}))
    rc, err, cpu = _validate(folder / "big.yaml", cwd=tmp_path)
    assert rc == 2 and len(err) == 2 and "learner.deepspeed" in err[1] and "larger than" in err[1], err
    assert cpu < 1.0
    (folder / "dev.yaml").write_text(yaml.safe_dump({**cfg, "learner": {"engine": "deepspeed", "deepspeed": "/dev/zero"}}))
    rc, err, cpu = _validate(folder / "dev.yaml", cwd=tmp_path)
    assert rc == 2 and len(err) == 2 and "learner.deepspeed" in err[1] and "not a regular file" in err[1], err
    assert cpu < 1.0


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e300"])
def test_infinite_or_absurd_numbers_are_refused_with_one_line_each(tmp_path, value):
    fields = ["learner.lr", "nats.ack_wait_s", "nats.retention_days", "checkpoint.max_age_days", "reward_function.timeout_s",
              "producer.generation_timeout_s", "producer.temperature", "metrics.interval_s", "algorithm_params.kl_coefficient",
              "learner.max_grad_norm", "learner.weight_decay", "nats.max_deliver"]
    path = tmp_path / "seed.yaml"
    path.write_text(yaml.safe_dump(SEED))
    rc, err, cpu = _validate(path, extra=[arg for f in fields for arg in ("--set", f"{f}={value}")])
    assert rc == 2
    assert err[0] == "error: invalid config:", err
    assert sorted(line.split(":")[0].strip() for line in err[1:]) == sorted(fields), err
    assert all(len(line) < 200 for line in err), err
    assert cpu < 1.0


def test_error_lines_stay_short_whatever_the_value():
    with pytest.raises(ConfigError) as exc:
        parse_config({**SEED, "producer": {"backend": "x" * 100_000}, "learner": {"lrr": list(range(100_000))}})
    lines = str(exc.value).splitlines()
    assert len(lines) == 3 and all(len(line) < 300 for line in lines), lines


# ---- secrets: masked wherever printed, readable from the environment -----------------------------


def test_urls_with_userinfo_are_masked_in_the_resolved_config(tmp_path):
    from rlstream.config import dump_resolved

    cfg = parse_config({**SEED, "nats": {"url": "nats://rl:pw-nats-77@n1:4222,nats://tok-nats-88@n2:4222"},
                        "reward_function": {"type": "model_based", "endpoint": "http://u:pw-rm-99@rm:8000/score"},
                        "data_source": {"type": "on_policy", "sampling_endpoint": "http://k:pw-gen-11@gen:8000/v1"}})
    dump_resolved(cfg, tmp_path / "config.resolved.json")
    text = (tmp_path / "config.resolved.json").read_text()
    for secret in ("pw-nats-77", "tok-nats-88", "pw-rm-99", "pw-gen-11"):
        assert secret not in text
    assert "nats://***@n1:4222,nats://***@n2:4222" in text and "http://***@rm:8000/score" in text
    assert cfg.nats.url.startswith("nats://rl:pw-nats-77@")  # the config itself keeps what it needs to connect


def test_mask_secrets_in_free_text():
    from rlstream.config import mask_secrets

    assert mask_secrets("cannot reach ['nats://a:b@h:1', 'tls://t0k@h2:2'] now") == "cannot reach ['nats://***@h:1', 'tls://***@h2:2'] now"
    assert mask_secrets("nats://h:4222 and http://x/y?z=1") == "nats://h:4222 and http://x/y?z=1"


def test_reward_token_from_the_environment(monkeypatch):
    cfg = parse_config({**SEED, "reward_function": {"type": "model_based", "endpoint": "http://rm/score", "token_env": "RL_TEST_RM_TOKEN"}})
    monkeypatch.setenv("RL_TEST_RM_TOKEN", "rm-env-tok-5")
    assert cfg.reward_function.token_value() == "rm-env-tok-5"
    assert "rm-env-tok-5" not in str(cfg.resolved())
    monkeypatch.delenv("RL_TEST_RM_TOKEN")
    with pytest.raises(ConfigError, match="RL_TEST_RM_TOKEN.*not set"):
        cfg.reward_function.token_value()
    with pytest.raises(ConfigError, match="token or reward_function.token_env, not both"):
        parse_config({**SEED, "reward_function": {"type": "model_based", "endpoint": "http://rm/score", "token": "x", "token_env": "V"}})


def test_reference_and_teacher_stages_and_distill():
    base = {"model_checkpoint_path": "m", "data_source": {"type": "on_policy"}}
    cfg = parse_config({**base, "training_mode": "RL_GRPO", "reference": {}})
    assert cfg.annotators == ("reference",) and cfg.reference.replicas == 1 and cfg.reference.model_path is None
    assert parse_config({**base, "training_mode": "RL_GRPO"}).annotators == ()
    distill = parse_config({**base, "training_mode": "DISTILL", "teacher": {"endpoint": "http://t:8000", "replicas": 2},
                            "reference": {"replicas": 3}, "algorithm_params": {"distill_coefficient": 0.5}})
    assert distill.annotators == ("reference", "teacher")  # chain order, whatever the key order
    assert distill.algorithm_params.distill_coefficient == 0.5 and distill.algorithm_params.kl_coefficient == 0.0
    assert distill.is_rl and distill.teacher.replicas == 2
    for data, message in (
        ({**base, "training_mode": "DISTILL"}, "DISTILL needs a teacher"),
        ({**base, "training_mode": "RL_GRPO", "teacher": {"model_path": "t"}}, "teacher stage is for training_mode DISTILL"),
        ({**base, "training_mode": "DISTILL", "teacher": {}}, "exactly one of model_path"),
        ({**base, "training_mode": "DISTILL", "teacher": {"model_path": "t", "endpoint": "http://t"}}, "exactly one of model_path"),
        ({"model_checkpoint_path": "m", "data_source": {"type": "off_policy"}, "training_mode": "SFT", "reference": {}},
         "reference stage annotates streamed RL groups"),
        ({**base, "training_mode": "RL_GRPO", "reference": {"replicas": 0}}, "reference.replicas"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_config(data)


@pytest.mark.parametrize("section, key, ours", [
    ("algorithm_params", "num_generations", "algorithm_params.group_size"),
    ("learner", "learning_rate", "learner.lr"),
    ("algorithm_params", "beta", "algorithm_params.kl_coefficient"),
    ("producer", "max_completion_length", "producer.max_new_tokens"),
    ("learner", "max_stpes", "learner.max_steps"),
])
def test_unknown_keys_suggest_ours(section, key, ours):
    data = {**SEED, section: {**SEED.get(section, {}), key: 8}}
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert f"{section}.{key}: unknown key (value 8); did you mean {ours}?" in str(err.value)


def test_help_shows_defaults():
    out = subprocess.run([sys.executable, "-m", "rlstream.cli", "broker", "--help"], capture_output=True, text=True, check=True).stdout
    assert "(default: 4222)" in out


def test_webdataset_source_needs_urls_resolves_them_and_serves_every_mode(tmp_path):
    base = {"model_checkpoint_path": "m"}
    for mode in ("SFT", "DPO", "RL_GRPO"):
        cfg = parse_config({**base, "training_mode": mode, "data_source": {"type": "webdataset", "urls": "s/t-{0..3}.tar"}})
        assert cfg.learner_reads_dataset == (mode != "RL_GRPO")  # RL: the feeder reads the shards
    with pytest.raises(ConfigError, match=r"needs data_source\.urls"):
        parse_config({**base, "training_mode": "SFT", "data_source": {"type": "webdataset"}})
    with pytest.raises(ConfigError, match=r"data_source\.urls is for type 'webdataset'"):
        parse_config({**base, "training_mode": "SFT", "data_source": {"type": "off_policy", "urls": "s/t.tar"}})
    with pytest.raises(ConfigError, match=r"part_index 2 must be below part_count 2"):
        parse_config({**base, "training_mode": "SFT", "data_source": {"type": "webdataset", "urls": "a.tar", "part_index": 2, "part_count": 2}})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**base, "training_mode": "SFT",
                                    "data_source": {"type": "webdataset", "urls": ["shards/t-{000..009}.tar", "pipe:cat x.tar"]}}))
    assert load_config(path).data_source.urls == [str(tmp_path / "shards/t-{000..009}.tar"), "pipe:cat x.tar"]


def test_each_producer_backend_has_only_its_own_settings():
    rl = {"training_mode": "RL_GRPO", "model_checkpoint_path": "m"}
    assert parse_config(rl).producer.backend == "hf"  # no backend given: hf
    hf = parse_config({**rl, "producer": {"device": "cuda:1", "dtype": "bfloat16", "count": 2}}).producer
    assert (hf.backend, hf.device, hf.dtype, hf.count) == ("hf", "cuda:1", "bfloat16", 2)
    vllm = parse_config({**rl, "producer": {"backend": "vllm", "vllm": {"max_model_len": 256}}}).producer
    assert vllm.vllm == {"max_model_len": 256} and not hasattr(vllm, "endpoint") and not hasattr(vllm, "device")
    fake = parse_config({**rl, "producer": {"backend": "fake", "latency_s": 0.5, "vocab_size": 64}}).producer
    assert (fake.latency_s, fake.vocab_size) == (0.5, 64) and not hasattr(fake, "dtype")
    # a setting of another backend: one line naming the backend it belongs to
    for producer, line in [
        ({"backend": "hf", "endpoint": "http://x:8000"}, "producer.endpoint: a setting of backend 'openai', not of 'hf'"),
        ({"vllm": {"max_model_len": 64}}, "producer.vllm: a setting of backend 'vllm', not of 'hf'"),
        ({"backend": "openai", "endpoint": "http://x", "dtype": "bfloat16"}, "producer.dtype: a setting of backend 'hf' or 'vllm', not of 'openai'"),
        ({"backend": "vllm", "latency_s": 1}, "producer.latency_s: a setting of backend 'fake', not of 'vllm'"),
        # the fake backend's knobs lost their prefix: the old spelling names the new one
        ({"backend": "fake", "fake_latency_s": 1}, "producer.fake_latency_s: renamed producer.latency_s (a setting of backend 'fake')"),
    ]:
        with pytest.raises(ConfigError) as err:
            parse_config({**rl, "producer": producer})
        lines = str(err.value).splitlines()
        assert len(lines) == 2 and lines[1].strip().startswith(line), lines
    with pytest.raises(ConfigError, match=r"producer\.batch_promts: unknown key .*did you mean producer\.batch_prompts"):
        parse_config({**rl, "producer": {"backend": "vllm", "batch_promts": 4}})
    # overrides pick the backend before validation, as in `rlstream run --set producer.backend=fake`
    assert parse_config(apply_overrides(rl, ["producer.backend=fake", "producer.hang_s=5"])).producer.hang_s == 5


def test_a_config_resolved_before_the_backend_split_still_loads():
    """config.resolved.json of an older run (replay reads it) lists every backend's settings,
    at their defaults but for its own backend's: it loads as that backend."""
    old_producer = {"backend": "hf", "count": 1, "batch_prompts": 8, "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0,
                    "top_k": 0, "stop": [], "device": "cpu", "dtype": "bfloat16", "vllm": {}, "endpoint": None,
                    "model_name": None, "request_timeout_s": 300.0, "request_retries": 3, "max_connections": 64, "seed": None,
                    "pipeline_batches": None, "in_progress_s": None, "max_weights_mb": 16384, "weights_fetch_tries": 3,
                    "generation_timeout_s": 600.0, "drain_timeout_s": 20.0, "fake_latency_s": 0.0, "fake_vocab_size": 512,
                    "fake_hang_file": None, "fake_hang_s": 3600.0}
    p = parse_config({"training_mode": "RL_GRPO", "model_checkpoint_path": "m", "producer": old_producer}).producer
    assert (p.backend, p.dtype, p.max_new_tokens) == ("hf", "bfloat16", 6)
    # but a value that says something is still refused
    with pytest.raises(ConfigError, match="producer.endpoint: a setting of backend 'openai'"):
        parse_config({"training_mode": "RL_GRPO", "model_checkpoint_path": "m", "producer": {**old_producer, "endpoint": "http://x"}})


def test_weight_update_defaults_to_what_the_benchmark_measures_ahead_per_backend():
    """Unset: in_flight on vllm, between_batches on hf, openai and fake, and under LoRA (the
    adapters load between batches); a value given is kept, and in_flight with LoRA is refused."""
    rl = {"training_mode": "RL_GRPO", "model_checkpoint_path": "m"}
    lora = {"lora": {"r": 8}}

    def update(producer, **sections):
        return parse_config({**rl, "producer": producer, **sections}).producer.weight_update

    assert update({"backend": "vllm"}) == "in_flight"
    assert update({"backend": "vllm"}, learner=lora) == "between_batches"
    assert update({}) == update({"backend": "hf"}) == update({"backend": "fake"}) == "between_batches"
    assert update({"backend": "openai", "endpoint": "http://x"}) == "between_batches"
    assert update({"backend": "vllm", "weight_update": "between_batches"}) == "between_batches"
    assert update({"backend": "hf", "weight_update": "in_flight"}) == "in_flight"
    with pytest.raises(ConfigError, match="with learner.lora the adapters load between batches"):
        update({"backend": "vllm", "weight_update": "in_flight"}, learner=lora)


def test_curriculum_section_defaults_bounds_and_where_it_applies():
    rl = {"model_checkpoint_path": "m", "training_mode": "RL_DAPO", "data_source": {"path": "d.jsonl"}}
    cur = parse_config({**rl, "data_source": {"path": "d.jsonl", "curriculum": {"enabled": True}}}).data_source.curriculum
    assert (cur.enabled, cur.settled_weight, cur.min_weight, cur.comes_back_after, cur.lead) == (True, 0.1, 0.01, 256, 64)
    assert not parse_config(rl).data_source.curriculum.enabled  # off unless asked for

    def refused(curriculum: dict, expected: str, **data_source):
        with pytest.raises(ConfigError, match=expected) as err:
            parse_config({**rl, "data_source": {"path": "d.jsonl", **data_source, "curriculum": curriculum}})
        assert len(str(err.value).strip().splitlines()) == 2  # "invalid config:" and one line naming the field

    refused({"settled_weight": 1.5}, r"data_source\.curriculum\.settled_weight: 1\.5 is not allowed; input should be less than or equal to 1")
    refused({"min_weight": 0}, r"data_source\.curriculum\.min_weight: 0 is not allowed; input should be greater than 0")
    refused({"comes_back_after": 0}, r"data_source\.curriculum\.comes_back_after: 0 is not allowed")
    refused({"lead": -1}, r"data_source\.curriculum\.lead: -1 is not allowed")
    refused({"enabled": True, "decay": 0.5}, r"data_source\.curriculum\.decay: unknown key")
    refused({"enabled": True}, r"data_source\.epochs 3 does not apply with a curriculum", epochs=3)
    refused({"enabled": True}, r"from a dataset file \(type 'on_policy'\), not type 'webdataset'", path=None, type="webdataset", urls="s/{0..1}.tar")
    refused({"enabled": True}, r"not type 'off_policy'", type="off_policy")
    with pytest.raises(ConfigError, match=r"data_source\.curriculum .* is for RL modes .* not DPO"):
        parse_config({"model_checkpoint_path": "m", "training_mode": "DPO", "algorithm_params": {"online_pairs": True},
                      "data_source": {"path": "d.jsonl", "curriculum": {"enabled": True}}})


def test_stale_policy_and_stale_cap():
    rl = {"model_checkpoint_path": "m", "training_mode": "RL_GRPO"}
    cfg = parse_config(rl)
    assert (cfg.algorithm_params.stale_policy, cfg.algorithm_params.stale_cap, cfg.drop_staleness) == ("drop", None, 1)
    cfg = parse_config({**rl, "algorithm_params": {"stale_policy": "correct", "max_staleness": 2}})
    # the default cap is 4 x max_staleness; producers stay paced to max_staleness
    assert (cfg.algorithm_params.stale_cap, cfg.drop_staleness, cfg.max_staleness) == (8, 8, 2)
    assert parse_config(cfg.resolved()).algorithm_params.stale_cap == 8
    assert parse_config({**rl, "algorithm_params": {"stale_policy": "correct", "max_staleness": 0}}).algorithm_params.stale_cap == 4

    def refused(algo: dict, expected: str):
        with pytest.raises(ConfigError, match=expected) as err:
            parse_config({**rl, "algorithm_params": algo})
        assert len(str(err.value).strip().splitlines()) == 2  # "invalid config:" and one line

    refused({"stale_policy": "keep"}, r"algorithm_params\.stale_policy: 'keep' is not allowed; allowed: 'drop' or 'correct'")
    refused({"stale_policy": "correct", "stale_cap": 0}, r"algorithm_params\.stale_cap: 0 is not allowed")
    refused({"stale_policy": "correct", "stale_cap": 1}, r"stale_cap \(1\) must be greater than max_staleness \(1\)")
    refused({"stale_cap": 3}, r"stale_cap \(3\) applies with stale_policy 'correct' only")
    refused({"stale_policy": "correct", "off_policy_correction": "none"}, r"stale_policy 'correct' needs an off_policy_correction other than 'none'")


RULES_ALLOWED = "'exact_match', 'math', 'format', 'length_penalty', 'overlong', 'reasoning_gym', 'env' or 'verifiers'"


def _terms(terms):
    return parse_config({"training_mode": "RL_GRPO", "model_checkpoint_path": "m", "reward_function": {"terms": terms}})


def test_each_reward_rule_is_a_class_with_its_own_settings():
    from rlstream.config import ExactMatchTerm, FormatTerm, FunctionTerm, MathTerm, OverlongTerm

    cfg = _terms([{"rule": "math"}, {"rule": "exact_match", "params": {"extract": True}, "weight": 0.5},
                  {"rule": "format", "pattern": "<a>.*", "mode": "search", "name": "tags"},
                  {"rule": "overlong", "max_length": 100}, {"function": "pkg.mod:brevity", "params": {"target": 20}}])
    math, exact, fmt, overlong, fn = cfg.reward_function.terms
    assert isinstance(math, MathTerm) and (math.name, math.weight) == ("math", 1.0)
    assert isinstance(exact, ExactMatchTerm) and (exact.extract, exact.case_sensitive, exact.weight) == (True, False, 0.5)
    assert isinstance(fmt, FormatTerm) and (fmt.name, fmt.pattern, fmt.mode) == ("tags", "<a>.*", "search")
    assert isinstance(overlong, OverlongTerm) and overlong.settings == {"max_length": 100}
    assert isinstance(fn, FunctionTerm) and (fn.name, fn.params) == ("brevity", {"target": 20})
    assert _terms([{"rule": "format", "params": {"pattern": "x"}}]).reward_function.terms == \
        _terms([{"rule": "format", "pattern": "x"}]).reward_function.terms


def test_reward_terms_resolved_before_and_now_load_back():
    # config.resolved.json of a run from before the terms were typed lists both keys and params
    before = [{"name": "math", "rule": "math", "function": None, "weight": 1.0, "params": {}},
              {"name": "fmt", "rule": "format", "function": None, "weight": 0.2, "params": {"pattern": "x"}},
              {"name": "c", "rule": None, "function": "a.b:c", "weight": 1.0, "params": {"k": 1}}]
    cfg = _terms(before)
    assert [(t.name, t.weight) for t in cfg.reward_function.terms] == [("math", 1.0), ("fmt", 0.2), ("c", 1.0)]
    again = _terms(cfg.resolved()["reward_function"]["terms"])
    assert again.reward_function.terms == cfg.reward_function.terms


@pytest.mark.parametrize("terms, expected", [
    ([{}], "reward_function.terms.0: give exactly one of 'rule' or 'function' (value {})"),
    ([{"rule": "math", "function": "a.b:c"}], "reward_function.terms.0: give exactly one of 'rule' or 'function'"),
    ([{"function": "not a path"}], "reward_function.terms.0: function 'not a path' must look like 'package.module:function'"),
    ([{"rule": "bogus"}], f"reward_function.terms.0.rule: 'bogus' is not allowed; allowed: {RULES_ALLOWED}"),
    ([{"rule": "math", "wieght": 2}], "reward_function.terms.0.wieght: unknown key (value 2); did you mean reward_function.terms.weight?"),
    ([{"rule": "math", "weight": 1e9}], "reward_function.terms.0.weight: 1000000000.0 is not allowed; input should be less than"),
    (["math"], "reward_function.terms.0: 'math' is not allowed; input should be a valid dictionary or instance of RewardTerm"),
    ([{"rule": "math", "params": {"x": 1}}], "reward term 'math' (math): unknown params ['x']; allowed: []"),
    ([{"rule": "overlong", "params": {"nope": 1}}], "reward term 'overlong' (overlong): unknown params ['nope']; allowed: ['buffer', 'factor', 'max_length']"),
    ([{"rule": "exact_match", "fuzzy": True}], "reward_function.terms.0.fuzzy: unknown key (value True)"),
    ([{"rule": "format"}], "reward_function.terms.0.pattern: reward term 'format' (format) needs params.pattern, a regular expression"),
    ([{"rule": "format", "pattern": "("}], "reward_function.terms.0.pattern: reward term 'format' (format): '(' is not a regular expression"),
    ([{"rule": "format", "pattern": "x", "mode": "find"}], "reward_function.terms.0.mode: 'find' is not allowed; allowed: 'fullmatch', 'match' or 'search'"),
    ([{"rule": "format", "pattern": "x", "params": {"pattern": "y"}}], "pattern is given twice, beside the rule and in params; keep one"),
    ([{"rule": "length_penalty", "max_length": 10, "free_tokens": 12}], "length_penalty: max_length (10) must exceed free_tokens (12)"),
    ([{"rule": "overlong", "buffer": -1}], "reward_function.terms.0.buffer: -1 is not allowed; input should be greater than or equal to 0"),
])
def test_reward_term_errors_are_one_line_naming_the_term(terms, expected):
    with pytest.raises(ConfigError) as err:
        _terms(terms)
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1 and expected in lines[0], lines
