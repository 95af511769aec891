"""Held-out evaluation: ``TokenLossMetric`` (SFT NLL), ``PreferenceMetric`` (DPO/ORPO/reward)
and ``HeldOutCurvesHook`` (run checks, worst-dialogues file, curves)."""

from .hook import HeldOutCurvesHook
from .metric import TokenLossMetric
from .preference_metric import PreferenceMetric

__all__ = ["HeldOutCurvesHook", "PreferenceMetric", "TokenLossMetric"]
