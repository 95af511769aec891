"""Every setting the doctor refuses, the run refuses first, with the same message.

The doctor's refusals (``doctor/diagnose.py``: ``diagnose`` and ``judge``) come from:

1. the start-up's findings (``config.startup.inspect_config`` over every registered findings
   function, ``FINDINGS``): the run meets the very same findings in ``model_resource``
   (before any weight loads) or, for ``--cfg-options``, in ``ValidatedRoPEHook``'s re-check
   before the first step. :func:`test_each_start_up_refusal_is_the_runs` walks ``FINDINGS``:
   one config per findings function that can refuse, started by the code ``xtuner train``
   runs (``config.as_xtuner_train.start_file``: XTuner's ``set_model_resource``), and
   compared with the doctor's verdict on the same file (``start_like_xtuner_train``);
2. the LLaVA data checks (``data.llava_dataset_checks``), which ``PackedBatchCheckHook``
   runs over the whole dataset before the first step (a real ``xtuner train`` refused:
   ``tests/batch/test_input_catalogue_llava.py``);
3. the warm-up that rounds to 0 iterations (``config.warmup``, refused after the model loads
   with the doctor's message: ``tests/doctor/test_zoo_refusals.py``);
4. sequence parallel without DeepSpeed (``launch_problems``; XTuner's own check, kept by
   ``xtuner_sft.patch_xtuner_train_sequence_parallel_check``: ``tests/config/
   test_sequence_parallel_startup.py``).

Not refused before a step by the run, by design: the plugin not enabled (nothing of it runs;
packed rows from ``rope_collate_fn`` are stopped at the first forward by
``xtuner_sft.patch_sft_forward_names_missing_hook``), and per-sample text problems the doctor
finds by scanning the data (empty, over-long, label-mismatched samples, unsupervised batches):
the collate function refuses the batch that holds one, naming the sample.

One real ``xtuner train`` per refusal site: start-up (``tests/config/
test_llava_image_tokens.py``), re-check before the first step (``tests/config/
test_overrides.py``), the data checks before the first step (the LLaVA catalogue). The walk
here starts each config in this process through the same code: ~20 s per extra process saved.
"""

from pathlib import Path

import pytest
from stock_configs import ensure_tiny_model

from xtuner_rope.config.as_xtuner_train import start_file
from xtuner_rope.config.findings import ConfigConflict
from xtuner_rope.config.startup import FINDINGS, state_kept
from xtuner_rope.doctor.diagnose import start_like_xtuner_train

HEAD = """from xtuner_rope import enable_xtuner_rope
pretrained_model_name_or_path = "{tiny}"
model_resource = dict(fn=enable_xtuner_rope)
model = dict(type="{model}", llm=dict(pretrained_model_name_or_path=pretrained_model_name_or_path))
"""
LOADER = "train_dataloader = dict(batch_size={batch}, dataset={dataset}, collate_fn={collate})\n"
TEXT = 'dict(type="process_hf_dataset", pack_to_max_length=False)'
ROPE = 'dict(type="rope_collate_fn", max_length=64)'

