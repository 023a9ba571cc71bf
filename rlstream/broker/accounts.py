"""The nats-server accounts and per-role permissions of one run (``deploy/nats/accounts.conf``).

    python -m rlstream.broker.accounts --run grpo-math > deploy/nats/accounts.conf

One account (``RLSTREAM``) holds one run, with JetStream limits (memory, storage, streams,
consumers), and one user per role. The run's KV bucket and weights object store live in a
second account (``STATE``) in which only the learner writes, as ``learner-state`` (its own
password; the run's components set ``nats.state_account: true``). The other roles read it
through read-only imports (stream info and message gets, under ``$JS.state.API``; the weights
objects for producers alone), write their
own heartbeat through one import each, and are told of the learner's writes to the keys
producers follow. NATS checks no permission on a reply subject, and JetStream publishes a
PubAck in the account of the stream that sent it: so a role that publishes with
``reply=$KV.<bucket>.policy.version`` has the PubAck land in the run's account, where no stream
captures it. Only other roles' heartbeats stay reachable that way (readers skip a malformed
one). Every permission names the run: its subjects, its streams, its KV keys,
its object store, and for each role its own durable consumer. Anything not listed is denied.

| role      | publishes         | creates (or updates)                                                  | pulls, acks, naks                 | KV keys it writes |
|-----------|-------------------|-----------------------------------------------------------------------|-----------------------------------|-------------------|
| feeder    | prompts           | -                                                                     | -                                 | heartbeat.feeder.* |
| producer  | rollouts, eval.rollouts | -                                                               | producers on RL_<run>_PROMPTS, eval-producers on RL_<run>_EVAL_PROMPTS | heartbeat.producer.* |
| scorer    | scored, eval.scored | -                                                                   | scorers on RL_<run>_ROLLOUTS, eval-scorers on RL_<run>_EVAL_ROLLOUTS | heartbeat.scorer.* |
| reference | reference         | -                                                                     | reference on RL_<run>_SCORED      | heartbeat.reference.* |
| teacher   | teacher           | -                                                                     | teacher on RL_<run>_SCORED or RL_<run>_REFERENCE | heartbeat.teacher.* |
| learner   | eval.prompts (and prompts, rendered with ``--curriculum``); as ``learner-state``: weights (objects) | the run's streams and durable consumers; as ``learner-state``: the KV bucket and object store | learner on the last link: RL_<run>_SCORED, RL_<run>_REFERENCE or RL_<run>_TEACHER; eval-learner on RL_<run>_EVAL_SCORED (and reads the eval-producers' and eval-scorers' consumer info) | as ``learner-state``: policy.version, weights.latest, pacing.admit, learner.step, heartbeat.learner.* |
| operator  | everything: status, tail, dashboard, replay, export/import, run.status, deleting streams                                            |

The annotating stages (``reference``, ``teacher``) are optional links between the scorers and
the learner (:mod:`rlstream.broker.layout`). One file serves every chain a run may configure:
each stage's durable consumer and the learner's are allowed on every stream that can precede
them, and the learner may lay out the annotated streams. A permission for a consumer the
learner did not lay out grants nothing: only the learner creates consumers.

Evaluation (``rl.<run>.eval.*``) has a stream per stage and a durable consumer per role, so a
role's credential reaches only its own link there too: the learner publishes eval prompts and
reads eval scores, producers pull eval prompts and publish eval rollouts, scorers pull eval
rollouts and publish eval scores.

Each component also publishes its own metrics (``rl.<run>.metrics.<role>.>``) and dead
letters (``rl.<run>.dlq.<role>``), reads the run's stream infos, KV keys and weights, and
receives replies only on its own inbox prefix ``_INBOX.<user>.`` (rlstream's client uses it,
see ``connect_options``), so no role reads another role's deliveries. Producers may also
subscribe to the learner's ``pacing.admit``, ``policy.version`` and ``weights.latest`` keys
(values every role reads anyway), so the learner's write wakes them instead of their next poll. Only the learner and
the operator create or update streams and consumers: a stream that re-publishes or sources
into the run's subjects, or a consumer that pushes its messages to another subject, is how a
component could otherwise write what its role may not. So components only bind to what the
learner laid out; each may pull from, ack and nak on its own durable consumer alone.

A run with ``data_source.curriculum`` has the learner draw the training prompts (it sees every
scored group, and its checkpoint holds the per-prompt state): render its accounts with
``--curriculum`` to let the learner publish ``rl.<run>.prompts`` too. Without the flag it may
not, so a run without a curriculum grants the learner nothing it does not use.

Passwords come from the environment of the nats-server process (a Kubernetes Secret):
nats-server reads an undefined ``$VARIABLE`` from the environment and refuses to start when
it is missing.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from itertools import combinations

from rlstream.broker.connection import STATE_API, state_user
from rlstream.broker.layout import ANNOTATORS, LEARNER_STEP, PACING_ADMIT, POLICY_VERSION, WEIGHTS_LATEST, Layout
from rlstream.broker.state import FOLLOWED_KEYS

ROLES = ("feeder", "producer", "scorer", *ANNOTATORS, "learner")
RECORDS = {"feeder": ("prompts",), "producer": ("rollouts", "eval.rollouts"), "scorer": ("scored", "eval.scored"),
           **{stage: (stage,) for stage in ANNOTATORS}, "learner": ("eval.prompts",)}
DURABLES = {"producer": (Layout.PRODUCERS, Layout.EVAL_PRODUCERS), "scorer": (Layout.SCORERS, Layout.EVAL_SCORERS),
            **{stage: (stage,) for stage in ANNOTATORS}, "learner": (Layout.LEARNER, Layout.EVAL_LEARNER)}
LEARNER_KEYS = (POLICY_VERSION, WEIGHTS_LATEST, PACING_ADMIT, LEARNER_STEP)
WEIGHTS_READERS = ("producer",)
"""The roles that read the policy's weights (the learner writes them, as ``learner-state``): the
annotating stages load fixed reference and teacher models, and nobody else needs them."""


@dataclass(frozen=True)
class AccountLimits:
    """JetStream limits of the run's account (nats-server units: ``1G``, ``200G``)."""

    max_mem: str = "1G"
    max_file: str = "200G"
    max_streams: int = 32
    """The run has 10 (5 record streams, 3 eval streams, the KV bucket, the object store), 12
    with both annotating stages; room for a second run in the same account."""
    max_consumers: int = 256
    """6 durables (8 with both annotating stages), plus what operators' tools open (tail,
    dashboard, status)."""


