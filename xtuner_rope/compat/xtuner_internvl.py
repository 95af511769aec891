"""XTuner InternVL patches: its hard-coded load settings, its rank query, the prompt template its
dataset edits, and the ``predict`` mode its forward ignores (xtuner 0.2.0).
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

    xtuner 0.2.0 ``InternVL_V1_5.__init__`` forces ``flash_attention_2`` on the LLM (an
    ``ImportError`` without flash-attn) and bf16 weights (on a CPU-only machine, against an fp32
    ``OptimWrapper``). The module's ``AutoModel`` is wrapped so that ``INTERNVL_LOAD`` (set and
    logged by ``config.internvl``) replaces those; empty, XTuner's load runs unchanged.
    """
    import xtuner.model.internvl as internvl

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

    xtuner 0.2.0 ``InternVL_V1_5._llm_forward`` calls ``torch.distributed.get_rank()`` at every
    step ("Default process group has not been initialized" without a launcher). The module's
    ``torch`` becomes a view whose ``distributed.get_rank`` is 0 without a group.
    """
    import xtuner.model.internvl as internvl

    view = _TorchWithRankWithoutGroup("torch")
    view.distributed = _RankWithoutGroup("torch.distributed")
    internvl.torch = view
    return True


def patch_internvl_dataset_template() -> bool:
    """Keep XTuner's ``PROMPT_TEMPLATE`` intact when an InternVL dataset is built.

    xtuner 0.2.0 ``InternVL_V1_5_Dataset.__init__`` rewrites ``SYSTEM`` / ``INSTRUCTION`` of
    XTuner's process-wide template entry; it now edits a copy.
    """
    from xtuner.dataset.internvl_dataset import InternVL_V1_5_Dataset

    init = InternVL_V1_5_Dataset.__init__

    @functools.wraps(init)
    def __init__(self, model_path, template, *args, **kwargs):
        init(self, model_path, copy.deepcopy(template), *args, **kwargs)

    InternVL_V1_5_Dataset.__init__ = __init__
    return True


def patch_internvl_predict() -> bool:
    """XTuner's InternVL answers ``mode='predict'`` (its ``val_step``) with per-row logits.

    xtuner 0.2.0 ``InternVL_V1_5.forward`` ignores ``mode``; with ``mode='predict'`` the forward
    runs unchanged and returns ``[{'logits': [s, V]}]`` per row; other modes are XTuner's.
    """
    from xtuner.model.internvl import InternVL_V1_5

    forward = InternVL_V1_5.forward

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

    InternVL_V1_5.forward = forward_with_predict
    return True
