"""Every recipe in configs/ parses, names only objects that exist, enables the plugin, and builds.

The GPU recipes (InternLM2-chat-1.8B / 7B, full fine-tune with ZeRO-2 / ZeRO-3, QLoRA) are
built here with the embedded tiny InternLM2 standing in for the real checkpoint, through the
same builders `xtuner train` uses (model, dataset, collate function, the plugin's hooks), and
take one forward/backward step. What a CPU cannot do is left out and said so: DeepSpeed is not
initialised (ZeRO shards nothing on one process; tests/test_multiprocess.py runs ZeRO-2 and
ZeRO-3 for real), and the QLoRA recipes drop ``quantization_config`` because bitsandbytes' 4-bit kernels
need CUDA (with a GPU, ``test_qlora_recipe_quantizes_on_gpu`` keeps it).
"""

import copy
import json
import re
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from mmengine.config import Config, ConfigDict
from mmengine.config.lazy import LazyAttr, LazyObject
from runners import bare_runner

from xtuner_rope.compat.mmengine_config import config_dict

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.py"))
TINY_RECIPES = [c for c in CONFIGS if c.startswith("configs/tiny_")]  # CPU recipes
GPU_RECIPES = [c for c in CONFIGS if c not in TINY_RECIPES]
LLAVA_RECIPES = [c for c in CONFIGS if "llava" in c]  # multimodal: LLaVADataset, no packing
# DPO / reward model on packed preference pairs (build_preference_dataset, preference_collate_fn)
PREFERENCE_RECIPES = {
    "configs/tiny_internlm2_dpo_pairs.py": "DPO",
    "configs/tiny_internlm2_reward_pairs.py": "RewardModel",
}
TEXT_RECIPES = [c for c in CONFIGS if c not in LLAVA_RECIPES and c not in PREFERENCE_RECIPES]
DEEPSPEED_JSONS = sorted(
    str(p.relative_to(REPO)) for p in (REPO / "configs" / "deepspeed").glob("*.json")
)
TINY_MODEL = "models/tiny-internlm2"
BANNERS = [
    "Settings",
    "Model & Tokenizer",
    "Dataset & Dataloader",
    "Scheduler & Optimizer",
    "Runtime",
]
PART1_NAMES = [
    "pretrained_model_name_or_path",
    "data_path",
    "max_length",
    "batch_size",
    "lr",
    "max_epochs",
]


def _load(config: str) -> Config:
    return Config.fromfile(str(REPO / config))


def _leaves(node, where: str = "cfg"):
    """Every (path, value) below ``node``, without building MMEngine's lazy objects."""
    if isinstance(node, dict):
        for key, value in dict.items(node):
            yield from _leaves(value, f"{where}.{key}")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _leaves(value, f"{where}[{i}]")
    else:
        yield where, node


def _registries():
    import mmengine.registry as mm
    from xtuner.registry import BUILDER, MAP_FUNC

    return [obj for obj in vars(mm).values() if isinstance(obj, mm.Registry)] + [BUILDER, MAP_FUNC]


def _built(value):
    return value.build() if isinstance(value, (LazyObject, LazyAttr)) else value


def _type(node):
    return _built(dict.get(node, "type"))


def test_configs_are_found():
    assert {
        "configs/tiny_internlm2_short_dialogues.py",
        "configs/tiny_qwen2_short_dialogues.py",
    } <= set(TINY_RECIPES)
    assert len(GPU_RECIPES) >= 12, GPU_RECIPES
    assert {
        "configs/deepspeed/zero2_bf16.json",
        "configs/deepspeed/zero3_bf16.json",
        "configs/deepspeed/zero2_fp32_cpu.json",
        "configs/deepspeed/zero3_fp32_cpu.json",
    } <= set(DEEPSPEED_JSONS)


