"""Training engines: plain torch (one process, or DDP under ``torchrun``) and DeepSpeed (ZeRO 0-3).

Both implement :class:`Engine`, the small surface the training step and checkpoints use.

The learning rate is a pure function of the step (:func:`lr_at`), set on the param groups
before each update, so a checkpoint needs only the step to restore the schedule.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What the training step, checkpoints and the data-parallel ranks ask of an engine."""

    name: str
    """``torch`` or ``deepspeed`` (recorded in checkpoints)."""
    rank: int
    world_size: int
    """Ranks in the process group (1: a single process)."""
    module: torch.nn.Module
    """The model to call forward on (DDP / DeepSpeed wrapper included)."""
    unwrapped: torch.nn.Module
    """The plain HF model."""

    @property
    def optimizer_sharded(self) -> bool:
        """Each rank holds (and saves) only its partition of the optimizer state (ZeRO 1-3)."""
        ...

    @property
    def gathers_weights(self) -> bool:
        """The full weights are partitioned over ranks (ZeRO-3): gathering them is a
        collective every rank must join, and so is loading them."""
        ...

    def set_lr(self, lr: float) -> None: ...

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """Accumulate gradients (``last``: the step's final micro-batch)."""

    def step(self) -> tuple[float, bool]:
        """Clip to ``learner.max_grad_norm`` and update: ``(grad_norm, stepped)``."""
        ...

    def zero_grad(self) -> None: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight on CPU under ``AutoModelForCausalLM.state_dict()`` names."""
        ...

    def live_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight under the same names, where it can be the parameters themselves (no
        copy): for a caller that copies them before the next step (a publish's snapshot)."""
        ...

    def optimizer_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Optimizer state as flat tensors + JSON meta (safetensors-friendly; no pickle)."""
        ...

    def load_optimizer_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None: ...

    def weights_loaded(self) -> None:
        """Called after the model's weights were overwritten (a checkpoint load)."""


def lr_at(step: int, lcfg) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup then the schedule."""
    base = lcfg.lr
    if lcfg.warmup_steps and step < lcfg.warmup_steps:
        return base * (step + 1) / lcfg.warmup_steps
    if lcfg.lr_schedule == "constant":
        return base
    span = max(1, lcfg.max_steps - lcfg.warmup_steps)
    progress = min(1.0, (step - lcfg.warmup_steps) / span)
    if lcfg.lr_schedule == "linear":
        return base * (1.0 - progress)
    return base * 0.5 * (1.0 + math.cos(math.pi * progress))


def world() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment (torchrun / deepspeed)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def optimizer_to_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A torch optimizer's state as ``{"state.<param>.<name>": tensor}`` plus JSON-able meta."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for name, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[name] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = value
    for pid, values in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(values)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    opt.load_state_dict({"state": state, "param_groups": groups})


def _unique_cpu(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies: never aliases of live parameters (training may go on while they are
    written), and tied weights become separate tensors, as safetensors requires."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""What torch's fused AdamW kernel takes."""


def adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """AdamW's implementation for ``params``: on CUDA the fused kernel (one launch for every
    tensor: at 269M float32 parameters the per-tensor loop took 0.17 s where the memory traffic
    needs about 3 ms), or the multi-tensor ``foreach`` one where fused does not apply. On CPU
    torch's default, so CPU runs keep their numbers."""
    if not params or not all(p.is_cuda for p in params):
        return {}
    if all(p.dtype in FUSED_DTYPES for p in params):
        return {"fused": True}
    return {"foreach": True}


def make_optimizer(params, lcfg) -> torch.optim.Optimizer:
    params = list(params)
    return torch.optim.AdamW(params, lr=lcfg.lr, betas=tuple(lcfg.betas), weight_decay=lcfg.weight_decay, eps=1e-8,
                             **adamw_kernel(params))


