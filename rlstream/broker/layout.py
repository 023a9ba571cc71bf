"""Every subject, stream, consumer, KV bucket and object store of a run, spelled once.

| subject                          | stream             | record            | producer   | consumer (durable)    | ack policy |
|----------------------------------|--------------------|-------------------|------------|-----------------------|------------|
| rl.<run>.prompts                 | RL_<run>_PROMPTS   | Prompt            | feeder     | producers (work queue)| explicit, after the rollout publish is acked |
| rl.<run>.rollouts                | RL_<run>_ROLLOUTS  | RolloutGroup      | producers  | scorers               | explicit, after the scored publish is acked |
| rl.<run>.scored                  | RL_<run>_SCORED    | ScoredGroup       | scorers    | learner (or the first annotating stage) | explicit, after the checkpoint holding it is durable |
| rl.<run>.reference               | RL_<run>_REFERENCE | ScoredGroup + ref_logprobs | reference stage | learner (or the teacher stage) | explicit, after the annotated publish is acked (stage); after the checkpoint (learner) |
| rl.<run>.teacher                 | RL_<run>_TEACHER   | ScoredGroup + teacher_logprobs | teacher stage | learner | explicit, after the checkpoint holding it is durable |
| rl.<run>.metrics.<comp>.<id>     | RL_<run>_METRICS   | MetricEvent       | everyone   | tail, status, dashboard | none (read from a time) |
| rl.<run>.dlq.<stage>             | RL_<run>_DLQ       | DeadLetter        | any stage  | operators             | none |
| rl.<run>.eval.prompts            | RL_<run>_EVAL_PROMPTS  | Prompt (pinned policy_version) | learner | producers (``eval-producers``, work queue), ahead of training prompts | explicit, after the rollout publish is acked |
| rl.<run>.eval.rollouts           | RL_<run>_EVAL_ROLLOUTS | RolloutGroup      | producers  | scorers (``eval-scorers``) | explicit, after the scored publish is acked |
| rl.<run>.eval.scored             | RL_<run>_EVAL_SCORED   | ScoredGroup       | scorers    | learner's evaluation (``eval-learner``), never trained | explicit, on receipt |
| KV rl_<run>_state                | KV_rl_<run>_state  | policy.version, learner.step, pacing.admit, heartbeat.<comp>.<id> |
| objects rl_<run>_weights         | OBJ_rl_<run>_weights | safetensors of policy version N |

With ``data_source.curriculum`` the learner publishes the training prompts instead of the
feeder (it draws them by the per-prompt state it keeps from the scored groups).

Evaluation has streams of its own (one per stage, as training: a record keeps its id from
stage to stage, and JetStream de-duplicates message ids per stream), so nothing from it
reaches the training subjects (the learner's consumer reads the last link of the chain only) or
the pacing bound (the producers count
``RL_<run>_ROLLOUTS``).

Annotating stages (``Layout.stages``, from ``Config.annotators``) form a chain between the
scorers and the learner, in the order of :data:`ANNOTATORS`: each stage has a durable consumer
named after it on the previous stage's subject and publishes to its own subject; the learner
reads the last subject of the chain (``rl.<run>.scored`` when there is no stage). Every link is
a limits-retention stream, so each is replayable.

Creating the layout twice is harmless: streams and consumers are created or updated.
On a server with per-role permissions (deploy/nats/accounts.conf) the learner (or the
operator) creates the layout; every other component waits for it (:func:`bind_layout`) and
creates or updates only its own durable consumer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

from rlstream.broker.errors import BrokerError
from rlstream.config import NatsConfig

log = logging.getLogger(__name__)

DAY_S = 86400.0
PUBLISH_RETRY_S = 300.0
"""How long a :class:`~rlstream.broker.io.Publisher` re-sends an unacknowledged publish."""
PUBLISH_ACK_TIMEOUT_S = 10.0
"""How long it waits for the acks of one attempt."""
PUBLISH_MAX_BACKOFF_S = 5.0
"""The longest pause between two attempts."""
SHUTDOWN_RETRY_S = 5.0
"""How long it keeps re-sending once its component was told to stop and the broker is away."""
DUPLICATE_WINDOW_S = PUBLISH_RETRY_S + PUBLISH_MAX_BACKOFF_S + PUBLISH_ACK_TIMEOUT_S + 15.0
"""JetStream's de-duplication window of every stream. A retry goes out at most
``PUBLISH_RETRY_S + PUBLISH_MAX_BACKOFF_S`` after the first attempt (the deadline is checked
before the last pause) and is stored within its ack timeout, so the window covers every
retry of a message id, with a margin for clock steps between the attempts' stores."""