@pytest.mark.parametrize("config", CONFIGS)
def test_every_named_object_resolves(config):
    """Imports, attributes and registry names all exist (a typo fails here, not on a GPU)."""
    cfg = _load(config)
    leaves = list(_leaves(config_dict(cfg)))
    for where, value in leaves:
        if isinstance(value, (LazyObject, LazyAttr)):
            assert value.build() is not None, where  # raises on a missing module or name
    registries = _registries()
    names = [
        (w, v)
        for w, v in leaves
        if isinstance(v, str) and (w.endswith(".type") or w == "cfg.runner_type")
    ]
    for where, name in names:
        assert any(registry.get(name) is not None for registry in registries), (
            f"{where} = {name!r} is in no MMEngine/XTuner registry"
        )


@pytest.mark.parametrize("config", TEXT_RECIPES)
def test_recipe_is_xtuner_style_and_enables_the_plugin(config):
    from xtuner_rope.data.collate import rope_collate_fn
    from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook

    text = (REPO / config).read_text()
    found = [text.find(f"PART {i}  {title}") for i, title in enumerate(BANNERS, start=1)]
    assert -1 not in found and found == sorted(found), f"PART 1-5 banners: {found}"
    part1 = text[found[0] : found[1]]
    for name in PART1_NAMES:
        assert re.search(rf"^{name} = ", part1, re.M), f"{name} is not set in PART 1"

    cfg = _load(config)
    assert cfg.model.llm.pretrained_model_name_or_path == cfg.pretrained_model_name_or_path
    assert cfg.tokenizer.pretrained_model_name_or_path == cfg.pretrained_model_name_or_path
    loader = cfg.train_dataloader
    assert loader.dataset.dataset.data_files.train == cfg.data_path
    collate = loader.collate_fn
    assert _type(collate) is rope_collate_fn
    assert collate.pack is True and collate.max_length == cfg.max_length
    assert not collate.get("use_varlen_attn", False)
    hooks = [_type(h) for h in cfg.custom_hooks]
    assert ValidatedRoPEHook in hooks and PackedBatchCheckHook in hooks
    # model_resource is what imports xtuner_rope (and its compat patches) before the model is
    # built: MMEngine's lazy import would load the collate function and hooks only later.
    fn = _built(dict.get(cfg.model_resource, "fn"))
    assert fn.__module__.startswith("xtuner_rope."), fn


@pytest.mark.parametrize("config", LLAVA_RECIPES)
def test_llava_recipe_is_xtuner_style_and_enables_the_plugin(config):
    text = (REPO / config).read_text()
    found = [text.find(f"PART {i}  ") for i in range(1, 6)]
    assert -1 not in found and found == sorted(found), f"PART 1-5 banners: {found}"
    part1 = text[found[0] : found[1]]
    for name in (
        "llm_name_or_path",
        "visual_encoder_name_or_path",
        "model_resource",
        "data_path",
        "image_folder",
        "max_length",
        "batch_size",
        "lr",
        "max_epochs",
    ):
        assert re.search(rf"^{name} = ", part1, re.M), f"{name} is not set in PART 1"
    cfg = _load(config)
    assert cfg.model.llm.pretrained_model_name_or_path == cfg.llm_name_or_path
    assert (
        cfg.model.visual_encoder.pretrained_model_name_or_path
        == cfg.visual_encoder_name_or_path
        == cfg.image_processor.pretrained_model_name_or_path
    )
    assert cfg.train_dataloader.dataset.data_path == cfg.data_path
    fn = _built(dict.get(cfg.model_resource, "fn"))
    assert fn.__module__.startswith("xtuner_rope."), fn
    assert _type(cfg.optim_wrapper).__name__ == "OptimWrapper"  # fp32 on CPU