def autocast_forward(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Run ``model``'s forward under ``torch.autocast`` to ``dtype``, its weights untouched.

    Mixed precision as DeepSpeed's ``bf16`` does it: the weights, their gradients and the
    optimizer state stay float32 (the master weights), while matrix multiplications run in
    bfloat16. An update far below bfloat16's resolution (about 3 significant digits) is
    therefore kept, where pure bfloat16 weights would round it away. Log-probabilities are
    taken from float32 logits (``forward_logprobs`` upcasts before the softmax).
    """
    device_type = next(model.parameters()).device.type
    model.forward = torch.autocast(device_type=device_type, dtype=dtype)(model.forward)
    return model


class TorchEngine:
    """Plain torch: AdamW, ``clip_grad_norm_``; DDP when ``WORLD_SIZE`` > 1 (``torchrun``).

    ``learner.dtype: bfloat16`` is mixed precision (:func:`autocast_forward`): float32 master
    weights, bfloat16 compute."""

    name = "torch"
    optimizer_sharded = False
    gathers_weights = False

    def __init__(self, model: torch.nn.Module, lcfg):
        self.lcfg = lcfg
        self.unwrapped = model
        self.rank, self.world_size = world()
        self.module = model
        if self.world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            self.module = torch.nn.parallel.DistributedDataParallel(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, lcfg)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        loss.backward()

    def step(self) -> tuple[float, bool]:
        max_norm = self.lcfg.max_grad_norm or float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return norm, False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return _unique_cpu(self.unwrapped.state_dict())

    def live_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.unwrapped.state_dict().items()}

    def optimizer_tensors(self):
        return optimizer_to_tensors(self.optimizer)

    def load_optimizer_tensors(self, tensors, meta) -> None:
        optimizer_from_tensors(self.optimizer, tensors, meta)

    def weights_loaded(self) -> None:
        return None  # the optimizer works on the model's own parameters


def init_deepspeed_single_process() -> None:
    """DeepSpeed without a launcher: a one-process gloo group (see PLATFORM.md)."""
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            from rlstream.broker.server import free_port

            os.environ["MASTER_PORT"] = str(free_port())
    import torch.distributed as dist

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


class DeepSpeedEngine:
    """DeepSpeed ZeRO 0-3 (CPU offload, bf16) with a torch AdamW (no JIT-compiled CPU Adam).

    The DeepSpeed dict comes from ``learner.deepspeed_config()``, so batch size, clipping and
    precision have one source of truth. Gradient accumulation is driven from here: each
    micro-batch's loss is already normalised over the whole optimizer step, so the engine
    never rescales it, and the accumulation boundary is set explicitly on the last one.

    A NaN/inf loss is caught by the training step before its backward (the step then runs
    no optimizer update); gradients that turn nonfinite with a finite loss are DeepSpeed's
    to handle (bf16/fp32 do not skip by themselves), which is why the loss check comes first.
    """

    name = "deepspeed"

    def __init__(self, model: torch.nn.Module, lcfg, accumulation: int = 1):
        import deepspeed

        init_deepspeed_single_process()
        self.lcfg = lcfg
        self.rank, self.world_size = world()
        ds = lcfg.deepspeed_config(self.world_size, accumulation)
        ds.setdefault("steps_per_print", 10**9)
        ds.setdefault("wall_clock_breakdown", False)
        self.stage = int(ds.get("zero_optimization", {}).get("stage", 0))
        if ds["bf16"]["enabled"]:
            model = model.to(torch.bfloat16)
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad], lcfg)
        if "offload_optimizer" in ds.get("zero_optimization", {}):
            ds.setdefault("zero_force_ds_cpu_optimizer", False)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
        self.module = self.engine
        self.unwrapped = self.engine.module
        self._base_opt = getattr(self.optimizer, "optimizer", self.optimizer)
        self.ds_config = ds

    def set_lr(self, lr: float) -> None:
        for g in self._base_opt.param_groups:
            g["lr"] = lr

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> tuple[float, bool]:
        self.engine.set_gradient_accumulation_boundary(True)
        # ZeRO 0 (and 1 on some versions) keeps no global norm of its own: measured here,
        # from the full gradients it holds on the parameters, before the step clears them
        grads = [p.grad for p in self.unwrapped.parameters() if p.grad is not None] if self.stage < 2 else []
        own = float(torch.nn.utils.get_total_norm(grads)) if grads else None
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else (own if own is not None else 0.0)
        return norm, True

    def zero_grad(self) -> None:
        self.engine.zero_grad()
        zero = getattr(self.optimizer, "zero_grad", None)
        if zero is not None:
            zero(set_to_none=True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        model = self.unwrapped
        if self.gathers_weights:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
                return _unique_cpu(model.state_dict())
        return _unique_cpu(model.state_dict())

    def live_state_dict(self) -> dict[str, torch.Tensor]:
        return self.full_state_dict()  # ZeRO-3's weights exist whole only inside a gather

    # ---- optimizer state (safetensors + JSON, never DeepSpeed's pickled save_checkpoint) ----
    #
    # ZeRO 1-3 partition the fp32 master weights and the Adam moments over the data-parallel
    # ranks: rank r holds one flat fp32 partition per parameter sub-group (stage 1/2: a slice
    # of the flattened group; stage 3: its slice of every parameter, concatenated) and the
    # base AdamW keeps (exp_avg, exp_avg_sq, step) keyed by that flat tensor. Each rank saves
    # its own partitions (``trainer/optimizer_rank{r}.safetensors``) rather than gathering
    # them: nothing is materialised whole on one rank, and the layout is DeepSpeed's own
    # rigid one, so a resume needs the same world size and stage family (checked).

    @property
    def optimizer_sharded(self) -> bool:
        """True when each rank holds (and saves) only its partition of the optimizer state."""
        return self.stage in (1, 2, 3)

    @property
    def gathers_weights(self) -> bool:
        return self.stage == 3

    def _master_partitions(self) -> list[torch.Tensor]:
        if self.stage == 3:
            if getattr(self.optimizer, "swap_optimizer", False):
                raise NotImplementedError("ZeRO-3 optimizer state swapped to NVMe is not checkpointed; offload to cpu instead")
            return list(self.optimizer.fp32_partitioned_groups_flat)
        return list(self.optimizer.single_partition_of_fp32_groups)

    def _layout(self) -> str:
        return "zero3" if self.stage == 3 else "zero12"

    def optimizer_tensors(self):
        """This rank's optimizer state: ``fp32.<i>`` (master partition of sub-group i) and
        ``state.<i>.<name>`` (its Adam tensors), plus JSON meta. Stage 0: the whole torch
        optimizer (every rank holds the same)."""
        if not self.optimizer_sharded:
            return optimizer_to_tensors(self._base_opt)
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, dict[str, Any]] = {}
        masters = self._master_partitions()
        for i, master in enumerate(masters):
            tensors[f"fp32.{i}"] = master.detach().to("cpu", copy=True).contiguous()
            for name, value in self._base_opt.state.get(master, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state.{i}.{name}"] = value.detach().to("cpu", copy=True).contiguous()
                else:
                    scalars.setdefault(str(i), {})[name] = value
        meta = {"layout": self._layout(), "stage": self.stage, "rank": self.rank, "world_size": self.world_size,
                "partition_numel": [int(m.numel()) for m in masters], "scalars": scalars}
        return tensors, meta

    def load_optimizer_tensors(self, tensors, meta) -> None:
        """Restore what :meth:`optimizer_tensors` gave on this rank: master weights (and the
        bf16/fp32 working copy of this rank's partition), Adam moments and step."""
        if not self.optimizer_sharded:
            if "layout" in meta:
                raise ValueError(f"the checkpoint holds partitioned ZeRO ({meta['layout']}) optimizer state; "
                                 "this engine is ZeRO stage 0")
            optimizer_from_tensors(self._base_opt, tensors, meta)
            return
        if meta.get("layout") != self._layout():
            have = meta.get("layout", "unpartitioned")
            raise ValueError(f"the checkpoint's optimizer state ({have}) does not fit ZeRO stage {self.stage}")
        if meta["world_size"] != self.world_size or meta["rank"] != self.rank:
            raise ValueError(f"optimizer partition of rank {meta['rank']}/{meta['world_size']} "
                             f"loaded on rank {self.rank}/{self.world_size}: "
                             "ZeRO partitions resume only at the same world size")
        masters = self._master_partitions()
        sizes = [int(m.numel()) for m in masters]
        if meta["partition_numel"] != sizes:
            raise ValueError(f"optimizer partitions {meta['partition_numel']} do not match this model's {sizes}")
        scalars = meta.get("scalars", {})
        with torch.no_grad():
            for i, master in enumerate(masters):
                master.copy_(tensors[f"fp32.{i}"])
                prefix = f"state.{i}."
                state = {k[len(prefix):]: v.to(master.device) for k, v in tensors.items() if k.startswith(prefix)}
                state.update(scalars.get(str(i), {}))
                if state:
                    self._base_opt.state[master] = state
                else:
                    self._base_opt.state.pop(master, None)
            self._copy_masters_to_working()

    def _copy_masters_to_working(self) -> None:
        """The model computes with its own (bf16 or fp32) copy of this rank's partition: set it
        from the restored masters, as DeepSpeed does after each step."""
        opt = self.optimizer
        if self.stage == 3:
            for i, master in enumerate(opt.fp32_partitioned_groups_flat):
                work = opt.fp16_partitioned_groups_flat[i]
                if work is not None and work is not master and work.numel() > 0:
                    work.data.copy_(master.data)
                    for part, view in zip(opt.fp16_partitioned_groups[i], opt.unflatten(work, opt.fp16_partitioned_groups[i])):
                        part.data = view.data
            return
        import torch.distributed as dist

        for i, master in enumerate(opt.single_partition_of_fp32_groups):
            pid = dist.get_rank(group=opt.real_dp_process_group[i])
            opt.parallel_partitioned_bit16_groups[i][pid].data.copy_(master.data)

    def weights_loaded(self) -> None:
        """After the model's weights were overwritten (checkpoint load): refresh the fp32 master
        partitions from them, so an optimizer step does not start from stale masters. (A
        checkpoint's optimizer file, loaded next, then restores the exact fp32 masters.)"""
        refresh = getattr(self.optimizer, "refresh_fp32_params", None)
        if self.optimizer_sharded and refresh is not None:
            refresh()


def build_engine(model: torch.nn.Module, lcfg, accumulation: int = 1) -> Engine:
    if lcfg.engine == "deepspeed":
        return DeepSpeedEngine(model, lcfg, accumulation)
    return TorchEngine(model, lcfg)
