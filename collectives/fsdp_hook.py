"""FSDP2 with 1-bit compression between replica groups (HSDP-style).

    from onebit.collectives import register_fsdp_hooks
    mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    hooks = register_fsdp_hooks(model, mesh.get_group("replicate"))

Each FSDP module reduce-scatters its gradients in full precision inside its shard group (fast
links, e.g. one node); the hook then averages that gradient shard across the replica group
(the slow links) with ``compressed_allreduce``, with worker and server error buffers of its
own, one hook per FSDP module. FSDP applies its own division by the shard group's size
afterwards, so the result is the average over all ranks, as native HSDP gives it.

Limits: FSDP calls the hook synchronously and expects the reduced shard in place when it
returns, so on gloo the compressed all-reduce blocks the backward pass for its duration (on
CUDA it is queued on FSDP's all-reduce stream, which is what overlaps with backward). The
mesh must be 1-D in FSDP's eyes (``mesh["shard"]``): with a 2-D mesh FSDP would all-reduce
across replicas itself, in full precision, before calling the hook. Gradient accumulation
with ``set_requires_all_reduce(False)`` skips the hook on the accumulating steps, as it skips
FSDP's own all-reduce. It compresses gradients, as the DDP hook does: see that module's
note on which optimizers and learning rates suit gradient compression.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels._checks import check_group, check_instance, check_int
from ..kernels.layout import check_block
from .allreduce import compressed_allreduce, error_buffer_numel
from .ddp_hook import HOOK_BLOCK
from .mesh import flat_group, hierarchy, is_mesh
from .telemetry import CallTimer, counting
from .wire import Traffic, compressed_bytes, ring_allreduce_bytes

__all__ = ["OnebitAllReduceHook", "register_fsdp_hooks"]


class OnebitAllReduceHook:
    """``hook(reduce_output)`` for ``FSDPModule.set_all_reduce_hook``: averages the gradient
    shard over ``process_group`` (the replica group) in place, with 1-bit compression after
    ``start_iter`` full-precision calls.

    ``block``: elements per scale (see ``OnebitCompressHookState``; default 64). ``state_dict()`` /
    ``load_state_dict()`` checkpoint the error buffers and counters. ``process_group`` may be a
    2-D DeviceMesh of the replicas (nodes x replicas per node): the compressed calls are then
    hierarchical, 1-bit between nodes only.
    """

    def __init__(self, process_group: dist.ProcessGroup | None, start_iter: int = 0,
                 block: int | None = HOOK_BLOCK) -> None:
        self._mesh = process_group if is_mesh(process_group) else None
        process_group = flat_group(process_group)
        self.process_group = process_group
        self.world_size = check_group(process_group)
        self.start_iter = check_int("start_iter", start_iter)
        self.block = check_block(block)
        self.iter = 0
        self.worker_error: torch.Tensor | None = None
        self.server_error: torch.Tensor | None = None
        self.bytes_full = 0
        self.bytes_compressed = 0
        self._timing = Traffic()  # seconds in compute and communication (telemetry; not saved)

    def __call__(self, reduce_output: torch.Tensor) -> None:
        W = self.world_size
        compressing = self.iter >= self.start_iter
        if W > 1 and not compressing:
            group = self.process_group if self.process_group is not None else dist.group.WORLD
            with CallTimer(reduce_output.device, self._timing).stage("full"):
                dist.all_reduce(reduce_output, group=group)
            reduce_output.div_(W)
            self.bytes_full += ring_allreduce_bytes(reduce_output.numel(), W, reduce_output.element_size())
        elif W > 1:
            group = self.process_group if self._mesh is None else self._mesh
            N = error_buffer_numel(reduce_output.numel(), group, self.block)
            servers = W if self._mesh is None else hierarchy(self._mesh).nodes
            if self.worker_error is None or self.worker_error.numel() != N:
                if self.worker_error is not None:
                    raise ValueError(f"reduce_output: expected {self.worker_error.numel()} elements padded "
                                     f"as before, got {reduce_output.numel()} (one hook per FSDP module)")
                self.worker_error = torch.zeros(N, device=reduce_output.device)
                self.server_error = torch.zeros(N // servers, device=reduce_output.device)
            with counting(self._timing):
                compressed_allreduce(reduce_output, self.worker_error, self.server_error, group,
                                     block=self.block)
            self.bytes_compressed += compressed_bytes(N, servers, self.block) if servers > 1 else 0
        self.iter += 1

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
        servers = self.world_size if self._mesh is None else hierarchy(self._mesh).nodes
        if (worker is None) != (server is None) or (
                worker is not None and server.numel() * servers != worker.numel()):
            raise ValueError("state: expected both error buffers, the server's 1/world_size (on a mesh: "
                             "1/nodes) of the worker's")
        self.iter, self.start_iter = int(state["iter"]), int(state["start_iter"])
        self.bytes_full, self.bytes_compressed = int(state["bytes_full"]), int(state["bytes_compressed"])
        self.worker_error = None if worker is None else worker.clone()
        self.server_error = None if server is None else server.clone()


def register_fsdp_hooks(
    model: torch.nn.Module, process_group: dist.ProcessGroup | None, start_iter: int = 0,
    block: int | None = HOOK_BLOCK,
) -> dict[str, OnebitAllReduceHook]:
    """Give every FSDP module inside ``model`` (``fully_shard`` applied with the shard mesh)
    its own :class:`OnebitAllReduceHook` over ``process_group``; returns them by module name.
    Modules that manage no parameter of their own (a root whose parameters all sit in sharded
    children) get none: FSDP never calls them."""
    from torch.distributed.fsdp import FSDPModule

    check_instance("model", model, torch.nn.Module, "a torch.nn.Module")
    check_group(flat_group(process_group))
    hooks = {}
    sharded = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError("model: expected a module with fully_shard applied (no FSDPModule inside)")
    for name, module in sharded:
        inner = {id(p) for other_name, other in sharded if other is not module
                 and other_name.startswith(f"{name}." if name else "") for p in other.parameters()}
        if all(id(p) in inner for p in module.parameters()):
            continue  # manages no parameter of its own (e.g. a root over sharded blocks): never called
        hooks[name] = OnebitAllReduceHook(process_group, start_iter, block)
        module.set_all_reduce_hook(hooks[name])
    return hooks
