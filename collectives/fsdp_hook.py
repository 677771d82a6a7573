"""FSDP2 with 1-bit compression between replicas (HSDP), for any optimizer.

    from onebit.collectives import register_fsdp_hooks
    mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    hooks = register_fsdp_hooks(model, optimizer=opt, freeze_step=steps // 4)
    ...
    loss.backward(); hooks.clip_grad_norm_(1.0); opt.step()

Each FSDP module reduce-scatters its gradients in full precision inside the replica (the shard
group: fast links, e.g. one node); the hook then averages that gradient block across the
replicas (the slow links) with ``compressed_allreduce``, with worker and server error buffers of
its own, one hook per FSDP module (docs/ALGORITHMS.md 11.2). On a 2-D mesh FSDP's own
all-reduce across replicas is switched off for good (:mod:`onebit.collectives._fsdp_replicas`),
and the replicate group is the mesh's. The older form, ``fully_shard`` over the 1-D shard mesh
with the replicate group passed as ``process_group``, works as before.

``reduce="mean"`` gives the replicas' mean, what HSDP gives; ``reduce="sum"`` their sum, for
trainers that scale the loss by the global token count and set FSDP's gradient divide factor to
1 (torchtitan). ``optimizer=`` with ``freeze_step``: torch's Adam/AdamW behind the hooks with
1-bit Adam's recipe (ALGORITHMS 8.2): ``freeze_step`` iterations in full precision, then each
rank compresses its momentum block in the frozen preconditioned space, and the optimizer steps
with the compressed mean momentum and the frozen variance. Clip with ``hooks.clip_grad_norm_``.

Limits: FSDP calls the hook synchronously and expects the block in place when it returns, so on
gloo the compressed all-reduce blocks the backward pass for its duration (on CUDA it is queued
on FSDP's all-reduce stream, which is what overlaps with backward). Gradient accumulation with
``set_requires_all_reduce(False)`` skips the hook on the accumulating steps, as it skips FSDP's
own all-reduce. Without ``optimizer=`` it compresses gradients, as the DDP hook does: see that
module's note on which optimizers and learning rates suit gradient compression.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels._checks import check_choice, check_group, check_instance, check_int, check_number
from ..kernels.layout import check_block
from ..kernels.rounding import check_error_dtype
from . import _hook_fused
from ._clip_sketch import ClipSketch
from ._frozen_adam import Denominators, FrozenAdam, clip_agreed, frozen_pre_, is_adam_type
from ._fsdp_replicas import ReplicaReduction, fsdp_param_groups, is_hsdp
from ._unwrap import unwrap_optimizer
from .allreduce import compressed_allreduce, compressed_allreduce_passes, error_buffer_numel
from .ddp_hook import HOOK_BLOCK
from .mesh import flat_group, hierarchy, is_mesh
from .telemetry import CallTimer, counting
from .wire import Traffic, compressed_bytes, ring_allreduce_bytes

__all__ = ["FSDPHooks", "OnebitAllReduceHook", "register_fsdp_hooks"]

REDUCTIONS = ("mean", "sum")


class OnebitAllReduceHook:
    """``hook(reduce_output)`` for ``FSDPModule.set_all_reduce_hook``: replaces the gradient block
    in place by its mean (``reduce="sum"``: sum) over ``process_group`` (the replica group), with
    1-bit compression after ``start_iter`` full-precision calls.

    ``block``: elements per scale (see ``OnebitCompressHookState``; default 64). ``state_dict()`` /
    ``load_state_dict()`` checkpoint the error buffers and counters. ``error_dtype``: bfloat16
    (the default: half the bytes, stored with stochastic rounding, docs/ALGORITHMS.md 12) or
    float32.
    ``process_group`` may be a 2-D DeviceMesh of the replicas (nodes x replicas per node): the
    compressed calls are then hierarchical, 1-bit between nodes only.
    """

    def __init__(self, process_group: dist.ProcessGroup | None, start_iter: int = 0,
                 block: int | None = HOOK_BLOCK, *, reduce: str = "mean",
                 error_dtype: torch.dtype = torch.bfloat16) -> None:
        self._mesh = process_group if is_mesh(process_group) else None
        process_group = flat_group(process_group)
        self.process_group = process_group
        self.world_size = check_group(process_group)
        self.start_iter = check_int("start_iter", start_iter)
        self.block = check_block(block)
        self.reduce = check_choice("reduce", reduce, REDUCTIONS)
        self.error_dtype = check_error_dtype(error_dtype)
        self.iter = 0
        self.worker_error: torch.Tensor | None = None
        self.server_error: torch.Tensor | None = None
        self.bytes_full = 0
        self.bytes_compressed = 0
        self._timing = Traffic()  # seconds in compute and communication (telemetry; not saved)
        self._terms = None  # set by FSDPHooks with optimizer=: (d, parts, post) of its block (8.2)
        self._tables: dict = {}  # the fused passes' tables between iterations (_hook_fused.pre_)

    def __call__(self, reduce_output: torch.Tensor) -> None:
        W = self.world_size
        compressing = self.iter >= self.start_iter
        if W > 1 and not compressing:
            group = self.process_group if self.process_group is not None else dist.group.WORLD
            with CallTimer(reduce_output.device, self._timing).stage("full"):
                dist.all_reduce(reduce_output, group=group)
            if self.reduce == "mean":
                reduce_output.div_(W)
            self.bytes_full += ring_allreduce_bytes(reduce_output.numel(), W, reduce_output.element_size())
        elif W > 1:
            if self.reduce == "sum":
                reduce_output.mul_(W)  # the mean of W times each block is their sum
            if self._terms is None:
                self._compressed_mean(reduce_output)
            else:
                self._frozen_mean(reduce_output, *self._terms(reduce_output))
        self.iter += 1

    def _frozen_mean(self, reduce_output: torch.Tensor, d: Denominators, parts: list,
                     post: float | None) -> None:
        """The compressed mean of this rank's momentum in the frozen space, ``(g + c) / d`` with ``c =
        factor * m`` per parameter (``parts`` as ``frozen_terms`` gives them), then ``out * d - c``: the
        DDP hook's passes (section 8.2), fused where a backend has them (:mod:`onebit.collectives.
        _hook_fused`: on CPU inside the codec's passes, on a GPU one launch each way)."""
        if post is not None:  # FSDP divides after the hook: the momentum terms need the final scale
            reduce_output.div_(post)
        if self._mesh is None and _hook_fused.backend(reduce_output, d, parts) == "native":
            self._compressed_mean(reduce_output, _hook_fused.passes(d, parts, block=self.block))
        else:
            after = frozen_pre_(reduce_output, d, parts, tables=self._tables)  # (the norm: by the terms)
            self._compressed_mean(reduce_output)
            after(reduce_output)
        if post is not None:
            reduce_output.mul_(post)

    def _compressed_mean(self, reduce_output: torch.Tensor, passes=None) -> None:
        group = self.process_group if self._mesh is None else self._mesh
        N = error_buffer_numel(reduce_output.numel(), group, self.block)
        servers = self._servers()
        if self.worker_error is None or self.worker_error.numel() != N:
            if self.worker_error is not None:
                raise ValueError(f"reduce_output: expected {self.worker_error.numel()} elements padded "
                                 f"as before, got {reduce_output.numel()} (one hook per FSDP module)")
            self.worker_error = torch.zeros(N, device=reduce_output.device, dtype=self.error_dtype)
            self.server_error = torch.zeros(N // servers, device=reduce_output.device, dtype=self.error_dtype)
        errors = (self.worker_error, self.server_error)
        with counting(self._timing):
            if passes is None:
                compressed_allreduce(reduce_output, *errors, group, block=self.block)
            else:  # the frozen terms' passes fused into the codec's (a flat float32 block, no mesh)
                compressed_allreduce_passes(reduce_output, *errors, group, passes, block=self.block)
        self.bytes_compressed += compressed_bytes(N, servers, self.block) if servers > 1 else 0

    def _servers(self) -> int:
        return self.world_size if self._mesh is None else hierarchy(self._mesh).nodes

    def stats(self) -> dict:
        """Calls, stage, bytes this rank sent, and the seconds spent (as
        ``OnebitCompressHookState.stats()``)."""
        timing = self._timing
        timing.resolve()
        return {"iter": self.iter, "compressing": self.iter >= self.start_iter,
                "bytes_full": self.bytes_full, "bytes_compressed": self.bytes_compressed,
                "seconds_codec": timing.codec_seconds, "seconds_comm": timing.comm_seconds,
                "seconds_full": timing.full_seconds}

    def state_dict(self) -> dict:
        errors = {} if self.worker_error is None else {"worker_error": self.worker_error.clone(),
                                                      "server_error": self.server_error.clone()}
        return {"iter": self.iter, "start_iter": self.start_iter, "bytes_full": self.bytes_full,
                "bytes_compressed": self.bytes_compressed, **errors}

    def load_state_dict(self, state: dict) -> None:
        check_instance("state", state, dict, "a dict from state_dict()")
        worker, server = state.get("worker_error"), state.get("server_error")
        servers = self._servers()
        if (worker is None) != (server is None) or (
                worker is not None and server.numel() * servers != worker.numel()):
            raise ValueError("state: expected both error buffers, the server's 1/world_size (on a mesh: "
                             "1/nodes) of the worker's")
        self.iter, self.start_iter = int(state["iter"]), int(state["start_iter"])
        self.bytes_full, self.bytes_compressed = int(state["bytes_full"]), int(state["bytes_compressed"])
        dtype = getattr(self, "error_dtype", torch.float32)
        self.worker_error = None if worker is None else worker.to(dtype, copy=True)
        self.server_error = None if server is None else server.to(dtype, copy=True)


class FSDPHooks(dict):
    """What :func:`register_fsdp_hooks` returns: the hooks by FSDP module name (a dict, as before),
    plus what the optimizer's side needs: ``clip_grad_norm_``, ``prepare_step``, ``stats()``, and
    ``rank_state()`` / ``load_rank_state()`` (this rank's error buffers, counters and frozen
    denominators: per rank, see :class:`onebit.checkpoint.RankState`)."""

    def __init__(self, hooks: dict[str, OnebitAllReduceHook], *, optimizer=None,
                 frozen: FrozenAdam | None = None, control_group=None, replicas: int = 1,
                 layouts=None) -> None:
        super().__init__(hooks)
        self.optimizer = optimizer
        self._frozen_adam = frozen
        self.control_group = control_group
        self.replicas = replicas
        self._layouts = layouts or {}  # hook name -> the FSDP parameter group (its parameters' blocks)
        self.bytes_control = 0  # sent by the clip's all-reduces (this rank)
        self._clip = ClipSketch()  # the clip's sketch of each rank's compressed blocks (ALGORITHMS 8.2, 11)
        self._names: dict[int, tuple[int, int]] = {}
        for i, group in enumerate(self._layouts.values()):
            for j, fp in enumerate(group.fsdp_params):
                self._names[id(fp.sharded_param)] = (i, j)
        self._called: set[OnebitAllReduceHook] = set()  # hooks that ran since the optimizer's last step
        if frozen is not None:
            frozen.attach(optimizer, lambda: self._names)
            optimizer.register_step_post_hook(lambda *_: (self._called.clear(), self._clip.begin()))
            for position, (name, hook) in enumerate(self.items()):
                hook._terms = self._make_terms(hook, self._layouts[name], position)

    @property
    def freeze_step(self) -> int | None:
        return None if self._frozen_adam is None else self._frozen_adam.freeze_step

    def _make_terms(self, hook: OnebitAllReduceHook, group, position: int):
        fa, opt = self._frozen_adam, self.optimizer
        groups = {id(p): g for g in opt.param_groups for p in g["params"]}
        # the block's sketch for the clip: one hash per parameter and shard, alike across the replicas (the
        # sum over the mesh's ranks is then the replicas' sum of the mean's sketch, every shard's in one)
        shard = getattr(group.fsdp_params[0].mesh_info, "shard_mesh_rank", 0) if group.fsdp_params else 0

        def terms(block: torch.Tensor):
            if fa.pending and hook in self._called:
                raise RuntimeError(
                    "freeze_step: an FSDP module's hook ran twice before the optimizer's step (gradient "
                    "accumulation that reduces every micro-batch); the momentum terms must enter once per "
                    "step. Skip the reduction on all but the last micro-batch (FSDPModule."
                    "set_requires_all_reduce(False)), or use OnebitAdam, which accumulates locally")
            self._called.add(hook)
            if not fa.frozen:  # the first compressed iteration: the optimizer's state is that of step F
                fa.freeze(opt, self._names)
            fa.add_local(block)
            fa.pending = True
            parts, spans, pieces, offset = [], [], [], 0
            for j, fp in enumerate(group.fsdp_params):
                p = fp.sharded_param
                S = fp.mesh_info.shard_mesh_size
                chunk = -(-p.size(0) // S) * (p.numel() // p.size(0)) if p.dim() and p.size(0) else p.numel()
                n = fp.sharded_size.numel()
                pieces.append(((position, j, shard), offset, n))
                found = groups.get(id(p))
                t = None if found is None else fa.terms(opt, p, self._names.get(id(p)), found)
                if t is not None and n:
                    src, mi, factor = t
                    spans.append((offset, offset + n, _flat_source(src)))
                    parts.append((offset, offset + n, mi.reshape(-1), factor))
                offset += chunk
            if offset != block.numel():
                raise RuntimeError(
                    f"freeze_step: an FSDP module's gradient block has {block.numel()} elements where its "
                    f"parameters' blocks make {offset}; every parameter of a module must get a gradient in "
                    "every step with optimizer= and freeze_step")
            # for the clip's norm: the block as it came, before any pass
            self._clip.add(block, pieces, [fp.sharded_param for fp in group.fsdp_params])
            return Denominators(fa, block.numel(), block.device, spans), parts, _post_division(group, block)

        return terms

    def prepare_step(self) -> None:
        """With ``freeze_step`` and ``optimizer.step(closure)``: call at the end of the closure
        (as ``OnebitCompressHookState.prepare_step``). Does nothing otherwise."""
        if self._frozen_adam is not None:
            self._frozen_adam.prepare(self.optimizer, self._names)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the optimizer's gradients by a norm every rank agrees on; returns it. Full-precision
        iterations: the mean gradient's norm. ``freeze_step``'s compressed iterations: an estimate of
        the same norm from count sketches of each rank's blocks (summed over all the mesh's ranks, one
        all-reduce), because the gradient handed over carries the momentum's 1-bit noise (ALGORITHMS
        8.2, 11; ``onebit.collectives._frozen_adam.clip_agreed``)."""
        return clip_agreed(self.optimizer, self._frozen_adam, max_norm, norm_type, self.control_group,
                           self.replicas, "register_fsdp_hooks was given", self._count_control, self._clip)

    def _count_control(self, numel: int, element_size: int) -> None:
        """The clip's all-reduce over the control group, in ``bytes_control``."""
        size = dist.get_world_size(self.control_group) if dist.is_initialized() else 1
        self.bytes_control += ring_allreduce_bytes(numel, size, element_size)

    def stats(self) -> dict:
        """The hooks' counters summed (``iter`` and ``compressing`` of the first hook)."""
        per = [h.stats() for h in self.values()]
        out = dict(per[0]) if per else {}
        for key in ("bytes_full", "bytes_compressed", "seconds_codec", "seconds_comm", "seconds_full"):
            out[key] = sum(s[key] for s in per)
        out["bytes_control"] = self.bytes_control  # the clip's all-reduces (over the control group)
        return out

    def rank_state(self) -> dict:
        fa = self._frozen_adam
        return {"hooks": {name: h.state_dict() for name, h in self.items()},
                "frozen_adam": None if fa is None else fa.state(), "bytes_control": self.bytes_control,
                "clip": self._clip.state()}

    def load_rank_state(self, state: dict) -> None:
        for name, h in self.items():
            h.load_state_dict(state["hooks"][name])
        self.bytes_control = int(state.get("bytes_control", 0))
        self._clip.load(state.get("clip"))
        if state.get("frozen_adam") is not None:
            if self._frozen_adam is None:
                raise ValueError("state: saved with freeze_step; register the hooks with freeze_step too")
            self._frozen_adam.load(state["frozen_adam"])


def _flat_source(src: tuple) -> tuple:
    """A :meth:`FrozenAdam.source` with its tensor flat (a view where it is contiguous)."""
    return (src[0], src[1].reshape(-1), *src[2:])


def _post_division(group, block: torch.Tensor) -> float | None:
    """The factor FSDP divides the block by after the hook returns (sum reductions on gloo, or a
    float16 reduction: torch 2.13 ``_get_gradient_divide_factors``); None when it divides before."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
    except ImportError:  # pragma: no cover - another torch: FSDP's defaults divide before the hook
        return None
    replicate = getattr(group.mesh_info, "replicate_process_group", None)
    _, post, _, _ = _get_gradient_divide_factors(
        group.mesh_info.shard_process_group, replicate, block.dtype, block.device.type,
        group.gradient_divide_factor, group.force_sum_reduction_for_comms)
    return None if post is None or post == 1 else float(post)


def register_fsdp_hooks(
    model: torch.nn.Module, process_group: dist.ProcessGroup | None = None, start_iter: int = 0,
    block: int | None = HOOK_BLOCK, *, reduce: str = "mean", optimizer: torch.optim.Optimizer | None = None,
    freeze_step: int | None = None, variance_floor: float = 0.1,
    error_dtype: torch.dtype = torch.bfloat16,
) -> FSDPHooks:
    """Give every FSDP module inside ``model`` its own :class:`OnebitAllReduceHook`; returns them
    by module name (an :class:`FSDPHooks`). Modules that manage no parameter of their own (a root
    whose parameters all sit in sharded children) get none: FSDP never calls them.

    ``model`` sharded over a 2-D mesh ``("replicate", "shard")`` (HSDP): ``process_group`` may
    be left out (the mesh's replicate group; FSDP's own all-reduce across replicas is switched
    off). Sharded over a 1-D shard mesh: ``process_group`` is the replicate group (or a 2-D mesh
    of replicas: hierarchical). ``optimizer`` + ``freeze_step``: module docstring. ``error_dtype``: the
    error buffers' (bfloat16 by default, with stochastic rounding: docs/ALGORITHMS.md 12; or float32)."""
    from torch.distributed.fsdp import FSDPModule

    check_instance("model", model, torch.nn.Module, "a torch.nn.Module")
    reduce = check_choice("reduce", reduce, REDUCTIONS)
    sharded = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError("model: expected a module with fully_shard applied (no FSDPModule inside)")
    owned = []
    for name, module in sharded:
        inner = {id(p) for other_name, other in sharded if other is not module
                 and other_name.startswith(f"{name}." if name else "") for p in other.parameters()}
        if not all(id(p) in inner for p in module.parameters()):  # else: manages none of its own
            owned.append((name, module))
    groups = {}
    for name, module in owned:
        found = fsdp_param_groups([module])
        if len(found) != 1:
            raise ValueError(f"model: FSDP module {name!r} has {len(found)} parameter groups; the hooks take "
                             "one per module (one fully_shard call per module, one dtype)")
        groups[name] = found[0]
    hsdp = [g for g in groups.values() if is_hsdp(g)]
    control_group, replicas = None, None
    if hsdp:
        if len(hsdp) != len(groups):
            raise ValueError("model: expected every FSDP module on the same kind of mesh (some are HSDP)")
        replicate = hsdp[0].mesh_info.replicate_process_group
        if process_group is not None and (is_mesh(process_group) or sorted(dist.get_process_group_ranks(
                process_group)) != sorted(dist.get_process_group_ranks(replicate))):
            raise ValueError("process_group: the model is sharded over a 2-D (HSDP) mesh, whose replicate "
                             "group the hooks use; leave process_group out")
        process_group = replicate
        control_group = flat_group(hsdp[0].mesh_info.mesh)
    elif process_group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("process_group: the model is sharded over a 1-D mesh; pass the replicate group "
                         "(the ranks holding the same shard), or shard over a 2-D mesh (\"replicate\", "
                         "\"shard\")")
    replicas = check_group(flat_group(process_group))
    if isinstance(optimizer, (list, tuple)):  # (the DDP hook's state takes several: Muon and its AdamW)
        raise ValueError("optimizer: the FSDP hooks take one Adam-type optimizer with freeze_step, got a "
                         f"list of {len(optimizer)}; torch's Muon steps whole 2-D matrices, not shards")
    optimizer = unwrap_optimizer(optimizer)
    frozen = None
    if optimizer is not None or freeze_step is not None:
        if optimizer is None or freeze_step is None or not is_adam_type(optimizer):
            raise ValueError("optimizer: the FSDP hooks take optimizer= together with freeze_step, for "
                             "torch's Adam-type optimizers (Adam, AdamW): 1-bit Adam's recipe, "
                             f"docs/ALGORITHMS.md 8.2 (got optimizer={type(optimizer).__name__}, "
                             f"freeze_step={freeze_step!r})")
        if hasattr(optimizer, "wants_averaged_gradients"):  # a onebit 1-bit optimizer
            raise ValueError(f"optimizer: {type(optimizer).__name__} compresses its own momentum on HSDP; "
                             "use it without the hooks")
        frozen = FrozenAdam(check_int("freeze_step", freeze_step, low=1),
                            check_number("variance_floor", variance_floor, low=0.0))
        start_iter = frozen.freeze_step
    hooks = {name: OnebitAllReduceHook(process_group, start_iter, block, reduce=reduce,
                                       error_dtype=error_dtype) for name, _ in owned}
    if hsdp:
        ReplicaReduction([m for _, m in owned]).full(False)
    for name, module in owned:
        module.set_all_reduce_hook(hooks[name])
    return FSDPHooks(hooks, optimizer=optimizer, frozen=frozen, control_group=control_group,
                     replicas=replicas, layouts=groups if frozen is not None else None)
