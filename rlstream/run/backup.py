"""Backups of a run to an S3-compatible object store, and restores from it.

``rlstream backup RUN_DIR --to s3://BUCKET/PREFIX`` copies

- the run's config: the files given with ``--config`` (stored as ``config/<name>``) and the
  run directory's ``config.resolved.json`` when there is one, each with its secrets masked
  (every value of a key that names a password, token, secret, API key or credential is
  ``***``; the ``*_env`` and ``*_file`` keys that say where a secret is are kept);
- the newest ``--keep`` complete checkpoints (``checkpoints/step_N/``; the ``.tmp`` leftovers
  of a crash are never copied);
- the run directory's records: ``metrics.jsonl``, summaries, ``logs/``, timelines, plots;
  not the embedded broker's store (``nats/``) unless ``--broker-store`` is given, and only
  copy that once the run has stopped (a live JetStream store is not a consistent snapshot);
  never the embedded broker's token (``broker.token``: a resume makes a new one).

Each backup is one folder, ``PREFIX/<UTC time>-step<N>/``, holding ``files/...`` and, written
last, ``MANIFEST.json``: the sha256 and size of every file. A folder without a manifest is
an unfinished backup and is never restored. ``--keep-backups K`` deletes all but the newest
K complete backups afterwards.

``rlstream restore s3://BUCKET/PREFIX RUN_DIR`` takes the newest complete backup (or
``--backup ID``), downloads every file into a temporary folder inside RUN_DIR, checks each
sha256 against the manifest, and only then moves the files into place. Then
``rlstream learner CONFIG --run-dir RUN_DIR --resume`` (or ``rlstream run ... --resume``)
continues the run from the newest checkpoint.

The client is boto3, with its usual configuration: credentials from the environment
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``), a profile, or the pod's role, never from
the command line; ``AWS_ENDPOINT_URL`` or ``--endpoint-url`` for MinIO, Ceph, R2, GCS's XML
API and other S3-compatible stores; ``AWS_DEFAULT_REGION`` for a bucket in another region.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from rlstream.config import mask_secrets
from rlstream.rundir.files import BROKER_TOKEN_FILE

log = logging.getLogger(__name__)

FORMAT = "rlstream-backup/1"
MANIFEST = "MANIFEST.json"
BROKER_STORE = "nats"
CHUNK = 1 << 20
NEVER_COPIED = {BROKER_TOKEN_FILE}
"""Files of the run directory that hold a secret: never sent to the backup."""
_SECRET_KEY = re.compile(r"(?i)(^|_)(password|passwd|token|secret|api_?key|credentials?)($|_)")
_WHERE_KEY = re.compile(r"(?i)_(env|file|path)$")
"""Keys that say where a secret is (``token_env``, ``password_file``), not what it is."""


def mask_config(value: Any) -> Any:
    """``value`` (a parsed config) with the value of every secret-naming key replaced by ``***``,
    and the userinfo of every URL masked."""
    if isinstance(value, dict):
        return {k: "***" if isinstance(k, str) and _SECRET_KEY.search(k) and not _WHERE_KEY.search(k)
                and isinstance(v, (str, int)) and v != "" else mask_config(v) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_config(v) for v in value]
    return mask_secrets(value) if isinstance(value, str) else value


def masked_config(path: Path, data: bytes) -> bytes:
    """A config file's bytes with its secrets masked (JSON stays JSON, YAML becomes YAML)."""
    import yaml

    try:
        if path.suffix == ".json":
            return json.dumps(mask_config(json.loads(data)), indent=2).encode()
        return yaml.safe_dump(mask_config(yaml.safe_load(data)), sort_keys=False).encode()
    except (ValueError, yaml.YAMLError) as exc:
        raise BackupError(f"config {path} does not parse, so its secrets cannot be masked: {' '.join(str(exc).split())[:200]}") from None


class BackupError(RuntimeError):
    """A backup or restore that cannot be done as asked; the message says what to fix."""


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix")."""
    if not url.startswith("s3://"):
        raise BackupError(f"{url!r}: expected s3://BUCKET[/PREFIX]")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise BackupError(f"{url!r}: no bucket")
    return bucket, prefix.strip("/")


def make_client(endpoint_url: str | None = None):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _key(prefix: str, *parts: str) -> str:
    return "/".join(p for p in (prefix, *parts) if p)


# ---- what goes in --------------------------------------------------------------------------


def record_files(run_dir: Path, broker_store: bool = False) -> list[Path]:
    """Every plain file of the run directory outside ``checkpoints/`` (and ``nats/`` unless asked)."""
    out = []
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir)
        if rel.parts[0] == "checkpoints" or (rel.parts[0] == BROKER_STORE and not broker_store):
            continue
        if path.is_file() and not path.is_symlink() and rel.as_posix() not in NEVER_COPIED:
            out.append(path)
    return out


