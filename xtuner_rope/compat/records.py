"""One :class:`~xtuner_rope.compat.guard.PatchRecord` per patch: versions, probes, feature.

mmengine ``~=0.10.6`` and xtuner ``~=0.2.0`` are ``setup.cfg``'s pins; torch and DeepSpeed come
from ``compat.versions.SUPPORTED``. A release that renames a probed name makes the guard skip
the patch with one warning. docs/compat.md's table of versions and probes is
:func:`records_table` (``tests/compat/test_compat_records.py`` compares them).
"""

from __future__ import annotations

from .bitsandbytes_triton import triton_lacks_ops
from .deepspeed_cpu import deepspeed_flat_buffer_requires_grad
from .devices import cpu_only
from .guard import PatchRecord
from .versions import SUPPORTED

__all__ = ["ACTIVATION", "COUNTING", "DEFERRED", "RECORDS", "records_table"]

_MM = {"mmengine": "~=0.10.6"}
_XT = {"xtuner": "~=0.2.0"}
_DS = {"deepspeed": SUPPORTED["deepspeed"].spec}
_TORCH = {"torch": SUPPORTED["torch"].spec}
_TF = {"transformers": "~=4.48.0"}
_SFT = "xtuner.model.sft:SupervisedFinetune"
_PREF = "xtuner.dataset.preference_dataset"
_IVL = "xtuner.model.internvl"
_ZERO3 = "deepspeed.runtime.zero.partition_parameters"


def _cpu_and_old_deepspeed() -> bool:
    return cpu_only() and deepspeed_flat_buffer_requires_grad()


