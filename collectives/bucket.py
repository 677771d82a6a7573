"""BucketedReducer: many tensors in flat buckets, 1-bit error feedback per bucket.

Optimizers keep their compressed state (momentum) inside the buckets' flat buffers and
hand out per-tensor views of them, so the compressed all-reduce of a bucket needs no copy.
Full-precision averaging (warm-up gradients) goes through one reusable scratch buffer the
size of the largest bucket, made on the first average and freed where the warm-up ends
(``release_scratch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..kernels import decompress, worker_compress
from ..kernels._checks import check_number
from ..kernels.layout import padded_numel
from ..kernels.rounding import check_error_dtype
from ._failure import guard
from ._group import group_size
from .allreduce import compressed_allreduce, compressed_allreduce_passes
from .hierarchical import intra_bytes, shard_numel
from .mesh import hierarchy
from .telemetry import CallTimer, counting
from .wire import Traffic, ring_allreduce_bytes, traffic

__all__ = ["Bucket", "BucketedReducer", "allreduce_mean_", "plan_buckets"]


def allreduce_mean_(
    tensor: torch.Tensor, group, world_size: int, counter: Traffic | None = None
) -> torch.Tensor:
    """Full-precision mean over the group, in place (sum, then divide by W); counted in
    :data:`traffic` and in ``counter``."""
    timer = CallTimer(tensor.device, counter)
    with timer.stage("full"), guard("full-precision all_reduce", group):
        dist.all_reduce(tensor, group=group)
    traffic.full += ring_allreduce_bytes(tensor.numel(), world_size, tensor.element_size())
    traffic.full_calls += 1
    if counter is not None:
        counter.add_full(tensor.numel(), world_size, tensor.element_size())
    return tensor.div_(world_size)


def plan_buckets(numels: Sequence[int], element_size: int, bucket_cap_mb: float) -> list[list[int]]:
    """Consecutive tensor indices grouped so that each group's bytes stay within the cap.

    ``bucket_cap_mb == 0`` puts every tensor in a bucket of its own; a tensor larger than
    the cap gets a bucket of its own. Empty tensors join whatever bucket is open.
    """
    check_number("bucket_cap_mb", bucket_cap_mb)
    cap = bucket_cap_mb * 2**20
    groups: list[list[int]] = []
    size = 0
    for i, n in enumerate(numels):
        nbytes = n * element_size
        if not groups or bucket_cap_mb == 0 or (size + nbytes > cap and size > 0):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


@dataclass
class Bucket:
    indices: list[int]
    offsets: list[int]
    numels: list[int]
    n: int  # elements of the tensors in the bucket
    # float32 [n], or [N] with the padding: what is compressed (momentum); None while the bucket is
    # kept as ``message``
    flat: torch.Tensor | None
    worker_error: torch.Tensor  # float32 or bfloat16 (error_dtype) [N]
    server_error: torch.Tensor  # the same dtype, [N / W]
    views: list[torch.Tensor] = field(default_factory=list)
    # (gathered, layout): the last compressed all-reduce's gathered message, which decodes to what
    # ``flat`` held after it (sign times its chunk's scale), kept instead of ``flat``
    message: tuple | None = None

    @property
    def numel(self) -> int:
        return self.n


class _KeepMessage:
    """The passes of a plain compressed all-reduce (``worker_compress`` and ``decompress``, what the
    collective runs without passes) that keep the gathered message (and its layout) for the caller."""

    def __init__(self) -> None:
        self.gathered = self.layout = None

    def worker(self, flat, worker_error, layout, msg) -> None:
        worker_compress(flat, worker_error, layout.W, update_error=False, out=msg, block=layout.block)

    def finish(self, gathered, layout, flat, worker_error, msg) -> None:
        decompress(gathered, flat, layout.W, worker_error=worker_error, worker_message=msg,
                   block=layout.block)
        self.gathered, self.layout = gathered, layout


class BucketedReducer:
    """Flat float32 buckets over tensors of the given shapes, all on ``device``.

    ``views[i]`` is tensor i's slice of its bucket, shaped like it. ``compressed_mean_()``
    replaces every bucket by its 1-bit mean over ``group`` (with error feedback);
    ``keep_as_message(b, gathered, layout)`` keeps bucket ``b``'s values as that mean's message
    instead (its float buffer freed: 1/32 of the bytes), and reading ``views`` decodes every
    bucket so kept back into a float buffer (``materialise``; ``on_materialise``, if set, is called
    after, ``on_release(b)`` where a bucket's buffer was freed: the owner rebinds its state);
    ``average(b, tensors)`` returns the full-precision mean over the group of tensors laid
    out like bucket ``b`` (a view of the scratch buffer, valid until the next call).

    With ``flat_padding`` the flat buffers include the padding to N, which is then
    compressed as data and keeps what the previous call left there (1-bit LAMB's
    reference behaviour); otherwise the padding is implicit zeros. ``block``: block scales
    for every compressed all-reduce (see compressed_allreduce). ``error_dtype``: the error
    buffers' (float32, or bfloat16 stored with stochastic rounding:
    onebit.kernels.rounding). ``traffic`` counts the bytes
    this reducer's calls send (the owning optimizer's counter).
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        device: torch.device,
        *,
        group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        flat_padding: bool = False,
        block: int | None = None,
        traffic: Traffic | None = None,
        mesh=None,
        error_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.group = group
        self.error_dtype = check_error_dtype(error_dtype)
        # a 2-D mesh: the compressed all-reduces are hierarchical (full-precision averaging
        # stays on ``group``, all the mesh's ranks); error buffers sized for this rank's shard
        self.mesh = mesh
        self.hierarchy = None if mesh is None else hierarchy(mesh)
        self.traffic = Traffic() if traffic is None else traffic
        self.block = block
        self.flat_padding = flat_padding
        self.world_size = group_size(group)
        self.shapes = [torch.Size(s) for s in shapes]
        numels = [s.numel() for s in self.shapes]
        self.buckets: list[Bucket] = []
        self._views: list[torch.Tensor | None] = [torch.empty(0)] * len(numels)
        self.on_release = self.on_materialise = None  # the owner's callbacks (the optimizer's state)
        W = self.world_size
        for indices in plan_buckets(numels, 4, bucket_cap_mb):
            sizes = [numels[i] for i in indices]
            offsets = [sum(sizes[:k]) for k in range(len(sizes))]
            n = sum(sizes)
            length = padded_numel(n, W, block) if flat_padding else n  # what is compressed
            if self.hierarchy is None:
                N, servers = padded_numel(n, W, block), W
            else:
                h = self.hierarchy
                N, servers = padded_numel(shard_numel(length, h.per_node), h.nodes, block), h.nodes
            flat = torch.zeros(length, dtype=torch.float32, device=device)
            bucket = Bucket(
                indices, offsets, sizes, n, flat,
                torch.zeros(N, dtype=self.error_dtype, device=device),
                torch.zeros(N // servers, dtype=self.error_dtype, device=device),
            )
            for i, off, size in zip(indices, offsets, sizes, strict=True):
                view = flat[off : off + size].view(self.shapes[i])
                bucket.views.append(view)
                self._views[i] = view
            self.buckets.append(bucket)
        self._largest = max((b.numel for b in self.buckets), default=0)
        self._device = device
        # The collective compressed_mean_ calls, compressed_allreduce's signature; a benchmark
        # may set a local one (see bench/bench_optimizer.py) to time the compute alone.
        self.allreduce = compressed_allreduce
        self._scratch: torch.Tensor | None = None  # made by average, freed by release_scratch

    @property
    def device(self) -> torch.device:
        return self._device

    def __setstate__(self, state: dict) -> None:
        """Unpickled (or deep-copied): the buckets' views made again over their buffers (plain pickle
        gives a view a storage of its own, so writes through it would no longer reach the buffer that the
        compressed all-reduce reads)."""
        self.__dict__.update(state)
        for b in self.buckets:
            if b.flat is None:
                continue
            b.views = [b.flat[off : off + size].view(self.shapes[i])
                       for i, off, size in zip(b.indices, b.offsets, b.numels, strict=True)]
            for i, view in zip(b.indices, b.views, strict=True):
                self._views[i] = view

    @property
    def views(self) -> list[torch.Tensor]:
        """Tensor i's slice of its bucket (every bucket kept as a message decoded first, every released
        one made again, zero)."""
        if any(b.flat is None for b in self.buckets):
            self.materialise()
        return self._views

    def keep_as_message(self, bucket: Bucket, gathered: torch.Tensor, layout) -> None:
        """Keep ``bucket``'s values as ``gathered`` (the compressed all-reduce's gathered message
        that its float buffer now holds decoded, of ``layout``; with ``flat_padding`` the padding too)
        and free that buffer."""
        if layout.N != bucket.worker_error.numel():
            raise ValueError(f"keep_as_message: expected a message of {bucket.worker_error.numel()} "
                             f"elements, got {layout.N}")
        bucket.message, bucket.flat, bucket.views = (gathered, layout), None, []
        for i in bucket.indices:
            self._views[i] = None
        if self.on_release is not None:
            self.on_release(bucket)

    def release(self, bucket: Bucket) -> None:
        """Free ``bucket``'s float buffer, whose values are all zero (a scratch buffer between steps:
        ZeroOneAdam's accumulator); reading the views makes it again, zero (``on_release`` as for
        :meth:`keep_as_message`)."""
        bucket.message, bucket.flat, bucket.views = None, None, []
        for i in bucket.indices:
            self._views[i] = None
        if self.on_release is not None:
            self.on_release(bucket)

    def decoded(self, bucket: Bucket, out: torch.Tensor | None = None) -> torch.Tensor:
        """``bucket``'s values as float32 [n]: its buffer, or its message decoded into ``out`` (a new
        tensor where None): the decode is exactly the buffer the all-reduce left (zeros: a released
        bucket)."""
        if bucket.message is None and bucket.flat is not None:
            return bucket.flat[: bucket.n]
        if out is None:
            out = torch.empty(bucket.n, dtype=torch.float32, device=self._device)
        return self._decode(bucket, out)

    def _decode(self, bucket: Bucket, out: torch.Tensor) -> torch.Tensor:
        """The first ``out.numel()`` values of ``bucket``'s kept message (a released one's zeros), into
        ``out``."""
        if bucket.message is None:
            return out.zero_()
        gathered, layout = bucket.message
        if out.numel():
            decompress(gathered, out, layout.W, padded=layout.N, block=layout.block)
        return out

    def materialise(self) -> None:
        """Every bucket kept as a message (or released) back in a float buffer of its own (its views
        made again), then ``on_materialise``."""
        done = False
        for b in self.buckets:
            if b.flat is not None:
                continue
            flat = self._decode(b, torch.empty(self._length(b), dtype=torch.float32, device=self._device))
            b.flat, b.message, done = flat, None, True
            for i, off, size in zip(b.indices, b.offsets, b.numels, strict=True):
                view = flat[off : off + size].view(self.shapes[i])
                b.views.append(view)
                self._views[i] = view
        if done and self.on_materialise is not None:
            self.on_materialise()

    def _length(self, bucket: Bucket) -> int:
        """The length of ``bucket``'s float buffer: ``n``, or with ``flat_padding`` the padded N."""
        return padded_numel(bucket.n, self.world_size, self.block) if self.flat_padding else bucket.n

    def flat_tail(self, bucket: Bucket) -> torch.Tensor:
        """The padding part of ``bucket``'s buffer (data with ``flat_padding``; empty otherwise); of a
        bucket kept as a message, a new tensor decoded from it."""
        if bucket.flat is None:
            if not self.flat_padding:
                return torch.empty(0, dtype=torch.float32, device=self._device)
            full = torch.empty(self._length(bucket), dtype=torch.float32, device=self._device)
            return self._decode(bucket, full)[bucket.n :]
        return bucket.flat[bucket.n :]

    def can_keep(self) -> bool:
        """Whether :meth:`compressed_mean_` can return the calls' messages (``keep=True``): the
        collective's own compressed all-reduce (not a benchmark's) on a process group, not a mesh."""
        return self.mesh is None and self.allreduce is compressed_allreduce and self.world_size > 1

    def compressed_mean_(self, keep: bool = False) -> list | None:
        """Each bucket's flat buffer <- its 1-bit mean over the group (one call per bucket). With
        ``keep`` (where :meth:`can_keep`), returns each bucket's ``(gathered, layout)``, its call's
        gathered message, which decodes to exactly what the buffer now holds: the caller may
        :meth:`keep_as_message` it once it has read the buffer."""
        group = self.compress_group
        self.materialise()
        if keep and not self.can_keep():
            raise ValueError("keep: the calls' messages are kept on a process group of W > 1 with the "
                             "collective's own compressed all-reduce only (can_keep())")
        kept = []
        for b in self.buckets:
            with counting(self.traffic):  # the call's seconds (telemetry) go to this counter too
                if keep and b.flat.numel() == 0:
                    kept.append(None)
                elif keep:
                    passes = _KeepMessage()
                    compressed_allreduce_passes(b.flat, b.worker_error, b.server_error, group, passes,
                                                block=self.block)
                    kept.append((passes.gathered, passes.layout))
                elif self.block is None:  # the signature a benchmark's local allreduce may have
                    self.allreduce(b.flat, b.worker_error, b.server_error, group)
                else:
                    self.allreduce(b.flat, b.worker_error, b.server_error, group, block=self.block)
            self.count_compressed(b)
        return kept if keep else None

    @property
    def compress_group(self):
        """What the compressed all-reduces run on: the mesh, or the process group."""
        return self.group if self.mesh is None else self.mesh

    def count_compressed(self, bucket: Bucket) -> None:
        """Count one compressed all-reduce of ``bucket`` in this reducer's traffic (on a mesh:
        the 1-bit bytes between nodes, and the full-precision bytes inside the node)."""
        h = self.hierarchy
        if h is None:
            self.traffic.add_compressed(bucket.worker_error.numel(), self.world_size, self.block)
            return
        if h.nodes > 1:
            self.traffic.add_compressed(bucket.worker_error.numel(), h.nodes, self.block)
        s = shard_numel(bucket.flat.numel(), h.per_node)
        self.traffic.intra += intra_bytes(s, h)

    def average(
        self, bucket: Bucket, tensors: Sequence[torch.Tensor | None], communicate: bool = True,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Full-precision mean over the group of ``tensors`` (one per index of ``bucket``;
        None counts as zeros), as a flat float32 view of the scratch buffer (``out``: of that buffer,
        float32 of at least ``bucket.numel`` elements, instead). Without ``communicate`` the tensors
        are taken as already averaged (a DDP hook did it)."""
        if out is not None:
            out = out[: bucket.numel]
        else:
            if self._scratch is None:
                self._scratch = torch.empty(self._largest, dtype=torch.float32, device=self._device)
            out = self._scratch[: bucket.numel]
        dst, src = [], []
        for t, off, size in zip(tensors, bucket.offsets, bucket.numels, strict=True):
            if t is None:
                out[off : off + size].zero_()
            else:
                dst.append(out[off : off + size])
                src.append(t.reshape(-1))
        if dst:  # one multi-tensor copy (a GPU: a few launches for the bucket, not one per tensor)
            torch._foreach_copy_(dst, src)
        if communicate and self.world_size > 1 and bucket.numel:
            allreduce_mean_(out, self.group, self.world_size, self.traffic)
        return out

    def release_scratch(self) -> None:
        """Free :meth:`average`'s buffer (as large as the largest bucket), which only the warm-up's
        full-precision steps use; the next :meth:`average` (a checkpoint from the warm-up loaded)
        makes it again."""
        self._scratch = None

    def reset_errors(self) -> None:
        for b in self.buckets:
            b.worker_error.zero_()
            b.server_error.zero_()

    def signature(self) -> list[list[int]]:
        """Bucket layout (tensor sizes per bucket): error buffers only fit the same layout."""
        return [list(b.numels) for b in self.buckets]

    def errors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(b.worker_error, b.server_error) for b in self.buckets]
