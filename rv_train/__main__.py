"""``python -m rv_train`` (or ``torchrun ... -m rv_train``): the GRPO trainer."""

from rv_train.trainer import cli

cli()
