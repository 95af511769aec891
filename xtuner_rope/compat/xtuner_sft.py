"""XTuner SFT patches: the missing-hook error, the sequence-parallel loss, ``xtuner train``'s SP check."""

from __future__ import annotations

import functools
import os
import sys


def _refuse_unconsumed_boundaries(forward):
    """Wrap ``SupervisedFinetune.forward``: boundaries left in ``data`` name the missing hook."""

    @functools.wraps(forward)
    def checked_forward(self, data, data_samples=None, mode="loss"):
        if isinstance(data, dict) and "cumulative_len" in data:
            raise ValueError(
                "xtuner-rope: the batch reached the model with 'cumulative_len' still in it "
                "(the HF forward does not take it): the hook that consumes it is missing. "
                "Add to PART 1 of the config:\n    from xtuner_rope import enable_xtuner_rope\n"
                "    model_resource = dict(fn=enable_xtuner_rope)\n(it adds the plugin's hooks), "
                "or, without xtuner-rope, collate with use_varlen_attn=False."
            )
        return forward(self, data, data_samples, mode)

    return checked_forward


def patch_sft_forward_names_missing_hook() -> bool:
    """Turn "unexpected keyword argument 'cumulative_len'" into an error naming the fix.

    xtuner 0.2.0 ``SupervisedFinetune._forward`` passes the whole batch to the HF model. A
    collate function that returns document boundaries (``rope_collate_fn``, or XTuner's own
    ``default_collate_fn(use_varlen_attn=True)``) relies on a hook to take them out first;
    without it every step dies with ``TypeError: InternLM2ForCausalLM.forward() got an
    unexpected keyword argument 'cumulative_len'``, which names neither the hook nor the fix.

    Returns:
        True if applied (xtuner's SupervisedFinetune is importable).
    """
    try:
        from xtuner.model.sft import SupervisedFinetune
    except ImportError:
        return False
    SupervisedFinetune.forward = _refuse_unconsumed_boundaries(SupervisedFinetune.forward)
    return True


def patch_sft_sequence_parallel_loss() -> bool:
    """Give plugin-patched models the sequence-parallel loss of ``models.sequence_parallel``.

    xtuner 0.2.0 ``SupervisedFinetune._compute_sequence_parallel_loss`` splits ``labels`` with
    the row and lets the model shift them inside each shard: the first label of every shard
    after the first (predicted by the previous shard's last token) is dropped, silently, one
    supervised token per shard boundary. It also back-propagates each rank's unweighted mean
    (wrong gradients when shards hold unequal token counts), and its attention would see only
    the shards' boundaries. For a model whose attention xtuner-rope patched, the loss goes
    through ``sequence_parallel_loss`` instead (full-row boundaries published, labels shifted
    over the full row, token-weighted); other models keep XTuner's method unchanged.

    Returns:
        True if applied (xtuner's SupervisedFinetune has the method).
    """
    try:
        from xtuner.model.sft import SupervisedFinetune
    except ImportError:
        return False
    original = getattr(SupervisedFinetune, "_compute_sequence_parallel_loss", None)
    if original is None:
        return False

    @functools.wraps(original)
    def _compute_sequence_parallel_loss(self, data):
        from xtuner_rope.models.dispatch import isolates_documents
        from xtuner_rope.models.sequence_parallel import sequence_parallel_loss

        if not isolates_documents(self.llm):
            return original(self, data)
        return sequence_parallel_loss(self.llm, data)

    SupervisedFinetune._compute_sequence_parallel_loss = _compute_sequence_parallel_loss
    return True


def _xtuner_train_modules() -> list:
    """The loaded copies of ``xtuner/tools/train.py`` (``xtuner train`` runs it as __main__)."""
    found = []
    for name in ("__main__", "xtuner.tools.train"):
        module = sys.modules.get(name)
        path = str(getattr(module, "__file__", "") or "").replace(os.sep, "/")
        if path.endswith("xtuner/tools/train.py") and hasattr(module, "check_cfg"):
            found.append(module)
    return found


def patch_xtuner_train_sequence_parallel_check() -> bool:
    """Lift ``xtuner train``'s flash-attn requirement for sequence parallel where xtuner-rope serves.

    xtuner 0.2.0 ``tools/train.py`` ``check_cfg`` asserts ``flash_attn`` is installed and
    ``attn_implementation`` is unset or ``"flash_attention_2"`` whenever
    ``sequence_parallel_size > 1`` (symptom: "`flash_attn` is required if you want to use
    sequence parallel." on every machine without flash-attn, CPU included). With the config
    prepared by ``enable_xtuner_rope`` the plugin's packed attention runs the sequence-parallel
    attention on every backend (``models.sequence_parallel``): the check runs with that
    requirement lifted (logged) and XTuner's DeepSpeed requirement for sequence parallel kept.
    The wrapper applies once the plugin is activated by the config's ``model_resource``, which
    ``xtuner train`` calls before ``check_cfg``.

    Returns:
        True if applied (``xtuner/tools/train.py`` is running in this process).
    """
    modules = [
        m for m in _xtuner_train_modules() if not getattr(m.check_cfg, "xtuner_rope_sp", False)
    ]
    for module in modules:
        original = module.check_cfg

        @functools.wraps(original)
        def check_cfg(cfg, args, _original=original):
            from mmengine.logging import print_log

            # compat sits below the start-up (config/): read it only if it was imported; if
            # not, nothing was prepared.
            startup = sys.modules.get("xtuner_rope.config.startup")
            sp = cfg.get("sequence_parallel_size", 1)
            prepared = startup is not None and startup.is_prepared()
            if not (prepared and isinstance(sp, int) and sp > 1):
                return _original(cfg, args)
            if args.deepspeed is None:  # a refusal before loading, listed as the start-up's
                findings = sys.modules["xtuner_rope.config.findings"]  # the start-up's own import
                raise findings.ConfigConflict(
                    findings.conflict_message(
                        [
                            findings.Finding(
                                "sequence_parallel_size",
                                f"sequence_parallel_size = {sp} without "
                                "DeepSpeed: XTuner trains sequence parallel only under DeepSpeed",
                                "Add `--deepspeed <json>` to `xtuner train` (on CPU: "
                                "configs/deepspeed/zero2_fp32_cpu.json), or set sequence_parallel_size = 1",
                            )
                        ]
                    )
                )
            print_log(
                f"xtuner-rope: sequence_parallel_size = {sp} is served by xtuner-rope's "
                "packed attention on every backend; XTuner's flash-attn requirement for "
                "sequence parallel is lifted.",
                logger="current",
            )
            cfg.sequence_parallel_size = 1
            try:
                return _original(cfg, args)
            finally:
                cfg.sequence_parallel_size = sp

        check_cfg.xtuner_rope_sp = True
        module.check_cfg = check_cfg
    return bool(modules)
