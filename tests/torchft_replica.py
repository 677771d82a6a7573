"""One torchft replica for tests/test_torchft.py: torchft's DiLoCo over onebit's
OnebitProcessGroupGloo. Saves, for every sync, the fragment's local weights just before it and
the weights right after it, and the process group's byte count.

  python tests/torchft_replica.py LIGHTHOUSE REPLICA_ID OUT.pt FRAGMENTS STEPS SYNC_EVERY [SYNCS]

With SYNCS, it trains until the Manager has committed that many syncs (a replica that joins
late catches up by healing) instead of for STEPS steps, and writes the count to OUT.pt.syncs
after every sync. Environment (tests/test_torchft.py's join test): ONEBIT_TEST_READY, a file
to create once the Manager runs; ONEBIT_TEST_WAIT_FOR, a file to wait for after sync 2.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta

import torch
from torch.distributed import TCPStore
from torchft import Manager
from torchft.local_sgd import DiLoCo

from onebit.collectives.torchft import OnebitProcessGroupGloo


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    lighthouse, rid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    fragments, steps, sync_every = (int(a) for a in sys.argv[4:7])
    until = int(sys.argv[7]) if len(sys.argv) > 7 else None
    torch.manual_seed(0)  # the same initial weights on every replica
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))
    initial = [p.detach().clone() for p in model.parameters()]
    parts = [model] if fragments == 1 else [model[0], model[2]]
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = [torch.optim.SGD(p.parameters(), lr=1.0) for p in parts]  # theta - D: checkable bitwise
    records: list = []
    before: dict = {}

    def save_local(*_args) -> None:  # registered before DiLoCo's hook: runs before its sync
        before["w"] = [p.detach().clone() for p in model.parameters()]

    inner.register_step_post_hook(save_local)
    port = free_port()
    store = TCPStore("localhost", port, 1, is_master=True, wait_for_workers=False)  # noqa: F841 (kept alive)
    if os.environ.get("ONEBIT_TEST_TORCHTITAN"):  # the Manager torchtitan builds, through onebit's override
        manager, pg = via_torchtitan(lighthouse, rid, port, fragments)
        manager.set_state_dict_fns(lambda s: model.load_state_dict(s["m"]), lambda: {"m": model.state_dict()})
    else:
        pg = OnebitProcessGroupGloo(timeout=timedelta(seconds=30))
        manager = Manager(pg=pg, min_replica_size=2, load_state_dict=lambda s: model.load_state_dict(s["m"]),
                          state_dict=lambda: {"m": model.state_dict()}, replica_id=str(rid),
                          store_addr="localhost", store_port=port, rank=0, world_size=1,
                          lighthouse_addr=lighthouse, port=free_port(), timeout=timedelta(seconds=30),
                          use_async_quorum=False, init_sync=False)  # both start from seed 0's weights
        pg.attach(manager, fragments=fragments)
    if os.environ.get("ONEBIT_TEST_READY"):
        open(os.environ["ONEBIT_TEST_READY"], "w").close()
    wait_for = os.environ.get("ONEBIT_TEST_WAIT_FOR")
    g = torch.Generator().manual_seed(100 + rid)  # each replica its own data
    w = torch.randn(5, 12, generator=torch.Generator().manual_seed(7))
    with DiLoCo(manager, parts, inner, outer, sync_every=sync_every, backup_device=torch.device("cpu"),
                pin_memory=False):
        step = 0
        while (step < steps) if until is None else (manager.current_step() < until):
            x = torch.randn(32, 12, generator=g)
            loss = torch.nn.functional.cross_entropy(model(x), (x @ w.T).argmax(1))
            loss.backward()
            committed = manager.current_step()
            inner.step()
            inner.zero_grad()
            if manager.current_step() != committed:  # this step synced a fragment
                records.append({"step": step, "fragment": committed % fragments, "before": before["w"],
                                "after": [p.detach().clone() for p in model.parameters()],
                                "loss": float(loss), "synced": manager.current_step(), "W": pg.size(),
                                "resets": pg.resets})
                with open(out + ".syncs", "w") as fh:
                    fh.write(str(manager.current_step()))
                if wait_for and manager.current_step() == 2:  # let a late replica join here
                    deadline = time.monotonic() + 60
                    while not os.path.exists(wait_for) and time.monotonic() < deadline:
                        time.sleep(0.05)
            step += 1
    torch.save({"records": records, "bytes": pg.traffic.compressed, "calls": pg.traffic.compressed_calls,
                "resets": pg.resets, "initial": initial}, out)
    manager.shutdown(wait=False)


def via_torchtitan(lighthouse: str, rid: int, port: int, fragments: int):
    """torchtitan's TorchFTManager as its torchft trainer builds it from the fault-tolerance
    config, with onebit's override applied (torchtitan reads the rest from the environment)."""
    from torchtitan.experiments.torchft.config.job_config import FaultTolerance

    from onebit.integrations.torchtitan import onebit_torchft

    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      TORCHFT_LIGHTHOUSE=lighthouse, TORCHFT_MANAGER_PORT=str(free_port()))
    config = FaultTolerance(enable=True, semi_sync_method="diloco", replica_id=rid, group_size=2,
                            min_replica_size=2, process_group_timeout_ms=30000, num_fragments=fragments)
    ft = onebit_torchft(config).build()
    assert isinstance(ft.onebit_pg, OnebitProcessGroupGloo) and ft.manager._pg is ft.onebit_pg
    return ft.manager, ft.onebit_pg


if __name__ == "__main__":
    main()
