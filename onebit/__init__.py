"""onebit: error-compensated 1-bit compressed collectives for PyTorch.

Layers (imports go one way only):
  onebit.kernels      sign packing and the fused compress / server-reduce / decompress kernels
  onebit.collectives  compressed_allreduce over torch.distributed
  onebit.optimizers   1-bit optimizers built on the collectives
"""

__version__ = "0.1.0"
