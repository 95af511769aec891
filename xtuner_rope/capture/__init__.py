"""Captures of real ``xtuner train`` runs and the measurements they share with the check.

- ``base``: :class:`~xtuner_rope.capture.base.CaptureHook`, the one shape of a capture (do
  this at iteration N, undo it, save, log);
- one capture per kind, the same names as ``check/``'s kinds: ``text``
  (``IsolationCaptureHook``, ``compare_capture``), ``llava`` (``LLaVAIsolationCaptureHook``,
  ``compare_llava_capture``), ``preference`` (``PreferenceCaptureHook``,
  ``compare_preference_capture``);
- ``measure`` (a batch's documents, packed against alone) and ``randomness`` (dropout and router
  noise off): what the captures' comparisons and ``xtuner-rope check`` (:mod:`xtuner_rope.check`)
  both measure with.
"""
