"""The native CPU backend's C: ``native.h`` and ``codec.c`` here, the fused steps' C beside their
Python in ``onebit/kernels/fused/``, compiled as one library by :mod:`onebit.kernels.native.build`."""