def streams(lay: Layout) -> list[str]:
    """Every JetStream stream of the run, KV bucket and object store included."""
    return [*lay.streams(), f"KV_{lay.state_bucket}", f"OBJ_{lay.weights_bucket}"]


def chains(run: str) -> list[Layout]:
    """The run's layout under every chain of annotating stages it may configure."""
    return [Layout(run, stages) for n in range(len(ANNOTATORS) + 1) for stages in combinations(ANNOTATORS, n)]


def durable_streams(run: str) -> dict[str, list[str]]:
    """durable consumer -> the streams it may be laid out on, over every chain (in order)."""
    out: dict[str, list[str]] = {}
    for lay in chains(run):
        for durable, (stream, _subject) in lay.consumers().items():
            if stream not in out.setdefault(durable, []):
                out[durable].append(stream)
    return out


def state_reads(run: str, api: str = "$JS.API", *, objects: bool = True) -> list[str]:
    """The read-only JetStream requests on the run's KV bucket and (``objects``) its weights
    object store, under ``api``."""
    lay = Layout(run)
    out = []
    for s in (f"KV_{lay.state_bucket}", *([f"OBJ_{lay.weights_bucket}"] if objects else [])):
        out += [f"{api}.STREAM.INFO.{s}", f"{api}.STREAM.MSG.GET.{s}", f"{api}.DIRECT.GET.{s}", f"{api}.DIRECT.GET.{s}.>"]
    return out


def heartbeats(role: str, run: str) -> str:
    return f"$KV.{Layout(run).state_bucket}.heartbeat.{role}.>"


