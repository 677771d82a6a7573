"""onebit inside the training frameworks people use, one module per framework.

  onebit.integrations.transformers  ``attach(trainer)``: the Hugging Face Trainer (Accelerate)
  onebit.integrations.lightning     ``OnebitCallback()``: PyTorch Lightning's Trainer

This layer sits above the three others (kernels -> collectives -> optimizers -> integrations):
it uses only their public API, and nothing below imports it. Each framework is an optional
dependency, imported when its module is; ``_session`` holds what every adapter does alike
(register the right DDP hook, clip by an agreed norm, save and restore each rank's state).
"""
