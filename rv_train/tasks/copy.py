"""Digit copy: the example of adding a task in one small file. Friendlier to RoPE models than reversal."""

from rv_train.tasks import register
from rv_train.tasks.reversal import Reversal


@register("copy")
class Copy(Reversal):
    def target(self, digits: str) -> str:
        return digits
