"""The records that cross the broker.

Each record is one msgspec struct (:class:`~rlstream.schemas.codec.Record`): its fields,
in wire order, are the whole definition. ``encode()`` gives MessagePack bytes;
``decode(data)`` checks every field and raises :class:`RecordError` naming the first bad
one; ``validate()`` checks a record built in memory by the same rules; a record's own
rules are its ``check()``. Records evolve append-only: a new version only adds fields at
the end, with defaults, so older payloads still decode, and a newer payload (a minor
version this build does not know yet) decodes too, without the fields it appended: during a
rolling upgrade, new producers feed old scorers. Only a newer major version (``v`` of
``MAJOR_STEP`` or more; none exists yet) is refused. An appended array is left off the
wire while it is empty, and a field whose default is None while it is None: a record that
does not use a newer feature costs nothing to send or decode for it. The version history
of each record is in its docstring.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import uuid
from collections.abc import Iterable
from typing import Any, ClassVar, NamedTuple

import msgspec
import numpy as np

from rlstream.schemas.codec import (
    DEFAULT_LIMITS,
    FLOAT32,
    INT32,
    MAX_NAMES,
    UINT8,
    Columns,
    Counts,
    Floats,
    Limits,
    LogProbs,
    Mask,
    MaybeFloats,
    Record,
    RecordError,
    TokenIds,
    capped,
    decode_tagged,
    decoder_for,
    empty_array,
    plan_of,
)

FINISH_REASONS = ("stop", "length", "abort")
_FINISH_SET = frozenset(FINISH_REASONS)


def new_id() -> str:
    return uuid.uuid4().hex


def _min(value: int, lo: int, name: str) -> None:
    if value < lo:
        raise RecordError(name, f"{value} is below the minimum {lo}")


def _not_empty(arr: np.ndarray, name: str) -> None:
    if arr.size == 0:
        raise RecordError(name, "is empty")


class Prompt(Record, tag="prompt", kw_only=True):
    """One prompt of the dataset, on ``rl.<run>.prompts``.

    v1: id, run, ts, text, prompt_ids, columns, epoch, index. v2: + messages (chat turns).
    v3: + policy_version: an evaluation prompt (``rl.<run>.eval.prompts``) is pinned to the
    policy version it evaluates; -1 (training prompts) is any version.
    ``prompt_ids`` may be empty: the producer then tokenises ``text`` (or ``messages``
    with the model's chat template).
    """

    SCHEMA: ClassVar[str] = "prompt"
    VERSION: ClassVar[int] = 3

    v: int = VERSION
    text: str
    prompt_ids: TokenIds = msgspec.field(default_factory=lambda: np.zeros(0, INT32))
    columns: Columns = msgspec.field(default_factory=dict)
    epoch: int = 0
    index: int = 0
    messages: capped(list[capped(dict[str, str], 4)], 4096) | None = None  # v2
    policy_version: int = -1  # v3

    def check(self, limits: Limits, path: str) -> None:
        _min(self.epoch, 0, f"{path}epoch")
        _min(self.policy_version, -1, f"{path}policy_version")
        _min(self.index, 0, f"{path}index")
        for i, m in enumerate(self.messages or ()):
            if not ("role" in m and "content" in m):
                raise RecordError(f"{path}messages[{i}]", "expected {role: str, content: str}")


class Sample(NamedTuple):
    """One completion of a group: token ids, the behaviour policy's log-prob of each, why it
    ended, its text. A view: the arrays are slices of the group's flat arrays."""

    completion_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str = "stop"
    text: str = ""
    versions: np.ndarray | None = None
    """[T] int: the policy version that sampled each token; None = all at the group's
    ``policy_version`` (weights updated in flight change it mid-sample)."""


class RolloutGroup(Record, tag="rollout_group", kw_only=True):
    """``group_size`` completions of one prompt, on ``rl.<run>.rollouts``.

    The samples are flat, in memory as on the wire: ``lengths`` [G], ``completion_ids``
    and ``logprobs`` [sum(lengths)], ``finish_reasons`` and ``texts`` [G]. Build a group
    from per-sample arrays with :meth:`from_samples`; read them back with ``samples``.
    v1: up to ``texts``. v2: + timings (seconds per phase, e.g. ``generate``).
    v3: + prompt_messages (the prompt's chat turns when it was conversational; reward
    functions get them as TRL's ``prompts``).
    v4: multi-turn episodes (all empty for a single completion). A sample's completion is
    then its turns back to back: model turns (the sampled ids, as sampled) and environment
    turns (the chat template's rendering of what the environment said, log-prob 0.0):

    - ``loss_mask`` [sum(lengths)] uint8, flat like ``completion_ids``: 1 on model tokens,
      0 on environment tokens; empty = every token is the model's.
    - ``turn_counts`` [G] turns of each sample, ``turn_ends`` [sum(turn_counts)] the end of
      each turn, as an offset into its sample's completion (the last is the sample's length).
      Turns alternate, model first: turn 0, 2, 4... are the model's, 1, 3... the environment's.
    - ``turn_rewards`` [sum(turn_counts)] the reward the environment gave for each model turn
      (0 where it gave none, and on environment turns); empty when none was recorded.
    - ``env_rewards`` [G] each episode's reward (0 for an episode cut at ``max_turns`` or
      aborted); the ``env`` reward rule reads it.
    - ``episode_messages`` [G] each episode's conversation after the prompt, as chat turns
      (the model's turns as ``assistant``, the environment's as ``user``/``tool``, including
      any it sent with the end), for reward functions, tail and the dashboard.
    For an episode, ``texts`` hold the last model turn (what text rules score).
    v5: + the policy version of every completion token, run-length encoded (weights updated
    in flight switch versions inside a sample): ``version_runs`` [G] runs per sample,
    ``run_lengths`` and ``run_versions`` [sum(version_runs)], in sample order. Empty = every
    token at ``policy_version``. With runs, ``policy_version`` is the oldest token's version.
    """

    SCHEMA: ClassVar[str] = "rollout_group"
    VERSION: ClassVar[int] = 5

    v: int = VERSION
    prompt_id: str
    prompt_text: str = ""
    prompt_ids: TokenIds
    policy_version: int
    producer_id: str = ""
    columns: Columns = msgspec.field(default_factory=dict)
    sampling: Columns = msgspec.field(default_factory=dict)
    lengths: Counts
    completion_ids: TokenIds
    logprobs: LogProbs
    finish_reasons: capped(list[str])
    texts: capped(list[str])
    timings: capped(dict[str, float], MAX_NAMES) = msgspec.field(default_factory=dict)  # v2
    prompt_messages: capped(list[capped(dict[str, str], 4)], 4096) | None = None  # v3
    loss_mask: Mask = msgspec.field(default_factory=lambda: np.zeros(0, UINT8))  # v4
    turn_counts: Counts = msgspec.field(default_factory=lambda: np.zeros(0, INT32))  # v4
    turn_ends: Counts = msgspec.field(default_factory=lambda: np.zeros(0, INT32))  # v4
    turn_rewards: Floats = msgspec.field(default_factory=lambda: np.zeros(0, FLOAT32))  # v4
    env_rewards: Floats = msgspec.field(default_factory=lambda: np.zeros(0, FLOAT32))  # v4
    episode_messages: capped(list[capped(list[capped(dict[str, str], 8)], 4096)]) | None = None  # v4
    version_runs: Counts = msgspec.field(default_factory=lambda: np.zeros(0, INT32))  # v5
    run_lengths: Counts = msgspec.field(default_factory=lambda: np.zeros(0, INT32))  # v5
    run_versions: Counts = msgspec.field(default_factory=lambda: np.zeros(0, INT32))  # v5

    @classmethod
    def from_samples(cls, samples: Iterable[Sample], **fields: Any) -> "RolloutGroup":
        """A group from per-sample arrays; ``fields`` are the other fields. Samples with
        per-token ``versions`` are run-length encoded, and ``policy_version`` becomes the
        oldest token's version (the given one stands for samples without versions)."""
        samples = list(samples)
        ids = [np.asarray(s.completion_ids, INT32) for s in samples]
        lps = [np.asarray(s.logprobs, FLOAT32) for s in samples]
        if any(s.versions is not None for s in samples):
            base = int(fields.get("policy_version", 0))
            per = [np.full(len(a), base, np.int64) if s.versions is None else np.asarray(s.versions, np.int64)
                   for s, a in zip(samples, ids)]
            runs = [version_runs(v) for v in per]
            tokens = np.concatenate(per) if per else np.zeros(0, np.int64)
            fields["policy_version"] = int(tokens.min()) if tokens.size else base
            if tokens.size and (tokens != fields["policy_version"]).any():
                fields["version_runs"] = np.fromiter((len(r[0]) for r in runs), dtype=INT32, count=len(runs))
                fields["run_lengths"] = np.concatenate([r[0] for r in runs]).astype(INT32)
                fields["run_versions"] = np.concatenate([r[1] for r in runs]).astype(INT32)
        return cls(
            lengths=np.fromiter((len(a) for a in ids), dtype=INT32, count=len(ids)),
            completion_ids=np.concatenate(ids) if ids else np.zeros(0, INT32),
            logprobs=np.concatenate(lps) if lps else np.zeros(0, FLOAT32),
            finish_reasons=[s.finish_reason for s in samples], texts=[s.text for s in samples], **fields,
        )

    def token_versions(self) -> np.ndarray:
        """The policy version of every completion token, [sum(lengths)] int64, in flat order."""
        if not len(self.version_runs):
            return np.full(len(self.completion_ids), self.policy_version, np.int64)
        return np.repeat(self.run_versions.astype(np.int64), self.run_lengths)

    def newest_version(self) -> int:
        """The newest version that sampled any token (``policy_version`` without runs)."""
        return int(self.run_versions.max()) if len(self.run_versions) else self.policy_version

    def with_samples(self, samples: Iterable[Sample], **changes: Any) -> "RolloutGroup":
        """A copy of this group holding ``samples`` instead, with ``changes`` to its other fields."""
        fields = {f: getattr(self, f) for f in self.__struct_fields__ if f not in _SAMPLE_FIELDS}
        return RolloutGroup.from_samples(samples, **{**fields, **changes})

    @property
    def group_size(self) -> int:
        return len(self.lengths)

    @property
    def is_episode(self) -> bool:
        """True for a group of multi-turn episodes (v4 turn fields present)."""
        return len(self.turn_counts) > 0

    def _split(self, flat: np.ndarray, counts: list[int]) -> list[np.ndarray]:
        ends = list(itertools.accumulate(counts))
        return [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]

    def sample_masks(self) -> list[np.ndarray]:
        """Per sample, its loss mask (uint8 [length]; all ones when the record has none)."""
        lengths = self.lengths.tolist()
        if len(self.loss_mask) == 0:
            return [np.ones(n, UINT8) for n in lengths]
        return self._split(self.loss_mask, lengths)

    def sample_turns(self) -> list[list[tuple[int, int, bool]]]:
        """Per sample, its turns as ``(start, end, is_model)`` offsets into its completion
        (one model turn spanning the completion for a single-turn group)."""
        if not self.is_episode:
            return [[(0, n, True)] for n in self.lengths.tolist()]
        out = []
        for ends in self._split(self.turn_ends, self.turn_counts.tolist()):
            starts = [0, *ends.tolist()[:-1]]
            out.append([(a, b, i % 2 == 0) for i, (a, b) in enumerate(zip(starts, ends.tolist()))])
        return out

    def episode_turns(self) -> list[list[dict[str, Any]]]:
        """Per sample, its turns for people to read: ``{"kind": "model" | "env", "tokens": n,
        "text": ...}``, the model's turn as it said it, the environment's as ``role: content``
        lines. Messages the environment sent with the end have a turn of 0 tokens. A single
        completion is one model turn."""
        spans_all = self.sample_turns()
        convs = self.episode_messages or [None] * len(spans_all)
        out = []
        for spans, text, conv in zip(spans_all, self.texts, convs):
            if conv is None:
                out.append([{"kind": "model" if m else "env", "tokens": b - a, "text": text if m else ""} for a, b, m in spans])
                continue
            turns, k = [], 0
            for a, b, is_model in spans:
                taken = []
                if is_model and k < len(conv) and conv[k]["role"] == "assistant":
                    taken, k = [conv[k]], k + 1
                while not is_model and k < len(conv) and conv[k]["role"] != "assistant":
                    taken.append(conv[k])
                    k += 1
                turns.append(_turn("model" if is_model else "env", b - a, taken))
            if k < len(conv):
                turns.append(_turn("env", 0, conv[k:]))
            out.append(turns)
        return out

    def sample_turn_rewards(self) -> list[np.ndarray] | None:
        """Per sample, the reward of each turn ([turn_counts[i]]); None when none was recorded."""
        if not self.is_episode or len(self.turn_rewards) == 0:
            return None
        return self._split(self.turn_rewards, self.turn_counts.tolist())

    def num_tokens(self) -> int:
        return len(self.completion_ids)

    @property
    def samples(self) -> list[Sample]:
        """Per-sample views on the flat arrays (built on each access: keep the list if you reuse it)."""
        ends = list(itertools.accumulate(self.lengths.tolist()))
        ids, lps = self.completion_ids, self.logprobs
        versions = self.token_versions() if len(self.version_runs) else None
        return [Sample(ids[a:b], lps[a:b], r, t, None if versions is None else versions[a:b])
                for a, b, r, t in zip([0, *ends[:-1]], ends, self.finish_reasons, self.texts)]

    def check(self, limits: Limits, path: str) -> None:
        g = len(self.lengths)
        if g == 0:
            raise RecordError(f"{path}lengths", "a group needs at least one sample")
        if g > limits.max_samples:
            raise RecordError(f"{path}lengths", f"{g} samples exceeds the limit of {limits.max_samples}")
        lengths = self.lengths.tolist()  # G is small: Python's min and sum beat numpy's call overhead
        if min(lengths) < 0:
            raise RecordError(f"{path}lengths", "negative length")
        total = sum(lengths)
        if len(self.completion_ids) != total or len(self.logprobs) != total:
            name = "completion_ids" if len(self.completion_ids) != total else "logprobs"
            raise RecordError(f"{path}{name}", f"has {len(getattr(self, name))} elements, expected {total}")
        for i, m in enumerate(self.prompt_messages or ()):
            if not ("role" in m and "content" in m):
                raise RecordError(f"{path}prompt_messages[{i}]", "expected {role: str, content: str}")
        reasons = self.finish_reasons
        if len(reasons) != g:
            raise RecordError(f"{path}finish_reasons", f"has {len(reasons)} entries, expected {g}")
        if not _FINISH_SET.issuperset(reasons):
            i = next(i for i, r in enumerate(reasons) if r not in _FINISH_SET)
            raise RecordError(f"{path}finish_reasons[{i}]", f"{reasons[i]!r} is not one of {FINISH_REASONS}")
        if len(self.texts) != g:
            raise RecordError(f"{path}texts", f"has {len(self.texts)} entries, expected {g}")
        _min(self.policy_version, 0, f"{path}policy_version")
        self._check_episode(lengths, total, path)
        self._check_version_runs(lengths, path)

    def _check_episode(self, lengths: list[int], total: int, path: str) -> None:  # noqa: C901
        """The v4 fields: each empty, or of the length its docstring gives."""
        g = len(lengths)
        if len(self.loss_mask) not in (0, total):
            raise RecordError(f"{path}loss_mask", f"has {len(self.loss_mask)} elements, expected 0 or {total}")
        for name, n in (("turn_counts", g), ("env_rewards", g)):
            if len(getattr(self, name)) not in (0, n):
                raise RecordError(f"{path}{name}", f"has {len(getattr(self, name))} elements, expected 0 or {n}")
        if self.episode_messages is not None:
            if len(self.episode_messages) != g:
                raise RecordError(f"{path}episode_messages", f"has {len(self.episode_messages)} entries, expected {g}")
            for i, conv in enumerate(self.episode_messages):
                for j, m in enumerate(conv):
                    if not ("role" in m and "content" in m):
                        raise RecordError(f"{path}episode_messages[{i}][{j}]", "expected {role: str, content: str}")
        counts = self.turn_counts.tolist()
        if not counts:
            if len(self.turn_ends) or len(self.turn_rewards):
                raise RecordError(f"{path}turn_ends", "turn ends without turn_counts")
            return
        if min(counts) < 1:
            raise RecordError(f"{path}turn_counts", "a sample needs at least one turn")
        if len(self.turn_ends) != sum(counts):
            raise RecordError(f"{path}turn_ends", f"has {len(self.turn_ends)} elements, expected {sum(counts)}")
        if len(self.turn_rewards) not in (0, sum(counts)):
            raise RecordError(f"{path}turn_rewards", f"has {len(self.turn_rewards)} elements, expected 0 or {sum(counts)}")
        for i, (ends, n) in enumerate(zip(self._split(self.turn_ends, counts), lengths)):
            e = ends.tolist()
            if e[-1] != n or e[0] < 0 or any(b < a for a, b in zip(e, e[1:])):
                raise RecordError(f"{path}turn_ends", f"sample {i}: {e} must rise to its length {n}")

    def _check_version_runs(self, lengths: list[int], path: str) -> None:
        runs, run_lengths, run_versions = self.version_runs, self.run_lengths, self.run_versions
        if not (len(runs) or len(run_lengths) or len(run_versions)):
            return
        if len(runs) != len(lengths):
            raise RecordError(f"{path}version_runs", f"has {len(runs)} entries, expected {len(lengths)} (or none)")
        n = int(runs.sum()) if runs.min() >= 0 else -1
        if n < 0:
            raise RecordError(f"{path}version_runs", "negative run count")
        for name, arr in (("run_lengths", run_lengths), ("run_versions", run_versions)):
            if len(arr) != n:
                raise RecordError(f"{path}{name}", f"has {len(arr)} elements, expected {n} (sum of version_runs)")
        if n and run_lengths.min() < 1:
            raise RecordError(f"{path}run_lengths", "a run must hold at least one token")
        if n and run_versions.min() < self.policy_version:
            raise RecordError(f"{path}run_versions", f"a version below policy_version {self.policy_version} (the oldest token's)")
        per_sample = np.bincount(np.repeat(np.arange(len(runs)), runs), weights=run_lengths, minlength=len(runs)).astype(np.int64)
        bad = np.flatnonzero(per_sample != np.asarray(lengths))
        if len(bad):
            i = int(bad[0])
            raise RecordError(f"{path}run_lengths", f"sample {i}: runs cover {int(per_sample[i])} tokens, its length is {lengths[i]}")


def _turn(kind: str, tokens: int, messages: list[dict[str, str]]) -> dict[str, Any]:
    if kind == "model":
        text = "".join(m["content"] for m in messages)
    else:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    return {"kind": kind, "tokens": tokens, "text": text}


_SAMPLE_FIELDS = frozenset({"lengths", "completion_ids", "logprobs", "finish_reasons", "texts",
                            "loss_mask", "turn_counts", "turn_ends", "turn_rewards", "env_rewards", "episode_messages",
                            "version_runs", "run_lengths", "run_versions"})


def version_runs(versions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Run-length encoding of per-token versions [T]: (run lengths, run versions)."""
    v = np.asarray(versions, np.int64)
    if not v.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
    return np.diff(np.r_[starts, v.size]), v[starts]


class ScoredGroup(Record, tag="scored_group", kw_only=True):
    """A rollout group with one reward per sample, on ``rl.<run>.scored``.

    ``rewards`` [G] is the weighted sum of ``components`` (name -> [G]). ``id`` is the
    rollout's id (filled in from it when not given).
    v1: id, run, ts, rollout, rewards, components, scorer_id, score_s.
    v2: + ``ref_logprobs`` and ``teacher_logprobs``, per completion token in the rollout's
    flat order ([sum(lengths)], log-probs <= 0), added by the ``reference`` and ``teacher``
    stages; empty when the stage is not in the run. + ``annotated_by`` (stage -> component id).
    """

    SCHEMA: ClassVar[str] = "scored_group"
    VERSION: ClassVar[int] = 2

    v: int = VERSION
    id: str = ""
    rollout: RolloutGroup
    rewards: Floats
    components: capped(dict[str, MaybeFloats], MAX_NAMES) = msgspec.field(default_factory=dict)
    scorer_id: str = ""
    score_s: float = 0.0
    # absent (the scorer's, before any annotator): the shared read-only empty array, as decoded
    ref_logprobs: LogProbs = msgspec.field(default_factory=lambda: empty_array(FLOAT32))  # v2
    teacher_logprobs: LogProbs = msgspec.field(default_factory=lambda: empty_array(FLOAT32))  # v2
    annotated_by: capped(dict[str, str], MAX_NAMES) = msgspec.field(default_factory=dict)  # v2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.id:
            self.id = self.rollout.id

    def per_sample(self, flat: np.ndarray) -> list[np.ndarray] | None:
        """A flat per-token annotation split by sample ([G] arrays); None when absent."""
        if flat.size == 0 and self.rollout.num_tokens() > 0:
            return None
        ends = list(itertools.accumulate(self.rollout.lengths.tolist()))
        return [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]

    def check(self, limits: Limits, path: str) -> None:
        g = self.rollout.group_size
        if len(self.rewards) != g:
            raise RecordError(f"{path}rewards", f"has {len(self.rewards)} elements, expected {g}")
        for name, values in self.components.items():
            if len(values) != g:
                raise RecordError(f"{path}components.{name}", f"has {len(values)} elements, expected {g}")
        if self.id != self.rollout.id:
            raise RecordError(f"{path}id", f"{self.id!r} differs from rollout.id {self.rollout.id!r}")
        n = self.rollout.num_tokens()
        for name in ("ref_logprobs", "teacher_logprobs"):
            if len(getattr(self, name)) not in (0, n):
                raise RecordError(f"{path}{name}", f"has {len(getattr(self, name))} elements, expected 0 or {n} (one per completion token)")


class PreferencePair(Record, tag="preference_pair", kw_only=True):
    """A prompt with a preferred and a rejected completion, for DPO. v1."""

    SCHEMA: ClassVar[str] = "preference_pair"
    VERSION: ClassVar[int] = 1

    v: int = VERSION
    prompt_ids: TokenIds
    chosen_ids: TokenIds
    rejected_ids: TokenIds
    prompt_text: str = ""
    chosen_text: str = ""
    rejected_text: str = ""

    def check(self, limits: Limits, path: str) -> None:
        _not_empty(self.chosen_ids, f"{path}chosen_ids")
        _not_empty(self.rejected_ids, f"{path}rejected_ids")


class SFTExample(Record, tag="sft_example", kw_only=True):
    """A prompt and the completion to imitate. v1."""

    SCHEMA: ClassVar[str] = "sft_example"
    VERSION: ClassVar[int] = 1

    v: int = VERSION
    prompt_ids: TokenIds
    completion_ids: TokenIds
    prompt_text: str = ""
    completion_text: str = ""

    def check(self, limits: Limits, path: str) -> None:
        _not_empty(self.completion_ids, f"{path}completion_ids")


class WeightsAnnouncement(Record, tag="weights", kw_only=True):
    """New policy weights are available. ``location`` is ``object://<bucket>/<name>``
    or ``file://<path>`` (a directory every producer mounts, or one on the learner's machine).

    v1: ``sha256`` is the digest of the whole safetensors file.
    v2: + ``chunk_size``, ``chunk_sha256`` and ``host``. With ``chunk_size > 0`` the bytes are
    checked chunk by chunk (``chunk_sha256[i]`` covers bytes ``[i*chunk_size, (i+1)*chunk_size)``,
    so chunks are fetched and checked in parallel), and ``sha256`` is the digest of the
    concatenated raw chunk digests (see :func:`rlstream.broker.weights.root_digest`); in the
    object store chunk ``i`` is the object ``<name>.part<i:05d>``. ``host`` names the machine of a
    ``file://`` location that only that machine can read (``learner.weights.transport: local``).
    v2 also accepts ``dist://host:port/v<version>``: a broadcast group the producer joins
    (:mod:`rlstream.weights.broadcast`), with chunk digests.
    v3: + ``kind`` (``full``: every weight; ``lora``: a PEFT adapter for the base model, whose
    safetensors are ``adapter_model.safetensors``) and ``adapter_config`` (the adapter's
    ``adapter_config.json`` text, for ``lora``). v3 also accepts ``cuda-ipc://<record>``: the
    learner's device buffer shared by a CUDA IPC handle (:mod:`rlstream.weights.cuda_ipc`),
    checked by a fingerprint computed on the device.
    v4: + ``base_version``, ``base_sha256``, ``delta_chunk_size``, ``delta_sizes`` and
    ``delta_sha256`` (``learner.weights.delta``, :mod:`rlstream.weights.delta`), all absent
    (None) without deltas. ``base_version == policy_version``: a full version that later
    deltas will refer to (a producer keeps its bytes). ``base_version < policy_version``: a
    delta, the bytes at ``location`` being zstd frames of ``delta_chunk_size`` bytes each of
    the XOR of this version's file with version ``base_version``'s (whose ``sha256`` was
    ``base_sha256``), each chunk's bytes grouped by their place in 4-byte words
    (:func:`rlstream.weights.delta.planes`); ``delta_sizes[i]`` and ``delta_sha256[i]`` are frame ``i``'s length and
    SHA-256. ``size``, ``sha256`` (and ``chunk_size``/``chunk_sha256``) then describe the
    reconstructed file, so a producer checks the result bitwise, and a build before v4 (which
    reads them as a full version's) refuses the delta's bytes by size or digest.
    v5: + ``fingerprint``: for full weights, the sums of ``|x|`` and ``x^2`` over every
    floating-point weight as published (:mod:`rlstream.weights.fingerprint`); a producer
    compares them with the same sums over its engine's parameters after loading (None: not
    computed, e.g. a LoRA adapter).
    v6: + ``probe_ids`` and ``probe_logprobs``: for full weights, a short fixed token sequence
    and the teacher-forced log-probs of its tokens after the first under the weights as
    published (:mod:`rlstream.weights.probe`); a producer that cannot read its engine's
    parameters (``openai``) compares them with the server's prompt log-probs after a reload
    (None: not computed).
    """

    SCHEMA: ClassVar[str] = "weights"
    VERSION: ClassVar[int] = 6

    v: int = VERSION
    policy_version: int
    step: int
    location: str
    size: int = 0
    sha256: str = ""
    format: str = "safetensors"
    chunk_size: int = 0  # v2
    chunk_sha256: capped(list[str]) = msgspec.field(default_factory=list)  # v2
    host: str = ""  # v2
    kind: str = "full"  # v3
    adapter_config: capped(str, 1 << 16) = ""  # v3
    base_version: int | None = None  # v4
    base_sha256: str | None = None  # v4
    delta_chunk_size: int | None = None  # v4
    delta_sizes: capped(list[int]) | None = None  # v4
    delta_sha256: capped(list[str]) | None = None  # v4
    fingerprint: capped(list[float], 2) | None = None  # v5
    probe_ids: capped(list[int], 64) | None = None  # v6
    probe_logprobs: capped(list[float], 64) | None = None  # v6

    def chunks(self) -> int:
        """How many chunks ``size`` bytes make (0 without chunking)."""
        return -(-self.size // self.chunk_size) if self.chunk_size > 0 else 0

    @property
    def is_delta(self) -> bool:
        """The bytes at ``location`` are a delta against version ``base_version``."""
        return self.base_version is not None and self.base_version < self.policy_version

    @property
    def is_base(self) -> bool:
        """A full version that deltas will refer to: a producer keeps its bytes."""
        return self.base_version is not None and self.base_version == self.policy_version

    def delta_chunks(self) -> int:
        """How many zstd frames a delta of ``size`` bytes is (0: not a delta)."""
        return -(-self.size // self.delta_chunk_size) if self.is_delta and self.delta_chunk_size else 0

    def check(self, limits: Limits, path: str) -> None:
        _min(self.chunk_size, 0, f"{path}chunk_size")
        if self.chunk_size and len(self.chunk_sha256) != self.chunks():
            raise RecordError(f"{path}chunk_sha256", f"{len(self.chunk_sha256)} digests for {self.chunks()} chunks "
                                                     f"of {self.chunk_size} bytes in {self.size}")
        if self.format != "safetensors":
            raise RecordError(f"{path}format", f"{self.format!r}; only 'safetensors' is accepted")
        if self.kind not in ("full", "lora"):
            raise RecordError(f"{path}kind", f"{self.kind!r}; expected 'full' or 'lora'")
        if self.kind == "lora" and not self.adapter_config:
            raise RecordError(f"{path}adapter_config", "a 'lora' announcement needs the adapter's adapter_config.json")
        if not self.location.startswith(("object://", "file://", "dist://", "cuda-ipc://")):
            raise RecordError(f"{path}location", f"{self.location!r} must start with object://, file://, dist:// or cuda-ipc://")
        _min(self.policy_version, 0, f"{path}policy_version")
        _min(self.step, 0, f"{path}step")
        _min(self.size, 0, f"{path}size")
        if self.base_version is not None:
            self._check_delta(path)
        if self.fingerprint is not None and (len(self.fingerprint) != 2 or not all(math.isfinite(x) and x >= 0 for x in self.fingerprint)):
            raise RecordError(f"{path}fingerprint", f"{self.fingerprint!r}; expected two finite sums of 0 or more")
        if (self.probe_ids is None) != (self.probe_logprobs is None):
            raise RecordError(f"{path}probe_logprobs", "a probe needs both its token ids and their log-probs")
        if self.probe_ids is not None:
            if len(self.probe_ids) < 2 or len(self.probe_logprobs) != len(self.probe_ids) - 1 or min(self.probe_ids) < 0:
                raise RecordError(f"{path}probe_ids", f"{len(self.probe_ids)} ids (0 or more) for {len(self.probe_logprobs)} "
                                                      "log-probs; expected 2 or more ids and one log-prob for each after the first")
            if not all(math.isfinite(x) and x <= 0 for x in self.probe_logprobs):
                raise RecordError(f"{path}probe_logprobs", "expected finite log-probs of 0 or less")

    def _check_delta(self, path: str) -> None:
        if not 0 <= self.base_version <= self.policy_version:
            raise RecordError(f"{path}base_version", f"{self.base_version} is not within 0..policy_version "
                                                     f"{self.policy_version}")
        if not self.is_delta:
            return
        if not self.base_sha256:
            raise RecordError(f"{path}base_sha256", "a delta needs its base version's digest")
        if not self.delta_chunk_size or self.delta_chunk_size < 1:
            raise RecordError(f"{path}delta_chunk_size", f"{self.delta_chunk_size}; a delta needs a chunk size of 1 or more")
        n = self.delta_chunks()
        for name in ("delta_sizes", "delta_sha256"):
            got = getattr(self, name)
            if got is None or len(got) != n:
                raise RecordError(f"{path}{name}", f"{0 if got is None else len(got)} entries for the {n} chunks of "
                                                   f"{self.delta_chunk_size} bytes in {self.size}")
        if any(s < 0 for s in self.delta_sizes):
            raise RecordError(f"{path}delta_sizes", "a chunk's size is below 0")


class MetricEvent(Record, tag="metric", kw_only=True):
    """Flat namespaced figures from one component (``loss/policy``, ``producer/tokens_per_s``). v1."""

    SCHEMA: ClassVar[str] = "metric"
    VERSION: ClassVar[int] = 1

    v: int = VERSION
    id: str = msgspec.field(default_factory=new_id)
    component: str
    component_id: str = ""
    step: int = -1
    values: capped(dict[str, float]) = msgspec.field(default_factory=dict)


class DeadLetter(Record, tag="dead_letter", kw_only=True):
    """A record a stage could not handle: the original bytes, where, why, how often.

    v1: id, run, ts, stage, subject, reason, data, deliveries, record_id.
    v2: + size, sha256 (of the whole original payload). ``data`` may then be a prefix of
    the original (``len(data) < size``): a letter must fit under the broker's max payload
    even when the record it carries nearly filled it. Build one with :meth:`bounded`.
    """

    SCHEMA: ClassVar[str] = "dead_letter"
    VERSION: ClassVar[int] = 2
    MAX_DATA: ClassVar[int] = 1 << 20
    """At most this much of the original payload is kept (less when the broker's limit is smaller)."""
    MAX_REASON: ClassVar[int] = 16 << 10
    """A reason (a traceback, a decode error) is cut to this many characters."""

    v: int = VERSION
    id: str = msgspec.field(default_factory=new_id)
    stage: str
    subject: str = ""
    reason: str
    data: bytes
    deliveries: int = 1
    record_id: str = ""
    size: int = -1
    sha256: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.size < 0:  # v1, or built without it: the data is the whole payload
            self.size = len(self.data)

    @classmethod
    def bounded(cls, *, stage: str, subject: str, reason: str, data: bytes, max_payload: int = 0, **kw) -> DeadLetter:
        """A letter that always fits: the payload's first bytes (whole when small), its size and
        sha256, and the reason cut to :attr:`MAX_REASON` characters (head and tail kept)."""
        keep = cls.MAX_DATA if max_payload <= 0 else max(0, min(cls.MAX_DATA, max_payload // 2 - cls.MAX_REASON * 4 - 4096))
        data = bytes(data)
        if len(reason) > cls.MAX_REASON:
            half = cls.MAX_REASON // 2
            reason = f"{reason[:half]}\n... [{len(reason) - 2 * half} characters cut] ...\n{reason[-half:]}"
        return cls(stage=stage, subject=subject[:1024], reason=reason, data=data[:keep], size=len(data),
                   sha256=hashlib.sha256(data).hexdigest(), **kw)

    @property
    def truncated(self) -> bool:
        return len(self.data) < self.size

    def check(self, limits: Limits, path: str) -> None:
        if self.size < 0:  # a v1 letter (decoding skips __post_init__): its data is the whole payload
            self.size = len(self.data)
        _min(self.deliveries, 0, f"{path}deliveries")
        _min(self.size, len(self.data), f"{path}size")


RECORDS: dict[str, type[Record]] = {
    cls.SCHEMA: cls
    for cls in (Prompt, RolloutGroup, ScoredGroup, PreferencePair, SFTExample, WeightsAnnouncement, MetricEvent, DeadLetter)
}
_ANY = decoder_for(list(RECORDS.values()))
_BY_WIRE = {plan_of(cls).wire: cls for cls in RECORDS.values()}


def decode_any(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Record:
    """Decode a record of any known schema (for tail, export, the DLQ viewer)."""
    return decode_tagged(_ANY, _BY_WIRE, data, limits)
