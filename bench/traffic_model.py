"""Hand-counted memory traffic per parameter element per step (bytes read + written), from the
code at commit ea0c260 (see bench/TRAFFIC.md for the op-by-op lines). float32 everywhere, block=None
unless stated, W = world size. count_ops.py checks the CPU-path totals by instrumenting aten.
  python traffic_model.py
"""

MIN = 28.0  # fused AdamW: read p, g, m, v; write p, m, v


def codec_cpu(W, local=False):
    """compressed_allreduce, plain-torch kernels (CPU), block=None, per global element."""
    worker = 12 + 12 + 8 + 10.625  # _z add; to(f64); dot; pack_signs+assign
    server_chunk = 5.125 + (W - 1) * 17.125 + 12 + 20 + 10.625 + 28  # per chunk element
    server = server_chunk / W
    decomp = 12 + 28 + 5.125  # _z; error update; unpack
    if local:  # local_compressed_allreduce: torch.cat of received and of gathered
        xfer = 0.25 + 0.25
    else:  # gloo: all_to_all self-chunk memcpy; all-gather newLikeFlat + copy_ + self memcpy
        xfer = 0.25 / W + 0.25 + 0.25 / W
    return worker + server + decomp + xfer


def codec_cpu_blocks(W, B=64, local=False):
    s = 4.0 / B
    rms = 4 + 68.0 / B
    worker = 12 + rms + 2 * s + 10.625 + 5 * s / 4 + 2 * s  # _z, block rms, scales, pack, finite
    unpack = 5.125 + 8 + s
    server_chunk = (
        unpack + (W - 1) * (unpack + 12) + 12 + rms + 2 * s + 10.625 + (8 + 8 + s + 12) + W * 13 / B
    )
    server = server_chunk / W
    decomp = 12 + (8 + 8 + s + 12) + unpack
    xfer = 2 * (0.125 + s) if local else 2 * (0.125 + s) * (1 + 1.0 / W)
    return worker + server + decomp + xfer


def codec_triton(W, local=False, B=None):
    s = 0.0 if B is None else 4.0 / B
    worker = 8 + 0.125 + s
    server = (2 * W * (0.125 + s) + 12 + 0.125 + 2 * s) / W  # two launches: bits + e read twice
    decomp = 0.125 + 2 * s + 16
    xfer = 0.5 if local else 0.25 * 2 / W  # NCCL self-chunk copies
    return worker + server + decomp + xfer


