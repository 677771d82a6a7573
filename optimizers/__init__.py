"""1-bit optimizers (OnebitAdam, OnebitLamb, ZeroOneAdam) built on onebit.collectives."""
