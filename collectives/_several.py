"""Several optimizers behind one hook state (issue 59): Muon steps a model's hidden matrices and an AdamW
the rest (embeddings, norms, biases, the output head), so the DDP hook reads each parameter's state from
the optimizer that steps it. :class:`Several` shows the hook what it reads of one optimizer (its groups,
its per-parameter state) over all of them, and which member owns a group."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import torch

from ..kernels._checks import check_instance
from ._unwrap import unwrap_optimizer


class Several:
    """Optimizers stepping disjoint parameters of one model, read as one by the hooks: ``param_groups``
    (every member's, in order), ``state`` (each parameter's entry in its own optimizer's state) and
    :meth:`owner`. Not an optimizer: each member keeps its own ``step()``, ``zero_grad()`` and
    ``state_dict()``."""

    def __init__(self, members: list[torch.optim.Optimizer]) -> None:
        self.members = tuple(members)
        self._owners: dict[int, torch.optim.Optimizer] = {}  # id(parameter) -> its member (remade on a miss)
        self._count = -1  # the members' parameters when the map was made
        seen: dict[int, int] = {}
        for k, opt in enumerate(self.members):
            for g in opt.param_groups:
                for p in g["params"]:
                    if seen.setdefault(id(p), k) != k:
                        raise ValueError(
                            f"optimizer: a parameter of shape {tuple(p.shape)} is stepped by both "
                            f"{type(self.members[seen[id(p)]]).__name__} and {type(opt).__name__}; "
                            "expected optimizers over disjoint parameters")

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.members for g in opt.param_groups]

    @property
    def state(self) -> _State:
        return _State(self)

    def owner_of(self, p: torch.Tensor) -> torch.optim.Optimizer | None:
        """The member whose groups hold ``p`` (None: none)."""
        opt = self._owners.get(id(p))
        if opt is None:  # not seen: the map made again where the members' parameters changed
            count = sum(len(g["params"]) for o in self.members for g in o.param_groups)
            if count != self._count:
                self._owners = {id(q): o for o in self.members for g in o.param_groups for q in g["params"]}
                self._count = count
                opt = self._owners.get(id(p))
        return opt

    def owner(self, group: dict) -> torch.optim.Optimizer:
        """The member whose ``param_groups`` hold ``group`` (compared by identity)."""
        for opt in self.members:
            if any(g is group for g in opt.param_groups):
                return opt
        raise KeyError("group: not a group of these optimizers")

    def __repr__(self) -> str:
        return f"Several({', '.join(type(o).__name__ for o in self.members)})"


class _State(MutableMapping):
    """``Several.state``: a mapping over the members' states, each parameter's entry taken from its own
    optimizer (``items()``, ``keys()``, ``values()`` as a torch optimizer's ``state`` has them: what
    frameworks walk, Lightning's move to the device for one). ``state[p]`` of a member's parameter is
    that member's ``state[p]`` (a ``defaultdict``: an empty entry where it has none yet, as torch's),
    set and deleted there too; of a parameter no member holds, a KeyError."""

    def __init__(self, several: Several) -> None:
        self._several = several

    def get(self, p, default=None):
        opt = self._several.owner_of(p)
        if opt is None or p not in opt.state:
            return default
        return opt.state[p]

    def _owner(self, p) -> torch.optim.Optimizer:
        opt = self._several.owner_of(p)
        if opt is None:
            raise KeyError("a parameter of none of the optimizers here")
        return opt

    def __getitem__(self, p):
        return self._owner(p).state[p]

    def __setitem__(self, p, entry) -> None:
        self._owner(p).state[p] = entry

    def __delitem__(self, p) -> None:
        del self._owner(p).state[p]

    def __contains__(self, p) -> bool:
        return self.get(p) is not None

    def __iter__(self) -> Iterator:
        for opt in self._several.members:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._several.members)


def owner(optimizer, group: dict):
    """The optimizer that owns ``group``: ``optimizer`` itself, or the member of a :class:`Several`."""
    return optimizer.owner(group) if isinstance(optimizer, Several) else optimizer


def combine(optimizer):
    """The hooks' ``optimizer=``: None, one optimizer, or a list (tuple) of them over disjoint parameters
    (a :class:`Several`; a list of one: that one), or a :class:`onebit.optimizers.Combined` (its
    members, the same); each unwrapped from a framework's wrapper."""
    if isinstance(optimizer, (list, tuple)):
        members = [unwrap_optimizer(o) for o in optimizer]
        for o in members:
            check_instance("optimizer", o, torch.optim.Optimizer, "a torch.optim.Optimizer or a list of them")
        if len(members) > 1:
            return Several(members)
        return members[0] if members else None
    optimizer = unwrap_optimizer(optimizer)
    several = getattr(optimizer, "_several", None)  # onebit.optimizers.Combined: read as its members
    if isinstance(several, Several):
        return several if len(several.members) > 1 else several.members[0]
    if optimizer is not None:
        check_instance("optimizer", optimizer, torch.optim.Optimizer,
                       "a torch.optim.Optimizer or a list of them")
    return optimizer


def members(optimizer) -> tuple:
    """The optimizers behind ``optimizer`` (None: none)."""
    if optimizer is None:
        return ()
    return optimizer.members if isinstance(optimizer, Several) else (optimizer,)
