"""Held-out evaluation: ``TokenLossMetric``, ``PreferenceMetric`` and ``HeldOutCurvesHook``.

- ``metric``: the token-weighted held-out NLL, each dialogue whole and alone, exact on any
  number of ranks;
- ``preference_metric``: DPO/ORPO/reward models' held-out loss, preference accuracy and reward
  margin, each pair whole and alone;
- ``hook``: the checks only a built run can make, the worst-dialogues file, the curves' PNG.

The start-up (``config.heldout``) prepares ``val_dataloader`` as it prepares the train one.
"""

from .hook import HeldOutCurvesHook
from .metric import TokenLossMetric
from .preference_metric import PreferenceMetric

__all__ = ["HeldOutCurvesHook", "PreferenceMetric", "TokenLossMetric"]