def permissions(role: str, run: str, curriculum: bool = False) -> list[str]:
    """The subjects ``role`` may publish to in ``run``, in the run's account (``curriculum``:
    the learner draws the training prompts, so it publishes ``rl.<run>.prompts``). The KV
    bucket and object store are in the state account: read through its imports under
    :data:`STATE_API`, written by the learner alone (:func:`state_permissions`)."""
    lay = Layout(run, ANNOTATORS)  # every stream a run may have
    allow = [f"rl.{run}.{record}" for record in RECORDS.get(role, ())]
    if curriculum and role == "learner":
        allow.append(lay.prompts)
    allow += [f"rl.{run}.metrics.{role}.>", lay.dlq(role)]
    if role != "learner":  # the learner's own goes through its state account user
        allow.append(heartbeats(role, run))
    allow.append("$JS.API.INFO")
    allow += [f"$JS.API.STREAM.INFO.{s}" for s in lay.streams()]
    allow += state_reads(run, STATE_API, objects=role in WEIGHTS_READERS)
    for durable in DURABLES.get(role, ()):
        for stream in durable_streams(run)[durable]:
            allow += [f"$JS.API.CONSUMER.INFO.{stream}.{durable}", f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
                      f"$JS.ACK.{stream}.{durable}.>"]
    if role == "learner":
        # how far an eval round has got (it holds the next weights publish until its prompts are generated)
        allow += [f"$JS.API.CONSUMER.INFO.{lay.consumers()[d][0]}.{d}" for d in (Layout.EVAL_PRODUCERS, Layout.EVAL_SCORERS)]
        allow += [f"$JS.API.STREAM.{verb}.{s}" for s in lay.streams() for verb in ("CREATE", "UPDATE")]
        for name, on in durable_streams(run).items():
            for stream in on:
                allow += [f"$JS.API.CONSUMER.CREATE.{stream}.{name}", f"$JS.API.CONSUMER.CREATE.{stream}.{name}.>",
                          f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}"]
    return allow


def state_permissions(run: str) -> list[str]:
    """What the learner's user in the state account (``learner-state``) may publish: its keys
    (and its heartbeat), the weights objects, and laying out, reading and pruning both."""
    lay = Layout(run)
    kv, obj = f"KV_{lay.state_bucket}", f"OBJ_{lay.weights_bucket}"
    allow = [f"$KV.{lay.state_bucket}.{key}" for key in LEARNER_KEYS]
    allow += [heartbeats("learner", run), f"$O.{lay.weights_bucket}.>", "$JS.API.INFO", *state_reads(run)]
    allow += [f"$JS.API.STREAM.{verb}.{s}" for s in (kv, obj) for verb in ("CREATE", "UPDATE")]
    allow.append(f"$JS.API.STREAM.PURGE.{obj}")
    return allow


def state_exports(run: str) -> list[tuple[str, str, str | None]]:
    """(kind, subject in the state account, subject in the run's account) of each export: the
    reads (renamed under :data:`STATE_API`, so the run's own JetStream API does not answer
    them too), each other role's heartbeat, and the keys producers follow."""
    out: list[tuple[str, str, str | None]] = [("service", s, STATE_API + s[len("$JS.API"):]) for s in state_reads(run)]
    out += [("service", heartbeats(role, run), None) for role in ROLES if role != "learner"]
    out += [("stream", f"$KV.{Layout(run).state_bucket}.{key}", None) for key in FOLLOWED_KEYS]
    return out


def subscriptions(role: str, run: str) -> list[str]:
    """The subjects ``role`` may subscribe to in ``run``: its own reply inbox, and for
    producers the learner's keys they wait on (pacing room, new weights; values every role
    may read anyway), so a producer is woken by the learner's write rather than a poll."""
    allow = [f"_INBOX.{role}.>"]
    if role == "producer":
        allow += [f"$KV.{Layout(run).state_bucket}.{key}" for key in FOLLOWED_KEYS]
    return allow


def _user(role: str, run: str, curriculum: bool = False) -> str:
    subscribe = ", ".join(f'"{s}"' for s in subscriptions(role, run))
    lines = [
        "      {",
        f"        user: {role}",
        f"        password: $RLSTREAM_{role.upper()}_PASSWORD",
        "        permissions: {",
        "          publish: { allow: [",
    ]
    lines += [f'            "{s}"' for s in permissions(role, run, curriculum)]
    lines += [
        "          ] }",
        f"          subscribe: {{ allow: [{subscribe}] }}",
        "        }",
        "      }",
    ]
    return "\n".join(lines)