ANNOTATORS = ("reference", "teacher")
"""The annotating stages, in chain order."""


@dataclass(frozen=True)
class Layout:
    run: str
    stages: tuple[str, ...] = ()
    """Annotating stages of this run (a subsequence of :data:`ANNOTATORS`)."""

    def __post_init__(self):
        unknown = [s for s in self.stages if s not in ANNOTATORS]
        if unknown or list(self.stages) != [s for s in ANNOTATORS if s in self.stages]:
            raise ValueError(f"stages {self.stages!r} must be a subsequence of {ANNOTATORS}")

    def annotated(self, stage: str) -> str:
        """The subject a stage publishes its annotated groups to."""
        return f"rl.{self.run}.{stage}"

    def annotated_stream(self, stage: str) -> str:
        return f"RL_{self.run}_{stage.upper()}"

    def stage_input(self, stage: str) -> tuple[str, str]:
        """(stream, subject) a stage, or the learner (``"learner"``), consumes."""
        chain = [*self.stages, self.LEARNER]
        i = chain.index(stage)
        if i == 0:
            return self.scored_stream, self.scored
        return self.annotated_stream(chain[i - 1]), self.annotated(chain[i - 1])

    @property
    def learner_input(self) -> tuple[str, str]:
        """(stream, subject) the learner trains from: the last link of the chain."""
        return self.stage_input(self.LEARNER)

    # subjects
    @property
    def prompts(self) -> str:
        return f"rl.{self.run}.prompts"

    @property
    def rollouts(self) -> str:
        return f"rl.{self.run}.rollouts"

    @property
    def scored(self) -> str:
        return f"rl.{self.run}.scored"

    @property
    def eval_prompts(self) -> str:
        return f"rl.{self.run}.eval.prompts"

    @property
    def eval_rollouts(self) -> str:
        return f"rl.{self.run}.eval.rollouts"

    @property
    def eval_scored(self) -> str:
        return f"rl.{self.run}.eval.scored"

    def metrics(self, component: str = "*", component_id: str = "*") -> str:
        return f"rl.{self.run}.metrics.{component}.{component_id}"

    @property
    def metrics_all(self) -> str:
        return f"rl.{self.run}.metrics.>"

    def dlq(self, stage: str = "*") -> str:
        return f"rl.{self.run}.dlq.{stage}"

    # streams
    @property
    def prompts_stream(self) -> str:
        return f"RL_{self.run}_PROMPTS"

    @property
    def rollouts_stream(self) -> str:
        return f"RL_{self.run}_ROLLOUTS"

    @property
    def scored_stream(self) -> str:
        return f"RL_{self.run}_SCORED"

    @property
    def metrics_stream(self) -> str:
        return f"RL_{self.run}_METRICS"

    @property
    def dlq_stream(self) -> str:
        return f"RL_{self.run}_DLQ"

    @property
    def eval_prompts_stream(self) -> str:
        return f"RL_{self.run}_EVAL_PROMPTS"

    @property
    def eval_rollouts_stream(self) -> str:
        return f"RL_{self.run}_EVAL_ROLLOUTS"

    @property
    def eval_scored_stream(self) -> str:
        return f"RL_{self.run}_EVAL_SCORED"

    # durable consumers
    PRODUCERS = "producers"
    SCORERS = "scorers"
    LEARNER = "learner"
    EVAL_PRODUCERS = "eval-producers"
    EVAL_SCORERS = "eval-scorers"
    EVAL_LEARNER = "eval-learner"

    # KV and object store
    @property
    def state_bucket(self) -> str:
        return f"rl_{self.run}_state"

    @property
    def weights_bucket(self) -> str:
        return f"rl_{self.run}_weights"

    def streams(self) -> dict[str, str]:
        """stream name -> subject filter, for status and export."""
        return {
            self.prompts_stream: self.prompts,
            self.rollouts_stream: self.rollouts,
            self.scored_stream: self.scored,
            **{self.annotated_stream(st): self.annotated(st) for st in self.stages},
            self.metrics_stream: self.metrics_all,
            self.dlq_stream: f"rl.{self.run}.dlq.>",
            self.eval_prompts_stream: self.eval_prompts,
            self.eval_rollouts_stream: self.eval_rollouts,
            self.eval_scored_stream: self.eval_scored,
        }

    def consumers(self) -> dict[str, tuple[str, str]]:
        """durable name -> (stream, subject)."""
        return {
            self.PRODUCERS: (self.prompts_stream, self.prompts),
            self.SCORERS: (self.rollouts_stream, self.rollouts),
            **{st: self.stage_input(st) for st in self.stages},
            self.LEARNER: self.learner_input,
            self.EVAL_PRODUCERS: (self.eval_prompts_stream, self.eval_prompts),
            self.EVAL_SCORERS: (self.eval_rollouts_stream, self.eval_rollouts),
            self.EVAL_LEARNER: (self.eval_scored_stream, self.eval_scored),
        }


