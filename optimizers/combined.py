"""Several optimizers as one ``torch.optim.Optimizer`` (issue 59): Muon steps a model's hidden matrices and
an AdamW the rest (embeddings, norms, biases, the output head), but the HF Trainer, Lightning's
``configure_optimizers``, DiLoCo's inner optimizer and torch's LR schedulers take one optimizer object.

``Combined([muon, adamw])`` is that object: ``param_groups`` is every member's groups in order (the same
dicts: a scheduler that sets ``group["lr"]`` sets the member's), ``state`` each parameter's entry in its
own member's state, ``step()`` steps each member in order, ``zero_grad()`` each member's, and the state
dict holds each member's. The hooks given a ``Combined`` read it as the list of its members
(``OnebitCompressHookState(optimizer=combined)`` is ``optimizer=[muon, adamw]``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..collectives._several import Several, _State
from ..collectives._unwrap import unwrap_optimizer
from ..kernels._checks import check_instance

__all__ = ["Combined"]


class Combined(torch.optim.Optimizer):
    """``optimizers`` (torch.optim.Optimizer instances over disjoint parameters; a framework's wrapper is
    unwrapped) stepped as one optimizer. Groups are added to a member
    (``combined.members[k].add_param_group``), not to the combination."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        if isinstance(optimizers, torch.optim.Optimizer):
            raise TypeError("optimizers: expected a list of torch.optim.Optimizer, got one optimizer")
        members = [unwrap_optimizer(o) for o in optimizers]
        for o in members:
            check_instance("optimizers", o, torch.optim.Optimizer, "a list of torch.optim.Optimizer")
        if not members:
            raise ValueError("optimizers: expected at least one optimizer, got none")
        if any(isinstance(o, Combined) for o in members):
            raise TypeError("optimizers: expected plain optimizers, got a Combined among them (pass its "
                            "members instead)")
        self._several = Several(members)  # refuses a parameter that two members step
        self._building = True
        super().__init__([{"params": []}], {})  # the base's hooks and flags; the groups are the members'
        self._building = False

    @property
    def members(self) -> tuple[torch.optim.Optimizer, ...]:
        return self._several.members

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every member's groups, in order (the members' own dicts)."""
        return self._several.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        if not self._building:
            raise AttributeError("param_groups: a Combined's groups are its members'; set them there")

    @property
    def state(self) -> _State:  # type: ignore[override]
        """Each parameter's entry in its own member's state (a mapping over the members' states)."""
        return self._several.state

    @state.setter
    def state(self, value) -> None:
        if not self._building:
            raise AttributeError("state: a Combined's state is its members'; set it there")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._building:
            return
        raise TypeError("add_param_group: add the group to one of the members "
                        "(combined.members[k].add_param_group(group)): which optimizer steps it is the "
                        "caller's choice")

    def step(self, closure=None):
        """Each member's ``step()`` in order; ``closure`` (if given) evaluated once, first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.members:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.members:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{"members": [each member's state_dict()]}``."""
        return {"members": [opt.state_dict() for opt in self.members]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each member's from :meth:`state_dict`'s (the same members, in the same order). Checked whole
        before any member loads."""
        got = state_dict.get("members") if isinstance(state_dict, dict) else None
        names = ", ".join(type(o).__name__ for o in self.members)
        if not isinstance(got, list) or len(got) != len(self.members):
            raise ValueError(f"state_dict: expected a Combined's state_dict with {len(self.members)} members "
                             f"({names}), got "
                             f"{len(got) if isinstance(got, list) else type(state_dict).__name__}")
        for k, (opt, sd) in enumerate(zip(self.members, got, strict=True)):
            groups = sd.get("param_groups", ()) if isinstance(sd, dict) else ()
            saved = [len(g.get("params", ())) for g in groups]
            have = [len(g["params"]) for g in opt.param_groups]
            if saved != have:
                raise ValueError(f"state_dict: member {k} ({type(opt).__name__}) has groups of {have} "
                                 f"parameters, the saved one {saved}")
        for opt, sd in zip(self.members, got, strict=True):
            opt.load_state_dict(sd)

    def __repr__(self) -> str:
        return f"Combined({', '.join(type(o).__name__ for o in self.members)})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