def backup(run_dir: str | Path, url: str, *, keep: int = 2, configs: list[str | Path] = (), broker_store: bool = False,
           keep_backups: int | None = None, client=None, now: _dt.datetime | None = None) -> dict[str, Any]:
    """Copy the run to ``url``; returns the manifest written."""
    from rlstream.learner.checkpoint import list_checkpoints, step_of

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise BackupError(f"run directory {run_dir} does not exist")
    if keep < 1:
        raise BackupError("--keep must be at least 1: a backup without a checkpoint cannot be resumed")
    bucket, prefix = parse_url(url)
    client = client or make_client()
    checkpoints = list_checkpoints(run_dir)[-keep:]
    if not checkpoints:
        log.warning("%s has no complete checkpoint yet: backing up the config and records only", run_dir)
    latest = step_of(checkpoints[-1]) if checkpoints else 0
    now = now or _dt.datetime.now(_dt.timezone.utc)
    backup_id = f"{now:%Y%m%dT%H%M%S}Z-step{latest:08d}"
    files: list[dict[str, Any]] = []

    def put_bytes(rel: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=_key(prefix, backup_id, "files", rel), Body=data)
        files.append({"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)})

    # config and records may still be growing (metrics.jsonl): read once, hash and send those bytes
    for cfg_path in map(Path, configs):
        if not cfg_path.is_file():
            raise BackupError(f"config {cfg_path} does not exist")
        put_bytes(f"config/{cfg_path.name}", masked_config(cfg_path, cfg_path.read_bytes()))
    for path in record_files(run_dir, broker_store):
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # a log rotated away while we listed: nothing to keep
            continue
        rel = path.relative_to(run_dir).as_posix()
        put_bytes(rel, masked_config(path, data) if rel == "config.resolved.json" else data)
    # a complete checkpoint is never written again, only deleted (pruned) as a whole
    kept = []
    for ckpt in checkpoints:
        entries = []
        try:
            for path in sorted(p for p in ckpt.rglob("*") if p.is_file() and not p.is_symlink()):
                rel = path.relative_to(run_dir).as_posix()
                digest = sha256_file(path)
                client.upload_file(str(path), bucket, _key(prefix, backup_id, "files", rel))
                entries.append({"path": rel, "sha256": digest, "size": path.stat().st_size})
        except FileNotFoundError:
            log.warning("%s was pruned by the learner during the backup; left out", ckpt.name)
            continue
        files += entries
        kept.append(ckpt.name)
    if checkpoints and not kept:
        raise BackupError("every checkpoint was pruned during the backup; run it again")
    manifest = {
        "format": FORMAT, "id": backup_id, "created": now.isoformat(), "source": str(run_dir.resolve()),
        "checkpoints": kept, "latest_step": step_of(Path(kept[-1])) if kept else 0,
        "configs": [f"config/{Path(c).name}" for c in configs], "files": files,
    }
    # the manifest goes last: a backup without one is unfinished and never restored
    client.put_object(Bucket=bucket, Key=_key(prefix, backup_id, MANIFEST), Body=json.dumps(manifest, indent=1).encode())
    total = sum(f["size"] for f in files)
    log.info("backup %s: %d files, %.1f MiB, checkpoints %s -> s3://%s/%s", backup_id, len(files), total / 2**20,
             ", ".join(kept) or "none", bucket, _key(prefix, backup_id))
    if keep_backups is not None:
        prune_backups(client, bucket, prefix, keep_backups)
    return manifest


# ---- what comes out ------------------------------------------------------------------------


def list_backups(client, bucket: str, prefix: str) -> list[str]:
    """Ids of the complete backups under ``prefix`` (those with a manifest), oldest first."""
    ids = []
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=_key(prefix) + "/" if prefix else "", Delimiter="/"):
        for cp in page.get("CommonPrefixes", []):
            backup_id = cp["Prefix"].rstrip("/").rsplit("/", 1)[-1]
            head = client.list_objects_v2(Bucket=bucket, Prefix=_key(prefix, backup_id, MANIFEST), MaxKeys=1)
            if head.get("KeyCount", 0):
                ids.append(backup_id)
    return sorted(ids)


def prune_backups(client, bucket: str, prefix: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete backups; returns the ids deleted."""
    gone = list_backups(client, bucket, prefix)[:-keep] if keep > 0 else []
    paginator = client.get_paginator("list_objects_v2")
    for backup_id in gone:
        for page in paginator.paginate(Bucket=bucket, Prefix=_key(prefix, backup_id) + "/"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
        log.info("deleted old backup %s", backup_id)
    return gone


def restore(url: str, run_dir: str | Path, *, backup_id: str | None = None, force: bool = False, client=None) -> dict[str, Any]:
    """Bring a backup back into ``run_dir`` (new, or empty unless ``force``); returns its manifest."""
    run_dir = Path(run_dir)
    bucket, prefix = parse_url(url)
    client = client or make_client()
    if run_dir.exists() and any(run_dir.iterdir()) and not force:
        raise BackupError(f"{run_dir} is not empty: restore into a new directory (or pass --force to overwrite)")
    if backup_id is None:
        ids = list_backups(client, bucket, prefix)
        if not ids:
            raise BackupError(f"no complete backup under {url}")
        backup_id = ids[-1]
    try:
        body = client.get_object(Bucket=bucket, Key=_key(prefix, backup_id, MANIFEST))["Body"].read()
    except client.exceptions.NoSuchKey:
        raise BackupError(f"backup {backup_id} under {url} has no {MANIFEST} (unfinished, or no such backup)") from None
    manifest = json.loads(body)
    if manifest.get("format") != FORMAT:
        raise BackupError(f"backup {backup_id}: unknown format {manifest.get('format')!r} (expected {FORMAT})")
    run_dir.mkdir(parents=True, exist_ok=True)
    staging = run_dir / ".restore.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    bad = []
    try:
        for entry in manifest["files"]:
            rel = Path(entry["path"])
            if rel.is_absolute() or ".." in rel.parts:
                raise BackupError(f"backup {backup_id}: unsafe path {entry['path']!r} in the manifest")
            dest = staging / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, _key(prefix, backup_id, "files", entry["path"]), str(dest))
            digest = sha256_file(dest)
            if digest != entry["sha256"] or dest.stat().st_size != entry["size"]:
                bad.append(f"{entry['path']}: sha256 {digest[:12]}... size {dest.stat().st_size}, "
                           f"manifest says {entry['sha256'][:12]}... size {entry['size']}")
        if bad:
            raise BackupError(f"backup {backup_id} failed its integrity check; nothing was restored:\n  " + "\n  ".join(bad))
        for entry in manifest["files"]:
            dest = run_dir / entry["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            (staging / entry["path"]).replace(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("restored backup %s (%d files, checkpoints %s) into %s", backup_id, len(manifest["files"]),
             ", ".join(manifest["checkpoints"]) or "none", run_dir)
    return manifest


# ---- command line ----------------------------------------------------------------------------


def add_parsers(sub) -> None:
    """``rlstream backup`` and ``rlstream restore``."""
    sp = sub.add_parser("backup", help="copy a run's config, newest checkpoints and records to an S3-compatible store")
    sp.add_argument("run_dir")
    sp.add_argument("--to", required=True, metavar="s3://BUCKET/PREFIX")
    sp.add_argument("--keep", type=int, default=2, help="newest complete checkpoints to copy (default 2)")
    sp.add_argument("--config", dest="configs", action="append", default=[], help="config file to copy with the run (repeatable)")
    sp.add_argument("--keep-backups", type=int, help="afterwards, delete all but the newest K backups under the prefix")
    sp.add_argument("--broker-store", action="store_true", help="also copy the embedded broker's store (nats/); only for a stopped run")
    sp.add_argument("--endpoint-url", help="S3-compatible endpoint (default: $AWS_ENDPOINT_URL, else AWS)")
    sp.set_defaults(fn=cli_backup)

    sp = sub.add_parser("restore", help="bring a run back from a backup (then run it with --resume)")
    sp.add_argument("url", metavar="s3://BUCKET/PREFIX")
    sp.add_argument("run_dir", nargs="?", help="where to restore (a new or empty directory)")
    sp.add_argument("--backup", help="backup id (default: the newest complete one)")
    sp.add_argument("--list", action="store_true", help="list the complete backups and exit")
    sp.add_argument("--force", action="store_true", help="restore into a directory that is not empty")
    sp.add_argument("--endpoint-url", help="S3-compatible endpoint (default: $AWS_ENDPOINT_URL, else AWS)")
    sp.set_defaults(fn=cli_restore)


def cli_backup(args) -> int:
    try:
        manifest = backup(args.run_dir, args.to, keep=args.keep, configs=args.configs, broker_store=args.broker_store,
                          keep_backups=args.keep_backups, client=make_client(args.endpoint_url))
    except BackupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"backup {manifest['id']}: {len(manifest['files'])} files, checkpoints {', '.join(manifest['checkpoints']) or 'none'}")
    return 0


def cli_restore(args) -> int:
    client = make_client(args.endpoint_url)
    try:
        if args.list:
            bucket, prefix = parse_url(args.url)
            for backup_id in list_backups(client, bucket, prefix):
                print(backup_id)
            return 0
        if not args.run_dir:
            raise BackupError("RUN_DIR is required (or --list)")
        manifest = restore(args.url, args.run_dir, backup_id=args.backup, force=args.force, client=client)
    except BackupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"restored {manifest['id']} into {args.run_dir}: checkpoints {', '.join(manifest['checkpoints']) or 'none'}; "
          f"continue with --resume --run-dir {args.run_dir}")
    return 0