# KV keys
ORIGIN_HEADER = "Rlstream-Origin"
"""Set by the run's producers and scorers on what they publish (``producer/<id>``,
``scorer/<id>``), so the run's accounting can tell its own records from foreign ones."""

POLICY_VERSION = "policy.version"
LEARNER_STEP = "learner.step"
PACING_ADMIT = "pacing.admit"
WEIGHTS_LATEST = "weights.latest"
RUN_STATUS = "run.status"


def heartbeat_key(component: str, component_id: str) -> str:
    return f"heartbeat.{component}.{component_id}"


async def _ensure_stream(js: JetStreamContext, cfg: StreamConfig) -> None:
    try:
        await js.add_stream(cfg)
    except BadRequestError as exc:
        # Exists with a different config: bring it to ours (what can be updated).
        if getattr(exc, "err_code", None) in (10058, 10065) or "already in use" in str(exc):
            await js.update_stream(cfg)
        else:
            raise


def _consumer_config(durable: str, subject: str, ack_wait_s: float) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        filter_subject=subject,
        ack_wait=ack_wait_s,
        # No server limit: we count deliveries ourselves and dead-letter at
        # nats.max_deliver, so a record is never silently parked by the server.
        max_deliver=-1,
        max_ack_pending=-1,
        max_waiting=512,
    )


async def ensure_consumer(js: JetStreamContext, lay: Layout, durable: str, nats_cfg: NatsConfig | None = None, *, ack_wait_s: float | None = None) -> None:
    """Create (or update) one durable pull consumer of the run."""
    cfg = nats_cfg or NatsConfig()
    stream, subject = lay.consumers()[durable]
    await js.add_consumer(stream, _consumer_config(durable, subject, ack_wait_s or cfg.ack_wait_s))


async def ensure_layout(
    js: JetStreamContext, run: str, nats_cfg: NatsConfig | None = None, *,
    ack_wait_s: float | None = None, durables: tuple[str, ...] | None = None, stages: tuple[str, ...] = (),
    state_js: JetStreamContext | None = None,
) -> Layout:
    """Create (or update) the run's streams (with those of the annotating ``stages``), KV
    bucket, object store and the durable consumers ``durables`` (default: all of them).

    On a server with per-role permissions (deploy/nats/accounts.conf) only the learner and
    the operator may do this. With ``nats.state_account`` the KV bucket and object store are
    made in the state account, through ``state_js`` (the learner's second connection,
    :func:`rlstream.broker.connection.connect_state`); without it they are left to the learner.
    """
    cfg = nats_cfg or NatsConfig()
    lay = Layout(run, tuple(stages))
    replicas = cfg.replicas
    retention_s = cfg.retention_days * DAY_S
    max_msg = cfg.max_payload_mb * 1024 * 1024
    # JetStream refuses a de-duplication window longer than a stream's max age.
    common = dict(storage=StorageType.FILE, num_replicas=replicas, duplicate_window=min(DUPLICATE_WINDOW_S, retention_s), max_msg_size=max_msg)
    await _ensure_stream(js, StreamConfig(name=lay.prompts_stream, subjects=[lay.prompts], retention=RetentionPolicy.WORK_QUEUE, **common))
    replayable = [(lay.rollouts_stream, lay.rollouts), (lay.scored_stream, lay.scored),
                  *((lay.annotated_stream(st), lay.annotated(st)) for st in lay.stages)]
    for name, subject in replayable:
        await _ensure_stream(js, StreamConfig(name=name, subjects=[subject], retention=RetentionPolicy.LIMITS, max_age=retention_s, **common))
    await _ensure_stream(js, StreamConfig(
        name=lay.metrics_stream, subjects=[lay.metrics_all], retention=RetentionPolicy.LIMITS,
        max_age=retention_s, discard=DiscardPolicy.OLD, **common))
    await _ensure_stream(js, StreamConfig(
        name=lay.dlq_stream, subjects=[f"rl.{run}.dlq.>"], retention=RetentionPolicy.LIMITS, max_age=retention_s * 4, **common))
    # evaluation: a work queue of prompts, then rollouts and scored groups kept like training's
    await _ensure_stream(js, StreamConfig(name=lay.eval_prompts_stream, subjects=[lay.eval_prompts], retention=RetentionPolicy.WORK_QUEUE, **common))
    for name, subject in ((lay.eval_rollouts_stream, lay.eval_rollouts), (lay.eval_scored_stream, lay.eval_scored)):
        await _ensure_stream(js, StreamConfig(name=name, subjects=[subject], retention=RetentionPolicy.LIMITS, max_age=retention_s, **common))
    for durable in (lay.consumers() if durables is None else durables):
        await ensure_consumer(js, lay, durable, cfg, ack_wait_s=ack_wait_s)
    if not cfg.state_account:
        await _ensure_state(js, lay, replicas)
    elif state_js is not None:
        await _ensure_state(state_js, lay, replicas)
    return lay