def render_accounts(run: str, limits: AccountLimits = AccountLimits(), curriculum: bool = False) -> str:
    """The text of ``accounts.conf`` for ``run`` (included by ``nats-server.conf``)."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run):
        raise ValueError(f"run id {run!r}: letters, digits, _ and - only")
    head = [
        f"# rlstream accounts and per-role permissions for the run {run!r}.",
        f"# Generated by `python -m rlstream.broker.accounts --run {run}`: edit that, not this file.",
        "# What each role may do: the table in rlstream/broker/accounts.py.",
        "",
        "accounts {",
        "  RLSTREAM {",
        "    jetstream {",
        f"      max_mem: {limits.max_mem}",
        f"      max_file: {limits.max_file}",
        f"      max_streams: {limits.max_streams}",
        f"      max_consumers: {limits.max_consumers}",
        "    }",
        "    users: [",
    ]
    users = [_user(role, run, curriculum) for role in ROLES]
    lay = Layout(run)
    # not even the operator makes the state's streams here: they would capture its subjects
    # in this account again, reply subjects included
    deny = f'"$JS.API.STREAM.CREATE.KV_{lay.state_bucket}", "$JS.API.STREAM.CREATE.OBJ_{lay.weights_bucket}"'
    users.append("\n".join([
        "      {",
        "        user: operator",
        "        password: $RLSTREAM_OPERATOR_PASSWORD",
        f'        permissions: {{ publish: {{ allow: [">"], deny: [{deny}] }}, subscribe: {{ allow: [">"] }} }}',
        "      }",
    ]))
    bucket = Layout(run).weights_bucket
    imports = []
    for kind, subject, local in state_exports(run):
        to = f', to: "{local}"' if local else ""
        imports.append(f'      {{ {kind}: {{ account: STATE, subject: "{subject}" }}{to} }}')
    exports = []
    for kind, subject, _local in state_exports(run):
        # a batched direct get answers with many messages (the object reader's chunks)
        many = ", response_type: stream" if kind == "service" and f"DIRECT.GET.OBJ_{bucket}" in subject else ""
        exports.append(f'      {{ {kind}: "{subject}", accounts: [RLSTREAM]{many} }}')
    learner_state = ", ".join(f'"{s}"' for s in state_permissions(run))
    tail = [
        "    ]",
        "    # the run's KV bucket and weights object store are in STATE: read through these",
        "    imports: [",
        *imports,
        "    ]",
        "  }",
        "  # Only the learner writes here (a PubAck lands in the account of the stream that sent it,",
        "  # so no reply subject of another role reaches this account's streams).",
        "  STATE {",
        "    jetstream {",
        f"      max_mem: {limits.max_mem}",
        f"      max_file: {limits.max_file}",
        "      max_streams: 4",
        "      max_consumers: 16",
        "    }",
        "    users: [",
        "      {",
        f"        user: {state_user('learner')}",
        "        password: $RLSTREAM_LEARNER_PASSWORD",
        "        permissions: {",
        f"          publish: {{ allow: [{learner_state}] }}",
        f'          subscribe: {{ allow: ["_INBOX.{state_user("learner")}.>"] }}',
        "        }",
        "      }",
        "      {",
        f"        user: {state_user('operator')}",
        "        password: $RLSTREAM_OPERATOR_PASSWORD",
        '        permissions: { publish: { allow: [">"] }, subscribe: { allow: [">"] } }',
        "      }",
        "    ]",
        "    exports: [",
        *exports,
        "    ]",
        "  }",
        "  SYS {",
        "    users: [",
        "      { user: sys, password: $RLSTREAM_SYS_PASSWORD }",
        "    ]",
        "  }",
        "}",
        "system_account: SYS",
    ]
    return "\n".join(head + users + tail) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlstream.broker.accounts", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="the run id (config `run`)")
    d = AccountLimits()
    p.add_argument("--max-mem", default=d.max_mem)
    p.add_argument("--max-file", default=d.max_file)
    p.add_argument("--max-streams", type=int, default=d.max_streams)
    p.add_argument("--max-consumers", type=int, default=d.max_consumers)
    p.add_argument("--curriculum", action="store_true", help="the run has data_source.curriculum: its learner publishes the prompts")
    args = p.parse_args(argv)
    limits = AccountLimits(args.max_mem, args.max_file, args.max_streams, args.max_consumers)
    sys.stdout.write(render_accounts(args.run, limits, curriculum=args.curriculum))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
