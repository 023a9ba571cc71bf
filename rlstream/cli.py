"""The ``rlstream`` command line: thin entry points over the components.

Each component module exposes ``async def main(cfg, nats_url, component_id, **kw) -> int``;
this file only parses arguments, loads the config and calls it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rlstream import __version__

if TYPE_CHECKING:
    from rlstream.broker.component import ComponentMain


def _setup_logging(verbose: bool = False) -> None:
    from rlstream.config import SecretMaskingFormatter

    level = logging.DEBUG if verbose else getattr(logging, os.environ.get("RLSTREAM_LOG", "INFO").upper(), logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SecretMaskingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    for noisy in ("nats", "asyncio", "httpx", "urllib3", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def _load(args: argparse.Namespace):
    from rlstream.config import ConfigError, env_overrides, load_config

    try:  # overrides from `rlstream run` (in the environment) first, then this command's own --set
        return load_config(args.config, env_overrides() + (getattr(args, "set", None) or []))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _nats_url(args: argparse.Namespace, cfg, optional: bool = False) -> str | None:
    from rlstream.broker.connection import nats_url

    url = nats_url(getattr(args, "nats", None), cfg.nats.url if cfg is not None else None)
    if not url and not optional:
        print("error: no NATS URL: pass --nats, set nats.url in the config or RLSTREAM_NATS_URL", file=sys.stderr)
        raise SystemExit(2)
    return url


def _call(module: str, func: str = "main"):
    return getattr(importlib.import_module(module), func)


# ---- commands --------------------------------------------------------------------------


def run_preflight(cfg, endpoints: bool = False) -> int:
    """Print every preflight problem on its own line; 2 when there is one, else 0."""
    from rlstream.run.preflight import preflight

    problems = preflight(cfg, endpoints=endpoints)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return 2 if problems else 0


def cmd_validate(args) -> int:
    cfg = _load(args)
    if not args.schema_only and run_preflight(cfg, endpoints=args.check_endpoints):
        return 2
    checked = "config" if args.schema_only else "config; model, tokenizer, dataset and rewards load"
    print(f"ok: {args.config} is a valid {cfg.training_mode} {checked} (run {cfg.run!r})")
    return 0


def _secret(env_var: str | None, file: str | None, what: str) -> str | None:
    """A secret from an environment variable or a file, so it never sits on a command line."""
    if file:
        try:
            value = Path(file).read_text().strip()
        except OSError as exc:
            print(f"error: {what} file {file}: {exc.strerror}", file=sys.stderr)
            raise SystemExit(2) from None
    elif env_var:
        value = os.environ.get(env_var, "")
        if not value:
            print(f"error: {what}: the environment variable {env_var} is not set", file=sys.stderr)
            raise SystemExit(2)
    else:
        return None
    from rlstream.config import placeholder_secret

    why = placeholder_secret(value)
    if why:
        print(f"error: {what} is {why}; set the real secret", file=sys.stderr)
        raise SystemExit(2)
    return value


def cmd_export_model(args) -> int:
    return _call("rlstream.learner.export_model", "cli")(args)


def cmd_eval(args) -> int:
    args.config = args.config_path
    return _call("rlstream.evaluation.checkpoint", "cli")(args, _load(args))


def cmd_broker(args) -> int:
    from rlstream.broker.errors import BrokerError
    from rlstream.broker.server import run_foreground

    token = _secret(args.token_env, args.token_file, "--token")
    password = _secret(args.password_env, args.password_file, "--password")
    if password and not args.user:
        print("error: a password needs --user", file=sys.stderr)
        return 2
    if args.user and not password:
        print("error: --user needs --password-env or --password-file", file=sys.stderr)
        return 2
    if token and password:
        print("error: give a token or a user/password, not both", file=sys.stderr)
        return 2
    auth = {"token": token} if token else ({"user": args.user, "password": password} if password else None)
    try:
        return run_foreground(args.port, args.store, args.host, authorization=auth, config_file=args.config)
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _component(module: str, default_id: str, **fixed):
    def run(args) -> int:
        cfg = _load(args)
        # an offline SFT/DPO learner needs no broker (nothing to publish to)
        offline = module == "rlstream.learner.loop" and cfg.learner_reads_dataset
        url = _nats_url(args, cfg, optional=offline)
        main: ComponentMain = _call(module)
        extra = dict(fixed)
        if getattr(args, "run_dir", None):
            extra["run_dir"] = Path(args.run_dir)
        if getattr(args, "resume", False):
            extra["resume"] = True
        if getattr(args, "max_steps", None):
            extra["max_steps"] = args.max_steps
        from rlstream.data.rows import DatasetError

        try:
            return asyncio.run(main(cfg, url, args.id or default_id, **extra)) or 0
        except DatasetError as exc:  # e.g. the curriculum's dataset in the learner: the user's to fix, so exit 2 (not restarted)
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return run


def cmd_run(args) -> int:
    return _call("rlstream.run")(args)  # it reads the config and runs the preflight once its preloader started


def cmd_reward_server(args) -> int:
    return _call("rlstream.scorers.reward_server", "cli")(args)


def cmd_replay(args) -> int:
    """A run directory: replay from its checkpoint and the broker, or with ``--bundle`` pack the
    steps into a tar; a bundle (a file): replay it, ``--rescore`` it or dump a micro-batch."""
    from rlstream.observe import nats_config

    target = Path(args.run_dir)
    if args.bundle:
        return _call("rlstream.learner.bundle", "cli_write")(args, nats_config(args))
    if target.is_dir():
        if args.rescore or args.micro_batch is not None:
            print(f"error: --rescore and --micro-batch read a bundle; {target} is a run directory "
                  "(write one with --bundle OUT.tar --steps A-B)", file=sys.stderr)
            return 2
        return _call("rlstream.learner.replay", "cli")(args, nats_config(args))
    if args.rescore:
        return _call("rlstream.run.rescore", "cli")(args)
    return _call("rlstream.learner.bundle", "cli_replay")(args)


def cmd_observe(name: str):
    def run(args) -> int:
        command = _call(f"rlstream.observe.{name}", "cli")
        run_dir = getattr(args, "run_dir", None)
        if not run_dir:
            if hasattr(args, "run") and not args.run:
                print("error: give RUN_DIR, or --run RUN (with --nats)", file=sys.stderr)
                return 2
            return command(args)
        from rlstream.observe import ObserveError
        from rlstream.observe.rundir import read_run_id, run_broker

        try:
            if hasattr(args, "run") and not args.run:
                args.run = read_run_id(Path(run_dir))
            from rlstream.broker.connection import nats_url

            if nats_url(args.nats):
                return command(args)
            with run_broker(Path(run_dir), log=lambda m: print(m, file=sys.stderr, flush=True)) as url:
                args.nats = url
                return command(args)
        except ObserveError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return run


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows each option's default, when it has a meaningful one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlstream", description="Asynchronous streaming post-training over NATS JetStream.")
    p.add_argument("--version", action="version", version=f"rlstream {__version__}")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_parser = sub.add_parser

    def add_parser(name, **kw):  # every command's --help shows its defaults
        return _add_parser(name, formatter_class=_DefaultsFormatter, **kw)

    sub.add_parser = add_parser

    def with_config(sp):
        sp.add_argument("config", help="YAML config file")
        sp.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a config value")

    def with_nats(sp):
        sp.add_argument("--nats", help="NATS URL (default: nats.url from the config, or $RLSTREAM_NATS_URL); "
                        "credentials go in the options below, not in the URL")

    def with_nats_credentials(sp):
        g = sp.add_argument_group("NATS credentials (or $RLSTREAM_NATS_USER/_PASSWORD/_TOKEN/_CREDS)")
        g.add_argument("--nats-user", help="user name")
        g.add_argument("--nats-password-env", metavar="VAR", help="read the password from the environment variable VAR")
        g.add_argument("--nats-token-env", metavar="VAR", help="read the token from the environment variable VAR")
        g.add_argument("--nats-creds", metavar="FILE", help="a NATS credentials file")
        g.add_argument("--nats-ca", metavar="FILE", help="CA certificate for a TLS server")

    sp = sub.add_parser("validate", help="check a config, and that its model, data and rewards load; exit 0 or name each problem")
    with_config(sp)
    sp.add_argument("--schema-only", action="store_true", help="check the config's fields only (load nothing)")
    sp.add_argument("--check-endpoints", action="store_true", help="also check that the NATS, sampling and reward endpoints accept connections")
    sp.set_defaults(fn=cmd_validate)

    sp = sub.add_parser("run", help="everything on one machine (embedded nats-server unless nats.url is set)")
    with_config(sp)
    sp.add_argument("--run-dir", help="run directory (default runs/<run>)")
    sp.add_argument("--max-steps", type=int, help="stop after this many learner steps")
    sp.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    sp.add_argument("--overwrite", action="store_true", help="delete what --run-dir holds and start a new run there")
    sp.add_argument("--no-live", action="store_true", help="plain log lines instead of the live display")
    sp.add_argument("--skip-preflight", action="store_true", help="start without checking that the model, data and rewards load")
    sp.add_argument("--check-endpoints", action="store_true", help="preflight also checks that configured endpoints accept connections")
    sp.set_defaults(fn=cmd_run)

    sp = sub.add_parser("export-model", help="a checkpoint as a clean Hugging Face model directory with a model card")
    sp.add_argument("checkpoint", help="a checkpoints/step_N directory (or checkpoints/latest, or a run directory)")
    sp.add_argument("out", help="output directory (must not exist, or be empty)")
    sp.add_argument("--push-to-hub", metavar="REPO_ID", help="also upload it to this Hub repository (token from $HF_TOKEN or `hf auth login`)")
    sp.add_argument("--private", action="store_true", help="create the Hub repository private")
    sp.add_argument("--base", help="a LoRA checkpoint's base model (default: the adapter config's base_model_name_or_path)")
    sp.set_defaults(fn=cmd_export_model)

    sp = sub.add_parser("eval", help="evaluate a checkpoint on the config's eval dataset with its reward terms (no broker)")
    sp.add_argument("checkpoint", help="a model directory: checkpoints/step_N, checkpoints/latest, or a run directory")
    sp.add_argument("--config", dest="config_path", required=True, help="YAML config file with an eval section")
    sp.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a config value")
    sp.add_argument("--out", help="also write the figures to this JSON file")
    sp.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    sp.set_defaults(fn=cmd_eval)

    sp = sub.add_parser("broker", help="the embedded nats-server in the foreground")
    sp.add_argument("--port", type=int, default=4222, help="client port")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sp.add_argument("--store", default="nats-store", help="JetStream store directory")
    sp.add_argument("--token-env", metavar="VAR", help="require this token, read from the environment variable VAR")
    sp.add_argument("--token-file", help="require the token in this file")
    sp.add_argument("--user", help="require this user (with --password-env or --password-file)")
    sp.add_argument("--password-env", metavar="VAR", help="the user's password, from the environment variable VAR")
    sp.add_argument("--password-file", help="the user's password, from this file")
    sp.add_argument("--config", help="a nats-server config file of your own (accounts, TLS); credentials come from it")
    sp.set_defaults(fn=cmd_broker)

    components = {
        "feed": ("rlstream.producers.feeder", "feeder", "publish the prompt dataset to the prompts stream"),
        "producer": ("rlstream.producers.loop", "producer-0", "generate rollout groups from prompts"),
        "scorer": ("rlstream.scorers.loop", "scorer-0", "score rollout groups"),
        "reference": ("rlstream.annotators.loop", "reference-0", "add the frozen reference's log-probs to scored groups"),
        "teacher": ("rlstream.annotators.loop", "teacher-0", "add the teacher's log-probs to scored groups (DISTILL)"),
        "learner": ("rlstream.learner.loop", "learner", "train on scored groups (or an offline dataset)"),
    }
    for name, (module, default_id, help_text) in components.items():
        sp = sub.add_parser(name, help=help_text)
        with_config(sp)
        with_nats(sp)
        sp.add_argument("--id", help=f"component id (default {default_id})")
        if name == "learner":
            sp.add_argument("--run-dir", help="where checkpoints and metrics go (default runs/<run>)")
            sp.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --run-dir")
            sp.add_argument("--max-steps", type=int)
        fixed = {"stage": name} if module == "rlstream.annotators.loop" else {}
        sp.set_defaults(fn=_component(module, default_id, **fixed))

    sp = sub.add_parser("reward-server", help="serve a reward model over HTTP")
    sp.add_argument("--model", required=True, help="Hugging Face model directory")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sp.add_argument("--port", type=int, default=8000, help="HTTP port")
    sp.add_argument("--token", help=argparse.SUPPRESS)  # refused with a one-line error: a secret on argv
    sp.add_argument("--token-file", help="read the bearer token (required when not bound to loopback) from this file, "
                    "e.g. a mounted Secret; or set $RLSTREAM_REWARD_TOKEN")
    sp.add_argument("--max-batch", type=int, default=64, help="sequences per forward pass")
    sp.add_argument("--max-texts", type=int, default=4096, help="texts one request may hold (413 beyond)")
    sp.add_argument("--max-body-mb", type=int, default=16, help="largest request body (413 beyond)")
    sp.add_argument("--tls-cert", metavar="PEM", help="serve https with this certificate chain (with --tls-key)")
    sp.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    sp.set_defaults(fn=cmd_reward_server)

    sp = sub.add_parser("tail", help="live records or metrics on any subject (wildcards)")
    sp.add_argument("subject")
    sp.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a run directory: its broker (started on its store if none runs)")
    with_nats(sp)
    with_nats_credentials(sp)
    sp.add_argument("--json", action="store_true", help="one JSON object per line")
    sp.add_argument("--from-seq", type=int, help="start at this stream sequence")
    sp.add_argument("--since", help="start at this time (ISO 8601, or seconds ago like 300s)")
    sp.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE", help="keep records whose field equals value")
    sp.add_argument("--tokenizer", help="tokenizer directory, to show token text")
    sp.add_argument("--count", type=int, help="stop after this many records")
    sp.add_argument("--timeout", type=float, help="stop after this many idle seconds")
    sp.set_defaults(fn=cmd_observe("tail"))

    sp = sub.add_parser("status", help="streams, consumers, components alive, policy version, lag")
    sp.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a run directory: its run id and broker (started on its store if none runs)")
    sp.add_argument("--run", help="run id (default: the run of RUN_DIR)")
    with_nats(sp)
    with_nats_credentials(sp)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_observe("status"))

    sp = sub.add_parser("export", help="write a range of a stream to a file")
    sp.add_argument("--run-dir", help="a run directory: its run id and broker (started on its store if none runs)")
    sp.add_argument("--run", help="run id (default: the run of --run-dir)")
    sp.add_argument("--stream", required=True, choices=["prompts", "rollouts", "scored", "reference", "teacher", "metrics", "dlq"],
                    help="reference, teacher: the links the annotating stages publish")
    with_nats(sp)
    with_nats_credentials(sp)
    sp.add_argument("--out", required=True)
    sp.add_argument("--from-seq", type=int)
    sp.add_argument("--to-seq", type=int)
    sp.add_argument("--since")
    sp.add_argument("--until")
    sp.set_defaults(fn=cmd_observe("export"))

    sp = sub.add_parser("import", help="publish an exported file into a run")
    sp.add_argument("file")
    sp.add_argument("--run-dir", help="a run directory: its run id and broker (started on its store if none runs)")
    sp.add_argument("--run", help="run id (default: the run of --run-dir)")
    with_nats(sp)
    with_nats_credentials(sp)
    sp.add_argument("--force", action="store_true", help="publish again even if this file was imported into the run before")
    sp.set_defaults(fn=cmd_observe("export_import"))

    sp = sub.add_parser("replay", help="re-run learner steps from a checkpoint on recorded groups (or from a bundle); compare losses")
    sp.add_argument("run_dir", metavar="RUN_DIR|BUNDLE", help="a run directory, or a bundle written with --bundle")
    with_nats(sp)
    with_nats_credentials(sp)
    sp.add_argument("--from-step", type=int, help="checkpoint step to start from (with --steps N)")
    sp.add_argument("--steps", help="N learner steps after --from-step (default 4), or a range A-B (from the state after A-1)")
    sp.add_argument("--bundle", metavar="OUT.tar", help="write the steps, their checkpoint, groups and recorded figures to a portable tar")
    sp.add_argument("--rescore", action="store_true", help="BUNDLE: run the config's reward terms again; print the groups whose rewards differ")
    sp.add_argument("--micro-batch", type=int, metavar="N", help="BUNDLE: stop at micro-batch N and write its tensors (safetensors)")
    sp.add_argument("--step", type=int, help="with --micro-batch: the step (default the bundle's first)")
    sp.add_argument("--out", help="with --micro-batch: the file to write (default microbatch_step<S>_<N>.safetensors)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: bitwise)")
    sp.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bitwise)")
    sp.set_defaults(fn=cmd_replay)

    sp = sub.add_parser("dashboard", help="a live web page of the run's metrics")
    sp.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a run directory: its run id and broker (started on its store if none runs)")
    sp.add_argument("--run", help="run id (default: the run of RUN_DIR)")
    with_nats(sp)
    with_nats_credentials(sp)
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on")
    sp.add_argument("--port", type=int, default=8265, help="0: any free port")
    sp.add_argument("--backfill", type=int, default=5000, help="metric events of history each page loads first")
    sp.add_argument("--max-viewers", type=int, default=64, help="open /events connections at most (503 beyond)")
    sp.add_argument("--token-file", help="the token viewers must give (default $RLSTREAM_DASHBOARD_TOKEN); needed off loopback")
    sp.set_defaults(fn=cmd_observe("dashboard"))

    from rlstream.run.backup import add_parsers as add_backup_parsers

    add_backup_parsers(sub)  # backup, restore
    from rlstream.data.shards import add_parsers as add_shards_parser

    add_shards_parser(sub)  # shards
    return p


def library_defaults() -> None:
    """Environment defaults set before any library reads them: transformers', huggingface_hub's
    and datasets' tqdm bars fill logs with carriage returns."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def main(argv: list[str] | None = None) -> int:
    library_defaults()
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.fn(args) or 0
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("rlstream."):
            print(f"error: `rlstream {args.command}` is not available in this build ({exc.name} missing)", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