def rows():
    r = []
    fin = 4
    # OnebitAdam compression stage (preconditioned, update_clip=1, wd>0, bias_correction off)
    fold, update = 24, 36
    for W, local in ((1, True), (4, False), (8, False)):
        tag = "W=1 bench (local)" if local else f"W={W}"
        r.append(
            (f"OnebitAdam compression, CPU torch codec, {tag}", fin + fold + codec_cpu(W, local) + update)
        )
        r.append(
            (f"OnebitAdam compression, GPU Triton codec, {tag}", fin + fold + codec_triton(W, local) + update)
        )
    r.append(
        (
            "OnebitAdam compression, CPU, block=64, W=1 bench",
            fin + fold + codec_cpu_blocks(1, local=True) + update,
        )
    )
    # OnebitAdam warm-up (W>1: scratch copy, all_reduce, div_; moments 40; update 40 with wd)
    r.append(("OnebitAdam warm-up, W>1 (+ all_reduce internals)", fin + 8 + 8 + 40 + 40))
    r.append(("OnebitAdam warm-up, W=1", fin + 8 + 40 + 40))
    # DDP hook, AdamW freeze_step, compressed iterations, block=64 (HOOK_BLOCK)
    ddp = 16
    # norm, then c = zeros_like + k*m (d: built once per bucket), add_ c, div_ d; after: mul_ d, sub_ c.
    # CPU (2026-11-27, parameters of 2^16+ elements): one fused pass each way, (g + k*m)/d and out*d - k*m
    pre = {"CPU gloo": 4 + 16, "GPU NCCL": 4 + 12 + 12 + 12}
    post = {"CPU gloo": 16, "GPU NCCL": 12 + 12}
    prep = 28 + 32 + 8 + 8 + 4 + 8  # prepare() + post-hook restore (Adam-types other than torch's)
    own = 28  # torch's Adam/AdamW (2026-11-27): the pre-hook's own step, p g m d read, p m v written
    for dev, codec in (("CPU gloo", codec_cpu_blocks(4)), ("GPU NCCL", codec_triton(4, B=64))):
        base = ddp + pre[dev] + codec + post[dev]
        r.append((f"DDP hook + torch AdamW, freeze_step, {dev}, W=4 (DDP's 16 in)", base + own))
        for opt, cost in (("another Adam-type, fused step", 28), ("another Adam-type, unfused step", 80)):
            r.append((f"DDP hook + {opt} (prepared state), {dev}, W=4", base + prep + cost))
    # x86 CPU since 2026-11-27 (collectives/_hook_fused.py): the pre-pass inside the C encode (reads g, m,
    # d, e; writes x and the bits, the norm inside), the server's two C passes on N/4 (bits of 4 ranks, e_s
    # read twice, written once), the post-pass inside the C decompress (reads x, e, m, d; writes e, out);
    # block-64 scales and the 1.5-bit messages on the local side of the two collectives
    W, bits, scales = 4, 1 / 8, 4 / 64
    encode = 16 + 4 + bits + scales
    server = (W * bits + 4 + bits + scales + W * bits + 4 + 4) / W
    wire = 2 * 2 * (bits + scales)
    decomp = 16 + 8 + bits + 2 * scales
    r.append(("DDP hook + torch AdamW, freeze_step, x86 CPU C passes, W=4 (DDP's 16 in)",
              ddp + encode + wire + server + decomp + own))
    # ZeroOneAdam (wd=0; +12 per update with wd>0)
    r.append(("ZeroOneAdam P1 variance step, W>1 (+ all_reduce)", fin + 8 + 8 + 40 + 16 + 32 + 32))
    for dev, c in (("CPU", codec_cpu(4)), ("GPU", codec_triton(4))):
        r.append((f"ZeroOneAdam P1 compressed step, {dev} W=4", fin + 12 + c + 24 + 4 + 32))
    r.append(("ZeroOneAdam P2 local step", fin + 20 + 32))
    for dev, c in (("CPU", codec_cpu(4)), ("GPU", codec_triton(4))):
        sync = 56 + 12 + c + 20 + 12 + 8 + 4
        r.append((f"ZeroOneAdam P2 sync step, {dev} W=4", sync))
        r.append((f"ZeroOneAdam P2 mean over 16 steps (15 local + 1 sync), {dev} W=4", (15 * 56 + sync) / 16))
    # OnebitAdam's fused GPU passes (optimizers/_fused.py, kernels/fused/adam.py): pass A reads g, d,
    # u, e and writes u and the bits (20.125); the Triton server as above; pass B reads the bits, u, e
    # and p and writes e, u and p (24.125)
    for W, local in ((1, True), (4, False), (8, False)):
        tag = "W=1 bench (local)" if local else f"W={W}"
        server = (2 * W * 0.125 + 12 + 0.125) / W
        xfer = 0.5 if local else 0.25 * 2 / W
        r.append((f"OnebitAdam compression, GPU fused passes, {tag}", fin + 20.125 + server + 24.125 + xfer))
        # x86 CPU (kernels/fused/adam.py), from the second fused step on: no gradient pass for the
        # agreement (its verdict from the messages' scales)
        cpu = 20.125 + server + 24.125 + xfer
        r.append((f"OnebitAdam compression, CPU fused passes (prepared), {tag}", cpu))
        # ZeroOneAdam's phase-1 compressed step on x86 (kernels/fused/zero_one.py): the worker reads
        # g, d, e (12.125 with the bits); the decompress pass reads bits, g, d, e, m, p, writes e, m, p
        zoa = 12.125 + server + 32.125 + xfer
        r.append((f"ZeroOneAdam P1 compressed step, CPU fused passes, {tag}", zoa))
    return r


if __name__ == "__main__":
    print(f"{'path':78s} {'B/elem':>7s} {'x28':>6s}")
    for name, b in rows():
        print(f"{name:78s} {b:7.1f} {b / MIN:6.2f}")
    print()
    for W in (1, 4, 8):
        print(
            f"codec only W={W}: CPU {codec_cpu(W, W == 1):.2f}"
            f"  CPU block64 {codec_cpu_blocks(W, local=W == 1):.2f}"
            f"  Triton {codec_triton(W, W == 1):.2f}  Triton block64 {codec_triton(W, W == 1, B=64):.2f}"
        )
