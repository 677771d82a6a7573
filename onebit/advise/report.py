"""The advisor's output: a table per link in nccl-tests' columns and units, a footer with the
model, the break-even size, the predictions and the verdict, or one JSON object."""

from __future__ import annotations

from .measure import Row
from .model import LinkModel

__all__ = ["fit", "link_table", "footer"]


def fit(rows: list[Row], world_size: int, block: int | None) -> LinkModel:
    """The link's model from its measured rows (docs/speedup.md)."""
    from .model import Affine

    def pairs(x, t):
        got = [(x(r), t(r)) for r in rows if t(r) is not None]
        return [a for a, _ in got], [b for _, b in got]

    dense = Affine.fit(*pairs(lambda r: 4 * r.n, lambda r: r.float32))
    half = pairs(lambda r: 2 * r.n, lambda r: r.bf16)
    codec = Affine.fit(*pairs(lambda r: r.n, lambda r: r.codec))
    comm = Affine.fit(*pairs(lambda r: r.wire, lambda r: r.comm))
    return LinkModel(world_size, block, dense, codec, comm, Affine.fit(*half) if half[0] else None)


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.0f}"


def _gbps(nbytes: float, seconds: float | None) -> str:
    return "-" if not seconds else f"{nbytes / seconds / 1e9:.3f}"


def link_table(name: str, rows: list[Row], world_size: int) -> str:
    """nccl-tests' columns (size in bytes of the float32 tensor, time in us, algbw and busbw in
    GB/s, busbw = algbw * 2 (W-1) / W) for both dense all-reduces, then the 1-bit call: time,
    effective bandwidth (float32 bytes / time), its compute stages and the bytes it sends."""
    bus = 2 * (world_size - 1) / world_size
    head = (f"{'elements':>12} {'size(B)':>12} | {'fp32(us)':>10} {'algbw':>7} {'busbw':>7} | "
            f"{'bf16(us)':>10} {'algbw':>7} {'busbw':>7} | {'1-bit(us)':>10} {'effbw':>7} "
            f"{'encode':>8} {'server':>8} {'decode':>8} {'comm':>9} {'wire(B)':>10} | {'speedup':>7}")
    lines = [f"# link: {name} ({world_size} ranks); times in us, bandwidths in GB/s, '-': not run "
             "(over --max-seconds; the model extrapolates)", head, "-" * len(head)]
    for r in rows:
        f32 = None if r.float32 is None else r.float32
        algbw32 = None if f32 is None else 4 * r.n / f32 / 1e9
        algbw16 = None if r.bf16 is None else 2 * r.n / r.bf16 / 1e9
        speed = f"{r.float32 / r.onebit:.2f}x" if r.float32 and r.onebit else "-"
        lines.append(
            f"{r.n:>12,} {4 * r.n:>12,} | {_us(r.float32):>10} "
            f"{'-' if algbw32 is None else f'{algbw32:.3f}':>7} "
            f"{'-' if algbw32 is None else f'{algbw32 * bus:.3f}':>7} | {_us(r.bf16):>10} "
            f"{'-' if algbw16 is None else f'{algbw16:.3f}':>7} "
            f"{'-' if algbw16 is None else f'{algbw16 * bus:.3f}':>7} | {_us(r.onebit):>10} "
            f"{_gbps(4 * r.n, r.onebit):>7} {_us(r.encode):>8} {_us(r.server):>8} {_us(r.decode):>8} "
            f"{_us(r.comm):>9} {r.wire:>10,} | {speed:>7}")
    return "\n".join(lines)


def describe_model(name: str, model: LinkModel) -> str:
    d, c, m = model.dense, model.codec, model.comm
    return (f"model of {name}: float32 all-reduce {d.latency * 1e6:.0f} us + 4n bytes at "
            f"{_rate(d.per_unit)}; 1-bit: compute {c.latency * 1e6:.0f} us + {c.per_unit * 1e9:.2f} ns per "
            f"element, communication {m.latency * 1e6:.0f} us + wire bytes at {_rate(m.per_unit)}")


def _rate(seconds_per_byte: float) -> str:
    return "no measurable cost" if seconds_per_byte <= 0 else f"{1 / seconds_per_byte / 1e9:.3f} GB/s"


def footer(report: dict) -> str:
    """The lines under the tables, from the advisor's JSON object."""
    lines = [link["model_text"] for link in report["links"].values()]
    flat = report["links"]["flat"]
    be = flat["break_even_elements"]
    lines.append("break-even: " + (f"the 1-bit all-reduce is the faster from about {be:,} elements "
                                   f"({4 * be / 1e6:.2f} MB of float32)" if be else
                                   "the 1-bit all-reduce is not faster at any size on this link"))
    p, pr = report["params"], report["predicted"]
    source = ", ".join(f"{op} {'measured' if done else 'extrapolated by the model'}"
                       for op, done in report["measured_at_params"].items())
    lines.append(f"at P = {p:,} parameters ({source}): float32 all-reduce {pr['float32_s'] * 1e3:.1f} ms, "
                 f"1-bit {pr['onebit_s'] * 1e3:.1f} ms (compute {pr['codec_s'] * 1e3:.1f}, communication "
                 f"{pr['comm_s'] * 1e3:.1f}): {report['predicted_speedup']:.2f}x")
    hier = report.get("hierarchical")
    if hier:
        how = "measured" if hier["measured"] else "predicted from the two links"
        lines.append(f"hierarchical ({hier['nodes']} x {hier['per_node']}: float32 inside each node, 1-bit "
                     f"between nodes on P / {hier['per_node']} per rank; {how}): "
                     f"{hier['seconds'] * 1e3:.1f} ms, "
                     f"{hier['speedup']:.2f}x the flat float32 all-reduce, "
                     f"{hier['speedup_over_flat_onebit']:.2f}x the flat 1-bit one")
    step = report.get("step")
    if step:
        lines.append(f"step (compute {step['compute_s'] * 1e3:.1f} ms, {step['overlap']:.0%} of the dense "
                     f"all-reduce hidden behind it): float32 {step['float32_s'] * 1e3:.1f} ms, 1-bit "
                     f"{step['onebit_s'] * 1e3:.1f} ms: {report['predicted_step_speedup']:.2f}x")
    else:
        lines.append("step: pass --step-ms or --measure-step (and --overlap) to predict whole steps")
    lines.append(f"verdict: {report['verdict']}: {report['reason']}")
    return "\n".join(lines)