_R = PatchRecord
# fmt: off
# Applied by ``compat.apply()`` at activation, in this order.
ACTIVATION = (
    _R("patch_torch_cpu_bf16_query", _TORCH, ("torch.cpu",),
       "training on a CPU-only machine", "AttributeError: torch.cpu.is_bf16_supported",
       needs=("every run on a CPU-only machine", "cpu")),
    _R("patch_bitsandbytes_triton_probe", {"bitsandbytes": "~=0.45.0"}, (),
       "LoRA/QLoRA (peft's bitsandbytes import)", "No module named 'triton.ops'",
       when=triton_lacks_ops,
       probe_note="plants bitsandbytes' own probe module; importing bitsandbytes is the bug",
       needs=("LoRA / QLoRA configs (`lora` or `quantization_config` in `model`)", "lora")),
    _R("register_internlm2_auto_classes", {**_TF, **_XT},
       ("transformers.models.auto.configuration_auto:CONFIG_MAPPING",
        "transformers:AutoConfig.register",
        "xtuner._lite.modelings.internlm2.modeling_internlm2:InternLM2ForCausalLM"),
       "loading a local InternLM2 checkpoint without remote code",
       "model type `internlm2` not recognized",
       needs=("a local InternLM2 checkpoint without remote code (`auto_map`)", "local_internlm2_without_code")),
    _R("patch_mmengine_dist_init_on_cpu", _MM, ("mmengine.dist.utils:_init_dist_pytorch",),
       "several processes on a CPU-only machine", "Found no NVIDIA driver", when=cpu_only,
       needs=("several processes on a CPU-only machine", "multiprocess_cpu")),
    _R("patch_mmengine_ddp_device_ids_on_cpu", _MM,
       ("mmengine.model:MMDistributedDataParallel.__init__",),
       "several processes on a CPU-only machine", "DDP device_ids on CPU modules",
       when=cpu_only,
       needs=("several processes on a CPU-only machine", "multiprocess_cpu")),
    _R("patch_deepspeed_cpu_allgather_grad_mode", _DS,
       ("deepspeed.runtime.utils:all_gather_into_tensor_dp_groups",),
       "DeepSpeed ZeRO-1/2 on CPU", "Output 0 of Split is a view", when=_cpu_and_old_deepspeed,
       needs=("DeepSpeed ZeRO-1/2 on a CPU-only machine", "zero12_cpu")),
    _R("patch_deepspeed_zero3_cpu_gather", _DS,
       (f"{_ZERO3}:Init._allgather_params_coalesced", f"{_ZERO3}:dist",
        "deepspeed.accelerator:get_accelerator"),
       "DeepSpeed ZeRO-3 on CPU", "a rank reads parameters not yet gathered", when=cpu_only,
       needs=("DeepSpeed ZeRO-3 on a CPU-only machine", "zero3_cpu")),
    _R("patch_checkpoint_loading", {**_TORCH, **_MM, **_XT},
       ("mmengine.runner.checkpoint:CheckpointLoader.register_scheme",
        "xtuner.tools.utils:get_seed_from_checkpoint"),
       "resuming or loading from a checkpoint (--resume, load_from)",
       "Weights only load failed ... HistoryBuffer",
       needs=("`resume`, `load_from` or `--resume`", "loads_checkpoint")),
    _R("patch_checkpoint_writes", _MM,
       ("mmengine.runner.checkpoint:save_checkpoint",
        "mmengine.runner.checkpoint:find_latest_checkpoint",
        "mmengine.hooks:CheckpointHook._save_checkpoint_with_step",
        "mmengine.runner.runner", "mmengine.runner._flexible_runner"),
       "crash-safe checkpoint writes", "a kill mid-save leaves a truncated newest checkpoint",
       needs=("every run with MMEngine's `CheckpointHook`", "checkpoint_hook")),
    _R("patch_deepspeed_checkpoint_writes", _DS,
       ("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine.save",),
       "crash-safe DeepSpeed checkpoint writes",
       "a kill mid-save leaves a truncated rank file",
       needs=("DeepSpeed runs with MMEngine's `CheckpointHook`", "deepspeed_checkpoint_hook")),
    _R("patch_sft_forward_names_missing_hook", _XT, (f"{_SFT}.forward",),
       "an error naming a missing model_resource", "unexpected keyword 'cumulative_len'",
       not_refused="a clearer error; without it the run still fails"),
    _R("patch_model_resource_llm_path", {**_MM, **_XT}, ("mmengine.config:Config",),
       "LLaVA/InternVL configs in xtuner train", "KeyError: 'pretrained_model_name_or_path'",
       needs=("LLaVA / InternVL configs", "multimodal")),
    _R("patch_set_model_resource_llm_path", _XT, ("xtuner.tools.utils:set_model_resource",),
       "LLaVA/InternVL configs in doctor/check/replay",
       "KeyError: 'pretrained_model_name_or_path'",
       needs=("LLaVA / InternVL configs", "multimodal")),
    _R("patch_xtuner_preference_rank", _XT,
       ("xtuner.model.dpo:DPO.compute_loss", "xtuner.model.orpo:ORPO.compute_loss"),
       "packed DPO/ORPO in one process", "Default process group has not been initialized",
       needs=("DPO / ORPO", "dpo_orpo")),
    # before target_zero: its wrapper then runs inside target_zero's, and gets that mask (id 0)
    _R("patch_preference_chunked_logprobs", _XT,
       ("xtuner.model.dpo:DPO._gather_masked_logits",
        "xtuner.model.orpo:ORPO._gather_masked_logits",
        "xtuner.model.orpo:ORPO.cross_entropy_loss"),
       "DPO/ORPO log-probs without the whole logits", "[tokens, vocab] logits of every row",
       not_refused="without it DPO/ORPO compute their log-probs from the full logits (logged)"),
    _R("patch_xtuner_preference_target_zero", _XT,
       ("xtuner.model.dpo:DPO._gather_masked_logits",
        "xtuner.model.orpo:ORPO._gather_masked_logits"),
       "DPO/ORPO log-probs of target id 0", "target id 0 silently left out",
       needs=("DPO / ORPO", "dpo_orpo")),
    _R("patch_preference_unpacked_pairs", _XT, (f"{_PREF}:PackedDatasetWrapper.__init__",),
       "the packed preference pairs check", "pairs dropped, only a count logged",
       needs=("preference datasets (`build_preference_dataset`)", "preference_dataset")),
    _R("patch_preference_map_fn_errors", _XT, (f"{_PREF}:map_dataset",),
       "preference map errors that name the row", "bare AssertionError / KeyError",
       not_refused="a clearer error; without it the map still fails"),
    _R("patch_dpo_predict_reference", _XT, ("xtuner.model.dpo:DPO",),
       "held-out DPO loss, reward accuracy and margin", "predict returns no ref_logits",
       needs=("DPO with a `val_dataloader`", "dpo_evaluates")),
    _R("patch_sft_sequence_parallel_loss", _XT,
       (f"{_SFT}._compute_sequence_parallel_loss",),
       "sequence parallel loss", "a label dropped per shard, unweighted rank means",
       needs=("`sequence_parallel_size > 1`", "sequence_parallel")),
    _R("patch_xtuner_train_sequence_parallel_check", _XT, (),
       "sequence parallel without flash-attn", "`flash_attn` is required ...",
       probe_note="finds the running xtuner/tools/train.py's check_cfg itself",
       needs=("`sequence_parallel_size > 1`", "sequence_parallel")),
    _R("patch_internlm2_generation_from_embeds", _TF,
       ("transformers.dynamic_module_utils:get_class_in_module",
        "xtuner._lite.modelings.internlm2.modeling_internlm2"),
       "InternLM2 generation from inputs_embeds (LLaVA evaluation_images)",
       "size of tensor a (0) must match",
       needs=("LLaVA with `EvaluateChatHook(evaluation_images=...)`", "llava_evaluation_images")),
    _R("patch_mmengine_warmup_rounding", _MM, ("mmengine.runner:Runner._build_param_scheduler",),
       "an error naming the warm-up that rounds to 0", "end should be larger than begin",
       not_refused="a clearer error; without it MMEngine still fails"),
    _R("patch_mmengine_host_copies", _MM,
       ("mmengine.model:BaseDataPreprocessor.cast_data",),
       "a training forward without a host sync", "the device read back once per step",
       not_refused="speed only; without it the batch is read back once per step"),
    _R("patch_xtuner_varlen_hook_host_copies", _XT,
       ("xtuner.engine.hooks:VarlenAttnArgsToMessageHubHook.before_train_iter",
        "xtuner.engine.hooks:VarlenAttnArgsToMessageHubHook.before_val_iter"),
       "a training forward without a host sync", "the device read back once per step",
       not_refused="speed only; without it the boundaries are read back once per step"),
    _R("patch_internvl_loading", _XT, (f"{_IVL}:AutoModel",),
       "InternVL without flash-attn / in fp32 on CPU", "flash_attention_2 forced, bf16 forced",
       needs=("InternVL configs", "internvl")),
    _R("patch_internvl_rank", _XT, (f"{_IVL}:torch",),
       "InternVL in one process", "Default process group has not been initialized",
       needs=("InternVL configs", "internvl")),
    _R("patch_internvl_dataset_template", _XT,
       ("xtuner.dataset.internvl_dataset:InternVL_V1_5_Dataset.__init__",),
       "XTuner's prompt templates kept as shipped", "the shared template edited in place",
       needs=("InternVL configs", "internvl")),
    _R("patch_internvl_predict", _XT, (f"{_IVL}:InternVL_V1_5.forward",),
       "held-out loss of InternVL", "forward ignores mode='predict'",
       needs=("InternVL with a `val_dataloader`", "internvl_evaluates")),
    _R("patch_llava_predict_labels", _XT, ("xtuner.model.llava:LLaVAModel.predict",),
       "held-out loss of LLaVA", "predict's logits not aligned with labels",
       needs=("LLaVA with a `val_dataloader`", "llava_evaluates")),
    _R("patch_xtuner_zero_read_fp32", _XT,
       ("xtuner.utils.zero_to_any_dtype:DEFAULT_DTYPE",
        "xtuner.utils.zero_to_any_dtype:get_state_dict_from_zero_checkpoint"),
       "DeepSpeed checkpoints read at fp32 (convert pth_to_hf, pretrained_pth)",
       "ZeRO fp32 partitions read as fp16, also with --fp32",
       needs=("a `pretrained_pth` (XTuner reads a DeepSpeed folder through it)", "pretrained_pth")),
)
# Run by ``compat.apply_counting`` with the wrappers of the floor above (``data``) handed in.
COUNTING = (
    _R("patch_preference_truncation_counted", _XT, (f"{_PREF}:PreferenceDataset",),
       "truncation counted on preference pairs (build_preference_dataset)",
       "responses cut at max_length without a word",
       not_refused="a count in the log; without it the pairs are the same"),
    _R("patch_xtuner_tokenize_counted", _XT, ("xtuner.dataset.huggingface:tokenize_dataset",),
       "truncation counted on unpacked process_hf_dataset, LLaVA text, intern-repo files",
       "dialogues cut at max_length without a word",
       not_refused="a count in the log; without it the data are the same"),
)
# Applied later, at start-up, in a hook or for one call: checked by ``apply()``, run there.
DEFERRED = (
    _R("xtuner_pack_step", _XT, ("xtuner.dataset.huggingface:pack_dataset",),
       "whole-dialogue packing (lossless_process_hf_dataset)",
       "a leftover dropped per map_num_proc worker",
       needs=("XTuner's offline packing (`process_hf_dataset` packing, `lossless_process_hf_dataset`)", "xtuner_packs")),
    _R("xtuner_tokenize_step", _XT, ("xtuner.dataset.huggingface:tokenize_dataset",),
       "every truncation counted (process_hf_dataset, intern-repo), documents split",
       "dialogues and documents cut at max_length, reported as nothing lost",
       needs=("XTuner's offline packing and intern-repo packed datasets (their truncation counted, pretraining documents split)", "xtuner_or_offline_packs")),
    _R("xtuner_intern_repo_packer", _XT, ("xtuner.dataset.intern_repo:PackedDataset",),
       "whole-document packing (build_whole_packed_dataset)", "documents cut at row edges",
       needs=("intern-repo packed datasets (`build_packed_dataset`, `build_whole_packed_dataset`)", "offline_packs")),
    _R("keep_other_model_paths", {**_MM, **_XT}, ("mmengine.config:ConfigDict.items",),
       "LLaVA's other model paths (CLIP, image processor) kept",
       "OSError ... preprocessor_config.json",
       needs=("LLaVA configs", "llava")),
    _R("patch_llava_expansion_check", _XT,
       ("xtuner.model.llava:prepare_inputs_labels_for_multimodal",),
       "the LLaVA expanded-sequence check", "image tokens past the RoPE range unchecked",
       needs=("LLaVA configs", "llava")),
)
# fmt: on
RECORDS: dict[str, PatchRecord] = {r.name: r for r in ACTIVATION + COUNTING + DEFERRED}


def records_table() -> str:
    """The Markdown table of docs/compat.md's "Versions and probes" section."""
    rows = ["| Patch | Versions | Probes | Feature | Without it |", "|---|---|---|---|---|"]
    for r in RECORDS.values():
        probes = ", ".join(f"`{p}`" for p in r.probes) or f"none: {r.probe_note}"
        rows.append(
            f"| `{r.name}`{' (later)' if r in DEFERRED else ''} | {r.supported()} | {probes} "
            f"| {r.feature} | {r.symptom} |"
        )
    return "\n".join(rows)