# findings function -> (config body after HEAD, the setting its refusal names); None: the
# function only fixes (nothing for the doctor to refuse).
CASES = {
    "_varlen_findings": None,
    "_hook_findings": None,
    "flash_attn_findings": None,
    "checkpoint_interval_findings": None,  # raised to a multiple of accumulative_counts
    "save_optimizer_findings": None,  # save_optimizer turned on
    # refuses only where a third-party patch was skipped (another release): nothing here to
    # refuse; tests/compat/test_patch_guard.py skips one and sees prepare_config refuse
    "patch_findings": None,
    # refuses only torch or DeepSpeed outside the supported range (another release): nothing
    # here to refuse; tests/compat/test_versions.py simulates one and sees prepare_config refuse
    "version_findings": None,
    "_loader_findings": (
        LOADER.format(
            batch=2,
            dataset='dict(type="process_hf_dataset", pack_to_max_length=True, use_varlen_attn=True)',
            collate='dict(type="default_collate_fn")',
        ),
        "train_dataloader.collate_fn",
    ),
    "loss_normalization_findings": (
        LOADER.format(batch=2, dataset=TEXT, collate=ROPE) + 'loss_normalization = "sequence"\n',
        "loss_normalization",
    ),
    "chunked_loss_findings": (
        LOADER.format(batch=2, dataset=TEXT, collate=ROPE) + 'chunked_loss = "yes"\n',
        "chunked_loss",
    ),
    "multimodal_findings": None,  # LLaVA's fp16 LLM on CPU: fixed (InternVL is served now)
    "internvl_findings": (
        "model.update(type='InternVL_V1_5', model_path=pretrained_model_name_or_path, "
        "quantization_llm=True)\n",
        "model.quantization_llm",
    ),
    "llava_collate_findings": (
        "model.update(type='LLaVAModel', visual_encoder=dict(pretrained_model_name_or_path="
        '"{clip}"))\n'
        + LOADER.format(
            batch=2,
            dataset=TEXT,
            collate='dict(type="llava_collate_fn", max_length=256, image_tokens=4)',
        ),
        "train_dataloader.collate_fn.image_tokens",
    ),
    "crop_size_findings": (
        "model.update(type='LLaVAModel', visual_encoder=dict(pretrained_model_name_or_path="
        '"{clip}"))\n'
        + LOADER.format(
            batch=2,
            dataset='dict(type="LLaVADataset", image_processor=dict('
            'pretrained_model_name_or_path="{processor}"))',
            collate='dict(type="default_collate_fn")',
        ),
        "image_processor",
    ),
    "launch_findings": (
        LOADER.format(batch=2, dataset=TEXT, collate=ROPE)
        + 'train_dataloader.update(sampler=dict(type="InternRepoSampler"))\n',
        "train_dataloader.sampler",
    ),
    "sequence_parallel_heads_findings": (
        LOADER.format(batch=2, dataset=TEXT, collate=ROPE) + "sequence_parallel_size = 3\n",
        "sequence_parallel_size",
    ),
    "_runtime_findings": (
        LOADER.format(batch=2, dataset=TEXT, collate=ROPE)
        + 'optim_wrapper = dict(type="AmpOptimWrapper")\n',
        "optim_wrapper.type",
    ),
    "model_family_findings": (  # as configs write it: the top-level path, the llm's from it
        'pretrained_model_name_or_path = "{bigcode}"\n'
        'model["llm"]["pretrained_model_name_or_path"] = pretrained_model_name_or_path\n',
        "model.llm.",
    ),
    "checkpoint_config_findings": (
        'pretrained_model_name_or_path = "{noconfig}"\n'
        'model["llm"]["pretrained_model_name_or_path"] = pretrained_model_name_or_path\n',
        "model.llm.pretrained_model_name_or_path",
    ),
    "rope_scaling_findings": (
        'pretrained_model_name_or_path = "{badrope}"\n'
        'model["llm"]["pretrained_model_name_or_path"] = pretrained_model_name_or_path\n',
        "model.llm.pretrained_model_name_or_path",
    ),
    "huggingface_trainer_findings": ('framework = "huggingface"\n', "framework"),
    "moss_data_file_findings": (  # XTuner's token cache would be the data file itself
        LOADER.format(
            batch=1,
            dataset='dict(type="MOSSSFTDataset", data_file="{root}/moss.json", bot_name="MOSS")',
            collate=ROPE,
        ),
        "train_dataloader.dataset.data_file",
    ),
    "_heldout_findings": (  # the metric without a held-out set to evaluate
        LOADER.format(batch=2, dataset=TEXT, collate=ROPE)
        + 'val_evaluator = dict(type="TokenLossMetric")\n',
        "val_dataloader",
    ),
    "_shortcut_findings": (  # the shortcut and a held-out loader of its own
        LOADER.format(batch=2, dataset=TEXT, collate=ROPE)
        + "heldout = dict(fraction=0.05)\n"
        + "val_dataloader = dict(train_dataloader)\n",
        "heldout",
    ),
    "preference_findings": (
        "model.update(type='RewardModel')\n"
        + LOADER.format(
            batch=1,
            dataset='dict(type="build_preference_dataset", is_reward=True, reward_token_id=-1)',
            collate='dict(type="preference_collate_fn")',
        ),
        "train_dataloader.dataset.reward_token_id",
    ),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    """The tiny LLM, a tiny CLIP, a processor cropping to 64 px, an unserved checkpoint."""
    import json

    from transformers import CLIPImageProcessor

    from xtuner_rope.demo.tiny_clip import save_tiny_clip

    root = tmp_path_factory.mktemp("agree")
    CLIPImageProcessor(crop_size={"height": 64, "width": 64}).save_pretrained(root / "proc")
    (root / "bigcode").mkdir()
    (root / "bigcode" / "config.json").write_text(json.dumps({"model_type": "gpt_bigcode"}))
    (root / "noconfig").mkdir()  # a checkpoint folder without config.json
    (root / "badrope").mkdir()  # a Llama whose rope_scaling no model computes
    bad = {"model_type": "llama", "max_position_embeddings": 64}
    bad["rope_scaling"] = {"rope_type": "bogus", "factor": 2.0}
    (root / "badrope" / "config.json").write_text(json.dumps(bad))
    return {
        "root": root,
        "tiny": str(ensure_tiny_model()),
        "clip": str(save_tiny_clip(root / "clip")),
        "processor": str(root / "proc"),
        "bigcode": str(root / "bigcode"),
        "noconfig": str(root / "noconfig"),
        "badrope": str(root / "badrope"),
    }


def test_every_findings_function_is_walked():
    """A findings function added later must get a case here (or be declared fixes-only)."""
    assert {fn.__name__ for _, fn in FINDINGS} == set(CASES)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c], ids=str)
def test_each_start_up_refusal_is_the_runs(name, assets, monkeypatch):
    body, setting = CASES[name]
    model = "SupervisedFinetune"
    path = Path(assets["root"]) / f"{name}.py"
    path.write_text(HEAD.format(tiny=assets["tiny"], model=model) + body.format(**assets))
    monkeypatch.setenv("WORLD_SIZE", "2")  # launch_findings: a 2-process run
    with state_kept():
        _, findings, _ = start_like_xtuner_train(str(path))
    doctor = [f for f in findings if f.fix is None]
    assert [f for f in doctor if f.setting.startswith(setting)], [str(f) for f in doctor]
    with state_kept(), pytest.raises(ConfigConflict) as refused:
        start_file(str(path))  # XTuner's set_model_resource -> the plugin's start-up
    for finding in doctor:  # the doctor's lines: "conflict: {setting}: {problem}\n  -> {edit}"
        assert str(finding) in str(refused.value)
