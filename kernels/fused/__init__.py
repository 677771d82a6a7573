"""The fused steps: an optimizer's (or a hook's) element-wise maths inside the codec's passes, one file
per step holding every backend's implementation (its Triton kernels, its C binding; the C beside it in a
``.c`` file): ``adam`` (OnebitAdam's compression step), ``zero_one`` (ZeroOneAdam's phase-1 step,
phase-2 synchronisation and local step), ``hook`` (the DDP / FSDP hooks' ``freeze_step`` passes).
``table`` is the one table format they all read. The drivers, which fill the tables and call the
collective, are the clients' (``onebit.optimizers._fused``, ``onebit.collectives._hook_fused``)."""
