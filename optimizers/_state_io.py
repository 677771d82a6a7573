"""A 1-bit optimizer's state dict: the ``"onebit"`` entry (this rank's error buffers, bucket
layout, rank, world size, counters), loading that puts the buckets' views back, DTensor state for
DCP, and ``rank_state()`` for :class:`onebit.checkpoint.RankState`. A mixin of
:class:`~onebit.optimizers._base.OnebitOptimizerBase` (whose module docstring describes the layout).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives.wire import Traffic
from ._sharded import to_local


class StateIO:
    """state_dict's extra entry, the stash-and-restore around ``load_state_dict`` (module docstring)."""

    # -- state_dict -----------------------------------------------------------------
    def _rank(self) -> int:
        if self._control_size() == 1 or not dist.is_initialized():
            return 0
        return dist.get_rank(self.control_group)

    def _control_size(self) -> int:
        """Ranks that agree on every step: the group's, or all the mesh's with DTensor parameters."""
        return self.world_size if self._sharding is None else dist.get_world_size(self.control_group)

    def _mesh_shape(self) -> list[int] | None:
        """[nodes, ranks per node] on a 2-D mesh (the error buffers' layout), else None."""
        h, sharding = self.hierarchy, self._sharding
        if sharding is not None:  # HSDP: [replicas, shards]
            return [sharding.replicas, sharding.shards]
        return None if h is None else [h.nodes, h.per_node]

    def _add_extra_state(self, state_dict: dict) -> dict:
        reducer = self.reducer()
        state_dict["onebit"] = self._extra_entry()
        params = [p for g in self.param_groups for p in g["params"]]
        self._add_kept_momenta(state_dict, reducer, params)
        if self._cohorts:  # groups added after the first update (optimizers/_cohorts.py)
            state_dict["onebit"]["cohorts"] = self._cohort_entries(state_dict, params)
        self._widen_variance(state_dict)
        sharding = self._sharding
        if sharding is not None:  # DTensor parameters: their state as DTensors (what DCP saves per slice)
            for key, entry in list(state_dict["state"].items()):
                entry = state_dict["state"][key] = dict(entry)  # torch's entry is self.state's own dict
                for name in self.FLAT_STATE + self.DENSE_STATE:
                    if name in entry:  # bucket views cloned: torch.save fails on DTensors over views
                        local = entry[name].clone() if name in self.FLAT_STATE else entry[name]
                        entry[name] = sharding.wrap(local, params[key])
        return state_dict

    def _widen_variance(self, state_dict: dict) -> None:
        """A variance stored narrower than float32 (``variance_dtype``) as a new float32 tensor in the
        state dict (exact): a checkpoint holds float32 whatever the setting, as before it existed."""
        name = self.VARIANCE_STATE
        for key, entry in list(state_dict["state"].items()):
            v = entry.get(name)
            if isinstance(v, torch.Tensor) and v.dtype != torch.float32:
                entry = state_dict["state"][key] = dict(entry)  # torch's entry is self.state's own dict
                entry[name] = v.float()

    def _extra_entry(self) -> dict:
        """This optimizer's own part of the ``"onebit"`` entry (a cohort's too)."""
        reducer = self.reducer()
        return {
            "rank": self._rank(),
            "world_size": self.world_size,
            "mesh": self._mesh_shape(),
            "buckets": reducer.signature(),
            "worker_errors": [we for we, _ in reducer.errors()],
            "server_errors": [se for _, se in reducer.errors()],
            # with FLAT_PADDING the padding is data the next call compresses
            "flat_tails": [reducer.flat_tail(b) for b in reducer.buckets],
            "counters": {name: getattr(self, name) for name in self.COUNTERS + ("skipped_steps",)},
            "traffic": self.traffic.state(),
        }

    def _add_kept_momenta(self, state_dict: dict, reducer, params: list) -> None:
        """The flat state of the buckets kept as messages (``BucketedReducer.keep_as_message``: not in
        ``self.state`` then), decoded into new tensors: a checkpoint holds it as float32 either way.
        ``params``: every parameter of the state dict, in its order (the root's, cohorts included)."""
        kept = [b for b in reducer.buckets if b.message is not None]
        if not kept or "param_groups" not in state_dict:  # (rank_state: no per-parameter state)
            return
        (flat_name,) = self.FLAT_STATE
        key_of = {id(p): key for key, p in enumerate(params)}
        pairs = self.compressed_params()
        for b in kept:
            flat = reducer.decoded(b)
            for i, off, size in zip(b.indices, b.offsets, b.numels, strict=True):
                key = key_of[id(pairs[i][0])]
                entry = dict(state_dict["state"].get(key, {}))  # torch's entry is self.state's own dict
                entry[flat_name] = flat[off : off + size].view(reducer.shapes[i])
                state_dict["state"][key] = entry

    def _stash_loaded_state(self, state_dict: dict) -> dict:
        self._resolve_device_agreement()  # a skip agreed on the device belongs to the state being replaced
        self._counts = None  # (a capturable step's: made again from the loaded counters)
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        # masks are configuration: the ones given at construction win over a checkpoint
        masks = [g.get("exp_avg_mask") for g in self.param_groups]
        tensors = {}
        new_state = {}
        # keys are the saved param_groups' ids: positions, or names (torch's DCP helpers use FQNs)
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        position = {key: i for i, key in enumerate(saved)}
        for key, entry in state_dict["state"].items():
            entry = dict(entry)
            names = self.FLAT_STATE + self.DENSE_STATE + tuple(self.SCALAR_STATE)
            tensors[position[key]] = {n: to_local(entry.pop(n)) for n in names if n in entry}
            new_state[key] = entry
        state_dict["state"] = new_state
        self._pending = {"extra": extra, "tensors": tensors, "masks": masks}
        return state_dict

    def _restore_loaded_state(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        self._variance_changed()  # masks are a function of the loaded variance
        for g, mask in zip(self.param_groups, pending["masks"], strict=True):
            g["exp_avg_mask"] = mask
        params = [p for g in self.param_groups for p in g["params"]]
        extra = pending["extra"]
        if extra is None:  # DCP's optimizer state keeps no "onebit" entry: RankState brought this rank's
            extra = self._rank_state_loaded
        self._rank_state_loaded = None
        self._mark_cohorts(extra)  # (DCP loads no group key the target lacks: the cohorts' groups from extra)
        self._regroup()  # the cohorts the loaded groups name (optimizers/_cohorts.py)
        self.reducer()
        self._bind_state()  # torch replaced self.state: the buckets' views go back in
        for key, values in pending["tensors"].items():
            p = params[key]
            state = self.state[p]
            for name, value in values.items():
                current = state.get(name)
                narrowed = current is not None and current.dtype != value.dtype  # a variance stored narrower
                if current is not None and not narrowed:  # (replaced: float32, narrowed after the counters)
                    current.copy_(value)  # a view into a bucket, or a dense buffer
                else:
                    dtype = torch.float64 if name in self.SCALAR_STATE else torch.float32
                    state[name] = value.to(device=p.device, dtype=dtype).clone()
        self._apply_rank_state(extra)
        self._restore_cohorts(None if extra is None else extra.get("cohorts"))

    def rank_state(self) -> dict:
        """This rank's own part of the state (error buffers, bucket layout, counters): the
        ``"onebit"`` entry of ``state_dict()``, which torch's and torchtitan's DCP helpers drop.
        :class:`onebit.checkpoint.RankState` saves it in a DCP checkpoint."""
        return self._add_extra_state({"state": {}})["onebit"]

    def load_rank_state(self, extra: dict) -> None:
        """Restore :meth:`rank_state` now, and again at the next ``load_state_dict`` whose state
        has no ``"onebit"`` entry (torch's ``set_optimizer_state_dict`` loads one after DCP)."""
        self._resolve_device_agreement()
        self._counts = None
        self._apply_rank_state(extra)
        if self._cohorts:
            self._restore_cohorts(extra.get("cohorts"))
        self._rank_state_loaded = extra

    def _apply_rank_state(self, extra: dict | None) -> None:
        reducer = self.reducer()
        same = (
            extra is not None
            and extra.get("rank") == self._rank()
            and extra.get("world_size") == self.world_size
            and extra.get("mesh") == self._mesh_shape()
            and extra.get("buckets") == reducer.signature()
        )
        if same:
            for (we, se), we_saved, se_saved in zip(
                reducer.errors(), extra["worker_errors"], extra["server_errors"], strict=True
            ):
                we.copy_(we_saved)
                se.copy_(se_saved)
            for b, tail in zip(reducer.buckets, extra.get("flat_tails", []), strict=False):
                reducer.flat_tail(b).copy_(tail)
            # this rank's own state, loaded after another's (a framework's rank-0 checkpoint, then
            # onebit's per-rank file): nothing foreign is left to report
            self._foreign_state = False
        else:
            reducer.reset_errors()
            for b in reducer.buckets:
                reducer.flat_tail(b).zero_()
            self._foreign_state = True  # said once for the group at the next step (_say_foreign_state)
        if extra is not None:
            for name, value in extra.get("counters", {}).items():
                setattr(self, name, value)
            if "traffic" in extra:  # (a cohort's entry has none: counted with the root's)
                self.traffic = Traffic(**extra["traffic"])
                reducer.traffic = self.traffic
        if self._sharding is not None:  # the loaded counters decide FSDP's next reduction
            self._sharding.reduction.full(self.wants_averaged_gradients())
        self._narrow_variance()  # the loaded counters say whether the loaded variance is frozen
