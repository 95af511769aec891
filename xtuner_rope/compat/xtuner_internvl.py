"""XTuner InternVL patches: what it hard-codes at load time, its rank query, the prompt
template its dataset edits, and the ``predict`` mode its forward ignores.

xtuner 0.2.0 ``InternVL_V1_5.__init__`` loads the checkpoint with ``torch_dtype=torch.bfloat16``
and sets its LLM's attention to ``"flash_attention_2"`` unconditionally (a config cannot say
otherwise); ``_llm_forward`` calls ``torch.distributed.get_rank()`` at every step;
``InternVL_V1_5_Dataset.__init__`` rewrites the template it is given, which in a config is
XTuner's process-wide ``PROMPT_TEMPLATE`` entry.
"""

from __future__ import annotations

import copy
import functools
import types

import torch

# What the start-up decided (``config.internvl``): ``torch_dtype`` and the LLM's
# ``attn_implementation`` to load with instead of XTuner's hard-coded ones; empty: XTuner's.
INTERNVL_LOAD: dict = {}


class _AutoModelWithOverrides:
    """``transformers.AutoModel`` as ``xtuner.model.internvl`` sees it: the start-up's load
    settings (``INTERNVL_LOAD``) replace the hard-coded dtype and LLM attention."""

    def __init__(self, auto_model):
        self._auto_model = auto_model

    def __getattr__(self, name: str):
        return getattr(self._auto_model, name)

    def from_pretrained(self, path, *args, **kwargs):
        config = kwargs.get("config")
        attn = INTERNVL_LOAD.get("attn_implementation")
        llm_config = getattr(config, "llm_config", None)
        if attn is not None and llm_config is not None:
            # InternLM2 remote code reads ``attn_implementation``; transformers' models
            # ``_attn_implementation`` (XTuner sets the one of the LLM's model_type).
            if getattr(llm_config, "model_type", None) == "internlm2":
                llm_config.attn_implementation = attn
            else:
                llm_config._attn_implementation = attn
        if INTERNVL_LOAD.get("torch_dtype") is not None:
            kwargs["torch_dtype"] = INTERNVL_LOAD["torch_dtype"]
        return self._auto_model.from_pretrained(path, *args, **kwargs)


def patch_internvl_loading() -> bool:
    """Load XTuner's InternVL checkpoints with the start-up's dtype and LLM attention.

    xtuner 0.2.0 ``InternVL_V1_5.__init__`` forces ``flash_attention_2`` on the LLM (without
    flash-attn: transformers' ``ImportError`` while building Phi-3, InternLM2 remote code's
    at the first step) and bf16 weights (on a CPU-only machine: training in bf16 while the
    config's ``OptimWrapper`` is fp32). The module's ``AutoModel`` is wrapped (once) so the
    settings in ``INTERNVL_LOAD``, which ``config.internvl``'s start-up fixes set and log,
    replace those; with ``INTERNVL_LOAD`` empty XTuner's own load runs unchanged.

    Returns:
        True if applied (XTuner has ``xtuner.model.internvl``).
    """
    try:
        import xtuner.model.internvl as internvl
    except ImportError:
        return False
    if not isinstance(internvl.AutoModel, _AutoModelWithOverrides):
        internvl.AutoModel = _AutoModelWithOverrides(internvl.AutoModel)
    return True


class _RankWithoutGroup(types.ModuleType):
    """``torch.distributed`` whose ``get_rank`` is 0 without a process group (MMEngine's)."""

    def __getattr__(self, name: str):
        return getattr(torch.distributed, name)

    def get_rank(self, group=None) -> int:
        return torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0


class _TorchWithRankWithoutGroup(types.ModuleType):
    def __getattr__(self, name: str):
        return getattr(torch, name)


def patch_internvl_rank() -> bool:
    """Let a single-process ``xtuner train`` run XTuner's InternVL configs.

    xtuner 0.2.0 ``InternVL_V1_5._llm_forward`` prints a log line when
    ``torch.distributed.get_rank() == 0``: without a process group (``xtuner train`` with no
    launcher) every step dies with ``ValueError: Default process group has not been
    initialized``. The module's ``torch`` is swapped for a view of torch whose
    ``distributed.get_rank`` is 0 without a group; everything else is torch's.

    Returns:
        True if applied.
    """
    try:
        import xtuner.model.internvl as internvl
    except ImportError:
        return False
    if internvl.torch is torch:
        view = _TorchWithRankWithoutGroup("torch")
        view.distributed = _RankWithoutGroup("torch.distributed")
        internvl.torch = view
    return True


def patch_internvl_dataset_template() -> bool:
    """Keep XTuner's ``PROMPT_TEMPLATE`` intact when an InternVL dataset is built.

    xtuner 0.2.0 ``InternVL_V1_5_Dataset.__init__`` assigns new ``SYSTEM`` / ``INSTRUCTION``
    strings (no newline after ``<|im_end|>`` for InternLM2, after ``<|end|>`` for Phi-3) into
    the template object it receives. A config passes ``PROMPT_TEMPLATE.internlm2_chat`` (or
    ``phi3_chat``) itself, so after one InternVL dataset every later text dataset of the same
    process (``xtuner-rope doctor`` / ``check`` on another config, a rebuild of a run's batches)
    is templated without those newlines: other tokens, other lengths, numbers that match no
    ``xtuner train`` run. The dataset now edits a copy: its own samples are unchanged.

    Returns:
        True if applied (XTuner has ``InternVL_V1_5_Dataset``).
    """
    try:
        from xtuner.dataset.internvl_dataset import InternVL_V1_5_Dataset
    except ImportError:
        return False
    init = InternVL_V1_5_Dataset.__init__
    if getattr(init, "copies_template", False):
        return True

    @functools.wraps(init)
    def __init__(self, model_path, template, *args, **kwargs):
        init(self, model_path, copy.deepcopy(template), *args, **kwargs)

    __init__.copies_template = True
    InternVL_V1_5_Dataset.__init__ = __init__
    return True


def patch_internvl_predict() -> bool:
    """XTuner's InternVL answers ``mode='predict'`` (its ``val_step``) with per-row logits.

    xtuner 0.2.0 ``InternVL_V1_5.forward`` ignores ``mode`` and always returns
    ``{'loss': ...}``: MMEngine's ``ValLoop`` hands a metric one batch loss, so no held-out
    loss per sample can be computed. With ``mode='predict'`` the forward now runs unchanged
    (images written over the ``<IMG_CONTEXT>`` ids by ``_llm_forward``) and returns
    ``[{'logits': [s, V]}]`` per row of the batch (the sequence is the collate's own, so the
    batch's labels align with it). Other modes are XTuner's.

    Returns:
        True if applied (XTuner has ``InternVL_V1_5``).
    """
    try:
        from xtuner.model.internvl import InternVL_V1_5
    except ImportError:
        return False
    forward = InternVL_V1_5.forward
    if getattr(forward, "answers_predict", False):
        return True

    @functools.wraps(forward)
    def forward_with_predict(self, data, data_samples=None, mode="loss"):
        if mode != "predict":
            return forward(self, data, data_samples, mode)
        kept = {}
        llm_forward = self._llm_forward

        def keep(**kwargs):
            out = llm_forward(**kwargs)
            kept["logits"] = out.logits  # [b, s, V]
            return out

        self._llm_forward = keep  # an instance attribute over the method, for this call
        try:
            forward(self, data, data_samples, "loss")
        finally:
            del self._llm_forward
        return [{"logits": row} for row in kept["logits"]]

    forward_with_predict.answers_predict = True
    InternVL_V1_5.forward = forward_with_predict
    return True