@pytest.mark.parametrize("config", sorted(PREFERENCE_RECIPES))
def test_preference_recipe_is_xtuner_style_and_packs_pairs(config, tmp_path):
    """XTuner style, the edit, packed pairs everywhere, fp32; the start-up has nothing to change
    or refuse; model, packed dataset and collate function build and take one step."""
    from xtuner.dataset.collate_fns.preference_collate_fn import preference_collate_fn
    from xtuner.dataset.preference_dataset import build_preference_dataset

    from xtuner_rope.config.fields import type_name
    from xtuner_rope.config.runtime import PLUGIN_HOOKS
    from xtuner_rope.config.startup import inspect_config

    text = (REPO / config).read_text()
    found = [text.find(f"PART {i}  {title}") for i, title in enumerate(BANNERS, start=1)]
    assert -1 not in found and found == sorted(found), f"PART 1-5 banners: {found}"
    part1 = text[found[0] : found[1]]
    names = PART1_NAMES + ["model_resource", "pack_pairs", "max_packed_length"]
    names += ["reward_token_id"] if "reward" in config else ["loss_beta"]
    for name in names:
        assert re.search(rf"^{name} = ", part1, re.M), f"{name} is not set in PART 1"

    cfg = _load(config)
    fn = _built(dict.get(cfg.model_resource, "fn"))
    assert fn.__module__.startswith("xtuner_rope."), fn
    assert type_name(dict.get(cfg.model, "type")) == PREFERENCE_RECIPES[config]
    assert cfg.model.llm.pretrained_model_name_or_path == cfg.pretrained_model_name_or_path
    assert cfg.tokenizer.pretrained_model_name_or_path == cfg.pretrained_model_name_or_path
    loader = cfg.train_dataloader
    assert _type(loader.dataset) is build_preference_dataset
    assert loader.dataset.dataset.data_files.train == cfg.data_path
    assert (REPO / cfg.data_path).stat().st_size < 200_000
    assert _type(loader.collate_fn) is preference_collate_fn
    assert cfg.pack_pairs is True and "use_varlen_attn" not in cfg  # no flash-attn switch
    assert (
        cfg.model.use_varlen_attn
        is loader.dataset.use_varlen_attn
        is loader.collate_fn.use_varlen_attn
        is True
    )
    assert loader.dataset.max_packed_length == cfg.max_packed_length and cfg.batch_size == 1
    assert _type(cfg.optim_wrapper).__name__ == "OptimWrapper"  # fp32 on CPU
    assert {type_name(dict.get(h, "type")) for h in cfg.custom_hooks} >= set(PLUGIN_HOOKS)
    assert cfg.default_hooks.logger.interval <= 10

    cfg = _tiny_cfg(config, quantize=False)
    assert inspect_config(cfg) == []  # nothing to fix, nothing to refuse (doctor: OK)
    # XTuner's PackedDatasetWrapper shuffles with numpy's global generator (MMEngine seeds it
    # in a run): seeded here, the row does not depend on what earlier tests drew.
    np.random.seed(0)
    model, batch = _train_step(cfg, tmp_path)
    starts = int((batch["data"]["position_ids"][0] == 0).sum())
    assert starts >= 4 and starts % 2 == 0, starts  # whole pairs, several in the packed row


@pytest.mark.parametrize("path", DEEPSPEED_JSONS)
def test_deepspeed_json_states_its_dtype(path):
    ds = json.loads((REPO / path).read_text())
    fp16, bf16 = ds["fp16"]["enabled"], ds["bf16"]["enabled"]
    # "auto" resolves to fp16 on a CPU machine (xtuner's auto_dtype_of_deepspeed_config).
    assert isinstance(fp16, bool) and isinstance(bf16, bool) and not (fp16 and bf16)
    stage = int(re.search(r"zero(\d)", Path(path).name).group(1))
    assert ds["zero_optimization"]["stage"] == stage
    assert bf16 == ("bf16" in Path(path).name) and not fp16


@pytest.mark.parametrize("config", GPU_RECIPES)
def test_gpu_recipe_is_bf16(config):
    cfg = _load(config)
    llm = cfg.model.llm
    assert llm.torch_dtype is torch.bfloat16
    assert llm.attn_implementation in ("sdpa", "flash_attention_2")
    if "strategy" in cfg:  # full fine-tune with DeepSpeed set up in the recipe
        assert cfg.runner_type == "FlexibleRunner"
        assert cfg.optim_wrapper.type == "DeepSpeedOptimWrapper"
        assert cfg.strategy.config == cfg.deepspeed_config
        ds = json.loads((REPO / cfg.deepspeed_config).read_text())
        assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
        stage = int(re.search(r"_zero(\d)_", config).group(1))
        assert ds["zero_optimization"]["stage"] == stage
        assert cfg.strategy.train_micro_batch_size_per_gpu == cfg.batch_size
        assert cfg.strategy.gradient_accumulation_steps == cfg.accumulative_counts
        assert "quantization_config" not in llm and "lora" not in cfg.model
    else:  # QLoRA with MMEngine's AMP
        from mmengine.optim import AmpOptimWrapper

        assert _type(cfg.optim_wrapper) is AmpOptimWrapper
        assert cfg.optim_wrapper.dtype == "bfloat16"
        quant = llm.quantization_config
        assert quant.load_in_4bit is True and quant.bnb_4bit_compute_dtype is torch.bfloat16
        assert "lora" in cfg.model


