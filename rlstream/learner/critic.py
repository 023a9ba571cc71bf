"""PPO's value model, in one place: a linear value head on the policy's last hidden state.

The head reads *detached* features and has its own AdamW (``value_lr``): no second
transformer, and the value loss never pulls the policy's representation. Everything the
value model needs, from the values before the update (and GAE on them) to its optimizer step,
gradient averaging over ranks and its checkpoint files, is a method here; the training
step, the data-parallel shard and the checkpoint only call them.

Algorithms without a value model get :class:`NoCritic`, which fixes nothing before the
update and has nothing to step or save, so the step and the checkpoint call the same methods
either way.

Files (in a checkpoint's ``trainer/``, so the directory stays loadable by vLLM):
``value_head.safetensors``, ``value_optimizer.safetensors``; the optimizer's JSON meta goes
in ``learner_state.json`` under ``extra.value_optimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlstream.learner import advantages as adv
from rlstream.learner import distributed as dist
from rlstream.learner.batching import TokenBatch, forward_logprobs
from rlstream.learner.engines import optimizer_from_tensors, optimizer_to_tensors

HEAD_FILE = "value_head.safetensors"
OPTIMIZER_FILE = "value_optimizer.safetensors"
META_KEY = "value_optimizer"


@dataclass
class ValueTargets:
    """What the value model fixes before a PPO update, per micro-batch ([B, T] each; None:
    nothing fixed, without a value model)."""

    prox_logprobs: list[torch.Tensor | None]
    """The policy's log-probs before the update (this forward pass gave them for free)."""
    old_values: list[torch.Tensor | None]
    advantages: list[torch.Tensor | None]
    """GAE on the terminal reward, whitened over the whole step (without a value model: the
    batch's own token advantages, if any)."""
    returns: list[torch.Tensor | None]


def _pad_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    t = max(x.shape[1] for x in tensors)
    return torch.cat([torch.nn.functional.pad(x, (0, t - x.shape[1])) for x in tensors])


class ValueHead:
    """The critic: ``values(hidden)`` plus its optimizer, lr, gradient and file handling."""

    needs_hidden = True
    """The policy's forward returns its last hidden state, which :meth:`values` reads."""

    def __init__(self, hidden_size: int, device: torch.device, lr: float, base_lr: float, betas: tuple[float, float]):
        self.head = torch.nn.Linear(hidden_size, 1).to(device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.lr_scale = lr / base_lr
        """The value lr follows the policy's schedule, scaled by ``value_lr / lr``."""
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=lr, betas=tuple(betas))

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """V(s_t) [B, T] from the policy's last hidden state, detached (no gradient into the policy)."""
        return self.head(hidden.detach().float()).squeeze(-1)

    @torch.no_grad()
    def targets(self, module: torch.nn.Module, tbs: list[TokenBatch], params) -> ValueTargets:
        """Values before the update, then GAE (``params.gamma``, ``params.lam``) on the terminal
        reward, whitened over the whole step."""
        gamma, lam = params.gamma, params.lam
        prox, old_values, token_adv, returns = [], [], [], []
        for tb in tbs:
            out = forward_logprobs(module, tb, hidden=True)
            prox.append(out.logprobs)
            values = self.values(out.hidden)
            old_values.append(values)
            a, r = adv.gae(adv.place_terminal_reward(tb.rewards, tb.mask), values, tb.mask, gamma=gamma, lam=lam)
            token_adv.append(a)
            returns.append(r)
        whole = adv.whiten(_pad_cat(token_adv), _pad_cat([tb.mask for tb in tbs]))
        start = 0
        for i, tb in enumerate(tbs):
            b, t = tb.mask.shape
            token_adv[i] = whole[start:start + b, :t]
            start += b
        return ValueTargets(prox, old_values, token_adv, returns)

    # ---- the update ----------------------------------------------------------------------------

    def average_grads(self, world: int) -> None:
        """Data-parallel: the head is outside DDP/DeepSpeed, so its gradients are averaged here."""
        dist.average_grads(self.head.parameters(), world)

    def clip_grads(self, max_norm: float | None) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.head.parameters(), max_norm or float("inf")))

    def step(self, policy_lr: float, ok: bool) -> None:
        """An AdamW step at the policy's scheduled lr times the value scale (only when ``ok``);
        the gradients are cleared either way."""
        if ok:
            for g in self.optimizer.param_groups:
                g["lr"] = policy_lr * self.lr_scale
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ---- checkpoint files ---------------------------------------------------------------------

    def save(self, trainer_dir: Path) -> dict[str, Any]:
        """Write the head and its optimizer under ``trainer_dir``; returns what the checkpoint's
        ``extra`` keeps (the optimizer's JSON meta under :data:`META_KEY`)."""
        save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}, str(trainer_dir / HEAD_FILE))
        tensors, meta = optimizer_to_tensors(self.optimizer)
        save_file(tensors, str(trainer_dir / OPTIMIZER_FILE))
        return {META_KEY: meta}

    def load(self, trainer_dir: Path, extra: dict[str, Any]) -> None:
        """Restore what :meth:`save` wrote (``extra``: the checkpoint's; a checkpoint without the
        files keeps the fresh head)."""
        if not (trainer_dir / HEAD_FILE).exists():
            return
        self.head.load_state_dict(load_file(str(trainer_dir / HEAD_FILE)))
        optimizer_from_tensors(self.optimizer, load_file(str(trainer_dir / OPTIMIZER_FILE)), extra.get(META_KEY, {}))


class NoCritic:
    """No value model (every algorithm but PPO): nothing fixed before the update, nothing to step or save."""

    needs_hidden = False

    def values(self, hidden: torch.Tensor | None) -> None:
        return None

    def targets(self, module: torch.nn.Module, tbs: list[TokenBatch], params) -> ValueTargets:
        """The batch's own token advantages (multi-turn episodes carry them; else None: the rows')."""
        n = len(tbs)
        return ValueTargets([None] * n, [None] * n, [tb.token_advantages for tb in tbs], [None] * n)

    def average_grads(self, world: int) -> None:
        return None

    def clip_grads(self, max_norm: float | None) -> float:
        return 0.0

    def step(self, policy_lr: float, ok: bool) -> None:
        return None

    def save(self, trainer_dir: Path) -> dict[str, Any]:
        return {}

    def load(self, trainer_dir: Path, extra: dict[str, Any]) -> None:
        return None


Critic = ValueHead | NoCritic
"""The learner's value model, or its absence."""
