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

    xtuner 0.2.0 ``SupervisedFinetune._forward`` passes the whole batch to the HF model: without a
    hook taking the boundaries out, every step dies with a ``TypeError`` naming no fix.
    """
    from xtuner.model.sft import SupervisedFinetune

    SupervisedFinetune.forward = _refuse_unconsumed_boundaries(SupervisedFinetune.forward)
    return True


def patch_sft_sequence_parallel_loss() -> bool:
    """Give plugin-patched models the sequence-parallel loss of ``models.sequence_parallel``.

    xtuner 0.2.0 ``_compute_sequence_parallel_loss`` shifts labels inside each shard (one
    supervised token dropped per shard boundary), back-propagates each rank's unweighted mean and
    shows attention only the shards' boundaries. A model whose attention xtuner-rope patched goes
    through ``sequence_parallel_loss`` instead; other models keep XTuner's method.
    """
    from xtuner.model.sft import SupervisedFinetune

    original = SupervisedFinetune._compute_sequence_parallel_loss

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

    xtuner 0.2.0 ``tools/train.py`` ``check_cfg`` asserts flash-attn whenever
    ``sequence_parallel_size > 1``; with a config ``enable_xtuner_rope`` prepared, the check runs
    with that requirement lifted (logged) and XTuner's DeepSpeed requirement kept. True if applied
    (``xtuner/tools/train.py`` is running in this process).
    """
    # No probe can name the running train.py (``probe_note``): the wrapper is recognised here.
    modules = [m for m in _xtuner_train_modules() if not hasattr(m.check_cfg, "xtuner_rope_sp")]
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