def _family(config: str) -> str:
    """The tiny stand-in family of a recipe, from its name."""
    name = Path(config).name
    return (
        "qwen2" if name.startswith("qwen") else "llama" if name.startswith("llama") else "internlm2"
    )


def _tiny_cfg(config: str, quantize: bool) -> Config:
    """The recipe with the tiny model of its family everywhere the real checkpoint was named."""
    from xtuner.tools.utils import set_model_resource

    from xtuner_rope.demo.resources import tiny_checkpoint

    family = _family(config)
    tiny = TINY_MODEL if family == "internlm2" else f"models/tiny-{family}"
    # Build it if this is the first test to need it (a fresh clone has no models/).
    tiny_checkpoint(
        str(REPO / tiny), data_path=str(REPO / "data" / "short_dialogues.jsonl"), family=family
    )
    cfg = _load(config)
    cfg.pretrained_model_name_or_path = tiny
    if not torch.cuda.is_available():  # the README's CPU edit (the start-up refuses AMP here)
        from mmengine.optim import OptimWrapper

        for key in ("loss_scale", "dtype"):
            cfg.optim_wrapper.pop(key, None)
        cfg.optim_wrapper.type = OptimWrapper
        if "deepspeed_config" in cfg:  # the start-up's edit: bf16 DeepSpeed refused on CPU
            cfg.deepspeed_config = cfg.strategy.config = cfg.deepspeed_config.replace(
                "_bf16.json", "_fp32_cpu.json"
            )
    set_model_resource(cfg)  # as `xtuner train` does: replaces every nested model path
    if not quantize:
        cfg.model.llm.pop("quantization_config", None)
    return cfg


def _train_step(cfg: Config, work_dir) -> tuple[torch.nn.Module, dict]:
    """Build model, dataset, collate function and plugin hooks as MMEngine does; one step."""
    from mmengine.registry import FUNCTIONS, MODELS
    from xtuner.registry import BUILDER

    from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook
    from xtuner_rope.models.dispatch import isolates_documents

    model = MODELS.build(cfg.model)
    dataset = BUILDER.build(cfg.train_dataloader.dataset)
    collate_cfg = copy.deepcopy(cfg.train_dataloader.collate_fn)
    collate_type = collate_cfg.pop("type")
    collate_type = FUNCTIONS.get(collate_type) if isinstance(collate_type, str) else collate_type
    collate = partial(collate_type, **collate_cfg)
    batch = collate([dataset[i] for i in range(cfg.batch_size)])

    # A real Runner registers the plugin's hooks of the recipe, in its own order.
    runner = bare_runner(
        model,
        work_dir,
        [
            copy.deepcopy(h)
            for h in cfg.custom_hooks
            if _type(h) in (ValidatedRoPEHook, PackedBatchCheckHook)
        ],
    )
    plugin = [h for h in runner.hooks if isinstance(h, (ValidatedRoPEHook, PackedBatchCheckHook))]
    assert [type(h) for h in plugin] == [ValidatedRoPEHook, PackedBatchCheckHook]
    for hook in plugin:
        hook.before_train(runner)
    assert isolates_documents(model), "ValidatedRoPEHook did not patch the attention layers"
    for hook in plugin:
        hook.before_train_iter(runner, batch_idx=0, data_batch=batch)
    loss, _ = model.parse_losses(model(**batch, mode="loss"))  # as OptimWrapper steps
    loss.backward()
    for hook in plugin:
        hook.after_train_iter(runner, batch_idx=0, data_batch=batch, outputs=None)
    assert torch.isfinite(loss), loss
    return model, batch