async def _ensure_state(js: JetStreamContext, lay: Layout, replicas: int) -> None:
    """The run's KV bucket and weights object store."""
    try:
        await js.key_value(lay.state_bucket)
    except NotFoundError:
        await js.create_key_value(KeyValueConfig(bucket=lay.state_bucket, history=1, storage=StorageType.FILE, replicas=replicas))
    try:
        await js.object_store(lay.weights_bucket)
    except NotFoundError:
        await js.create_object_store(lay.weights_bucket, config=ObjectStoreConfig(storage=StorageType.FILE, replicas=replicas))


async def bind_layout(
    js: JetStreamContext, run: str, nats_cfg: NatsConfig | None = None, *,
    durable: str | None, wait_s: float | None = None, stages: tuple[str, ...] = (),
    state_js: JetStreamContext | None = None,
) -> Layout:
    """Wait until the run's layout exists (the learner or the operator creates it),
    including this role's own durable consumer ``durable`` (None: the feeder has none).
    Nothing is created or changed. ``state_js``: where the KV bucket and object store are
    (:func:`rlstream.broker.connection.connect_state`; default ``js``).

    Raises :class:`BrokerError` naming what is missing after ``wait_s`` (default
    ``nats.layout_wait_s``).
    """
    cfg = nats_cfg or NatsConfig()
    lay = Layout(run, tuple(stages))
    wait = cfg.layout_wait_s if wait_s is None else wait_s
    deadline = time.monotonic() + wait
    delay = 0.2
    logged = 0.0
    while True:
        missing = await _missing(js, lay, durable, state_js or js)
        if not missing:
            break
        now = time.monotonic()
        if now > deadline:
            raise BrokerError(f"run {run!r}: the run's layout is not there after {wait:.0f}s (missing {missing}); "
                              "the learner lays it out at start (or the operator, or `rlstream run`)")
        if now - logged > 10:
            log.info("run %s: waiting for the learner to lay out the run (missing %s)", run, missing)
            logged = now
        await asyncio.sleep(min(delay, max(0.0, deadline - now)))
        delay = min(delay * 2, 2.0)
    return lay


async def _missing(js: JetStreamContext, lay: Layout, durable: str | None, state_js: JetStreamContext) -> str | None:
    """The first part of the run's layout that does not exist yet, or None."""
    # (the object store is made with the KV bucket; only producers may look at it)
    for name, where in (*((n, js) for n in lay.streams()), (f"KV_{lay.state_bucket}", state_js)):
        try:
            await where.stream_info(name)
        except NotFoundError:
            return name
    if durable is not None:
        stream = lay.consumers()[durable][0]
        try:
            await js.consumer_info(stream, durable)
        except NotFoundError:
            return f"consumer {durable} on {stream}"
    return None
