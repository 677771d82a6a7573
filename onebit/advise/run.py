"""The advisor's flow on every rank: measure each link, fit the model, predict, decide."""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.distributed as dist

from .measure import measure_hierarchical, measure_link, measure_step, sweep_sizes
from .model import verdict
from .report import describe_model, fit, footer, link_table

__all__ = ["advise"]


def _links(per_node: int | None, device: torch.device) -> dict[str, object]:
    """name -> process group: the whole world, and with ``per_node`` the ranks of this node
    ("intra") and this rank's peers on the other nodes ("inter"), from a 2-D DeviceMesh."""
    links: dict[str, object] = {"flat": dist.group.WORLD}
    if per_node:
        from torch.distributed.device_mesh import init_device_mesh

        nodes = dist.get_world_size() // per_node
        mesh = init_device_mesh(device.type, (nodes, per_node), mesh_dim_names=("node", "local"))
        links["intra"] = mesh.get_group("local")
        links["inter"] = mesh.get_group("node")
        links["mesh"] = mesh
    return links


def advise(args: argparse.Namespace, device: torch.device, per_node: int | None,
           progress: Callable[[str], None] | None = None) -> tuple[dict, str]:
    """Measure, fit, predict and decide; returns the JSON object and the text report (the same
    on every rank)."""
    P = args.params if args.params is not None else 1 << 24
    sizes = sweep_sizes(P, low=min(args.min_elements, P))
    report: dict = {"params": P, "params_given": args.params is not None, "world_size": dist.get_world_size(),
                    "backend": dist.get_backend(), "device": device.type, "block": args.block,
                    "per_node": per_node, "overlap": args.overlap, "links": {},
                    "versions": {"torch": torch.__version__, "python": platform.python_version()}}
    tables = []
    models = {}
    links = _links(per_node, device)
    mesh = links.pop("mesh", None)
    for name, group in links.items():
        W = dist.get_world_size(group)
        link_sizes = sizes if name != "inter" else sorted({max(1, s // per_node) for s in sizes})

        def say(message: str, name: str = name) -> None:
            if progress:
                progress(f"{name}: {message}")

        rows = measure_link(group, link_sizes, device=device, repeats=args.repeats, budget=args.max_seconds,
                            block=args.block, progress=say)
        model = models[name] = fit(rows, W, args.block)
        report["links"][name] = {
            "world_size": W, "rows": [asdict(r) | {"codec": r.codec} for r in rows], "model": model.as_dict(),
            "model_text": describe_model(name, model), "break_even_elements": model.break_even(),
        }
        tables.append(link_table(name, rows, W))
    flat = models["flat"]
    rows = {r["n"]: r for r in report["links"]["flat"]["rows"]}
    at_p = rows.get(P) or {"float32": None, "onebit": None}
    # measured at P where the budget allowed, the model's extrapolation elsewhere
    f32 = at_p["float32"] or flat.float32_seconds(P)
    if at_p["onebit"]:
        one, comm = at_p["onebit"], at_p["comm"]
        codec = max(one - comm, 0.0)
    else:
        one, codec, comm = flat.onebit_seconds(P), flat.codec(P), flat.comm(flat.wire(P))
    report["measured_at_params"] = {"float32": bool(at_p["float32"]), "onebit": bool(at_p["onebit"])}
    report["predicted"] = {"float32_s": f32, "bf16_s": flat.bf16_seconds(P), "onebit_s": one,
                           "codec_s": codec, "comm_s": comm, "wire_bytes_per_rank": flat.wire(P),
                           "float32_bytes_per_rank": 2 * (flat.world_size - 1) * 4 * P // flat.world_size}
    report["predicted_speedup"] = f32 / one
    report["model_speedup"] = flat.speedup(P)  # the fitted model alone, measured at P or not
    if per_node:
        L = per_node
        predicted = models["intra"].float32_seconds(P) + models["inter"].onebit_seconds(-(-P // L))
        measured = None
        if one <= args.max_seconds:  # the flat 1-bit call fits the budget: time the hierarchical one at P
            if progress:
                progress(f"hierarchical all-reduce of {P:,} elements on {dist.get_world_size() // L} x {L}")
            measured = measure_hierarchical(mesh, P, device=device, repeats=args.repeats, block=args.block)
        hier = measured if measured is not None else predicted
        report["hierarchical"] = {"nodes": dist.get_world_size() // L, "per_node": L, "seconds": hier,
                                  "measured": measured is not None, "predicted_from_links": predicted,
                                  "speedup": f32 / hier, "speedup_over_flat_onebit": one / hier}
    compute = None
    if args.step_ms is not None:
        compute = args.step_ms / 1000.0
    elif args.measure_step is not None:
        if progress:
            progress(f"timing step() from {args.measure_step}")
        compute = measure_step(args.measure_step, dist.group.WORLD, device)
    detail = (f"at P = {P:,}: float32 all-reduce {f32 * 1e3:.1f} ms against 1-bit {one * 1e3:.1f} ms, "
              f"of which compute {codec * 1e3:.1f} ms")
    if compute is None:
        report["step"] = None
        report["predicted_step_speedup"] = None
        report["verdict"], report["reason"] = verdict(report["predicted_speedup"], "the gradient all-reduce",
                                                      detail)
    else:
        # the step from the measured (or extrapolated) all-reduce times, split as the model splits them
        dense = compute + (1 - args.overlap) * f32
        onebit = compute + codec + (1 - args.overlap) * comm
        report["step"] = {"compute_s": compute, "overlap": args.overlap, "float32_s": dense,
                          "onebit_s": onebit}
        report["predicted_step_speedup"] = dense / onebit
        detail += (f"; compute {compute * 1e3:.1f} ms per step, {args.overlap:.0%} of the dense "
                   "all-reduce hidden")
        report["verdict"], report["reason"] = verdict(report["predicted_step_speedup"], "the training step",
                                                      detail)
    text = "\n\n".join(tables) + "\n\n" + footer(report)
    return report, text
