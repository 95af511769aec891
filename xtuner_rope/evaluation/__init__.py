"""Held-out evaluation: ``TokenLossMetric`` and ``HeldOutCurvesHook``.

- ``metric``: the token-weighted held-out NLL, each dialogue whole and alone, exact on any
  number of ranks;
- ``hook``: the checks only a built run can make, the worst-dialogues file, the curves' PNG.

The start-up (``config.heldout``) prepares ``val_dataloader`` as it prepares the train one.
"""

from .hook import HeldOutCurvesHook
from .metric import TokenLossMetric

__all__ = ["HeldOutCurvesHook", "TokenLossMetric"]