@pytest.mark.slow
@pytest.mark.parametrize("config", GPU_RECIPES)
def test_gpu_recipe_builds_and_steps_with_tiny_model(config, tmp_path):
    """On CPU: no DeepSpeed init, and QLoRA without quantization_config (needs CUDA kernels)."""
    cfg = _tiny_cfg(config, quantize=False)
    model, batch = _train_step(cfg, tmp_path)
    expected = {
        "internlm2": "InternLM2ForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "llama": "LlamaForCausalLM",
    }[_family(config)]
    assert expected in {type(m).__name__ for m in model.modules()}
    data = batch["data"]
    b, s = data["input_ids"].shape
    assert s <= cfg.max_length and b < cfg.batch_size, "the batch was not packed"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trainable and with_grad <= trainable
    if "lora" in cfg.model:
        assert trainable and all("lora_" in n for n in trainable), sorted(trainable)[:5]
        assert len(with_grad) == len(trainable)
    else:
        assert next(model.llm.parameters()).dtype is torch.bfloat16
        assert len(with_grad) >= len(trainable) - 1  # all but possibly an unused embedding


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes 4-bit needs CUDA")
@pytest.mark.parametrize("config", [c for c in GPU_RECIPES if "qlora" in c])
def test_qlora_recipe_quantizes_on_gpu(config, tmp_path):
    cfg = _tiny_cfg(config, quantize=True)
    model, _ = _train_step(cfg, tmp_path)
    assert any("4bit" in type(m).__name__ for m in model.modules())


def _without_paths(node, where="cfg"):
    """{path: repr(value)} of every leaf below ``node`` but the checkpoint paths."""
    return {
        w: repr(v)
        for w, v in _leaves(node, where)
        if not w.endswith(".pretrained_model_name_or_path")
    }


@pytest.mark.parametrize(
    "config",
    [
        next(c for c in GPU_RECIPES if "qlora" not in c),
        next(c for c in GPU_RECIPES if "qlora" in c),
    ],
)
def test_config_dicts_are_plain_after_tiny_override(config):
    """The override helper only swaps paths: it keeps ConfigDicts and leaves other keys alone.

    Besides the paths it changes what it says it does (the README's CPU edit of the optimizer
    wrapper, QLoRA's quantization left out) and what `xtuner train`'s start-up does to every
    config (the plugin's missing hooks put first in custom_hooks): nothing else.
    """
    from xtuner_rope.config.fields import type_name
    from xtuner_rope.config.runtime import PLUGIN_HOOKS

    real, cfg = _load(config), _tiny_cfg(config, quantize=False)
    assert isinstance(cfg.model, ConfigDict)
    paths = [
        v for w, v in _leaves(config_dict(cfg)) if w.endswith(".pretrained_model_name_or_path")
    ]
    assert paths and set(paths) == {TINY_MODEL}
    real_hooks, hooks = config_dict(real).pop("custom_hooks"), config_dict(cfg).pop("custom_hooks")
    added = len(hooks) - len(real_hooks)
    assert {type_name(dict.get(h, "type")) for h in hooks[:added]} <= set(PLUGIN_HOOKS)
    assert [_without_paths(h) for h in hooks[added:]] == [_without_paths(h) for h in real_hooks]
    before, after = _without_paths(config_dict(real)), _without_paths(config_dict(cfg))
    changed = {w for w in before.keys() | after.keys() if before.get(w) != after.get(w)}
    allowed = ("cfg.model.llm.quantization_config.",) if "qlora" in config else ()
    if not torch.cuda.is_available():
        allowed += ("cfg.optim_wrapper.", "cfg.deepspeed_config", "cfg.strategy.config")
    assert {w for w in changed if not w.startswith(allowed)} == set(), sorted(changed)
    assert ("cfg.optim_wrapper.type" in changed) is not torch.cuda.is_available()
