# xtuner-rope recipe: full fine-tune of Qwen2.5-7B-Instruct with DeepSpeed ZeRO-2 (bf16) on short
# dialogues, each batch's dialogues packed into rows with per-document RoPE positions.
#
#   huggingface-cli download Qwen/Qwen2.5-7B-Instruct --local-dir models/qwen2_5-7b-instruct
#   NPROC_PER_NODE=8 xtuner train configs/qwen2_5_7b_instruct_full_zero2_short_dialogues.py
#
# Run from the repository root: the paths in PART 1 are relative to it. DeepSpeed is set up in
# PART 4 (runner_type, strategy, optim_wrapper), so no `--deepspeed` flag is needed; the JSON
# states bf16 explicitly. The plugin is on through `model_resource` (loads
# xtuner_rope before XTuner builds anything, checks the config, adds the plugin's hooks where
# missing) and `rope_collate_fn` (packing with positions restarting per dialogue); PART 5
# lists the hooks.
import torch
from datasets import load_dataset
from mmengine.dataset import DefaultSampler
from mmengine.hooks import (
    CheckpointHook,
    DistSamplerSeedHook,
    IterTimerHook,
    LoggerHook,
    ParamSchedulerHook,
)
from mmengine.optim import CosineAnnealingLR, LinearLR
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from xtuner.dataset import process_hf_dataset
from xtuner.dataset.map_fns import openai_map_fn, template_map_fn_factory
from xtuner.engine import DeepSpeedStrategy
from xtuner.engine.hooks import DatasetInfoHook, EvaluateChatHook
from xtuner.engine.runner import TrainLoop
from xtuner.model import SupervisedFinetune
from xtuner.utils import PROMPT_TEMPLATE
from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook
from xtuner_rope import enable_xtuner_rope

#######################################################################
#                          PART 1  Settings                           #
#######################################################################
# Model: a local copy of Qwen/Qwen2.5-7B-Instruct (see the download line above).
pretrained_model_name_or_path = "models/qwen2_5-7b-instruct"
# `xtuner train` calls this first: it checks the path is a local checkpoint, loads the plugin
# (compat patches) and checks/prepares this config before XTuner builds anything.
model_resource = dict(fn=enable_xtuner_rope, args=dict(local_only=True))
attn_implementation = "sdpa"  # "flash_attention_2" if flash-attn is installed
use_activation_checkpointing = True

# Data: OpenAI-messages JSONL, one dialogue per line (the sample data by default).
data_path = "data/short_dialogues.jsonl"
prompt_template = PROMPT_TEMPLATE.qwen_chat
max_length = 2048  # tokens per packed row; a longer dialogue is truncated to this
pack = True  # collate-time packing: each batch's dialogues share as few rows as possible

# Parallel: DeepSpeed ZeRO-2, bf16 (fp16/bf16 stated explicitly in the JSON)
deepspeed_config = "configs/deepspeed/zero2_bf16.json"

# Scheduler & Optimizer
batch_size = 16  # dialogues per GPU and step, packed into rows of max_length
accumulative_counts = 2
dataloader_num_workers = 2
max_epochs = 3
optim_type = AdamW
lr = 2e-5
betas = (0.9, 0.999)
weight_decay = 0
max_norm = 1  # grad clip
warmup_ratio = 0.03

# Save
save_steps = 500
save_total_limit = 2  # Maximum checkpoints to keep (-1 means unlimited)

# Evaluate the generation performance during the training
evaluation_freq = 500
evaluation_inputs = [
    "Can you write Omar a get-well message? Sign it from Maria.",
    "What is 7 plus 5?",
]

# Reproducibility
seed = 0

#######################################################################
#                      PART 2  Model & Tokenizer                      #
#######################################################################
tokenizer = dict(
    type=AutoTokenizer.from_pretrained,
    pretrained_model_name_or_path=pretrained_model_name_or_path,
    trust_remote_code=True,
    padding_side="right",
)

model = dict(
    type=SupervisedFinetune,
    use_activation_checkpointing=use_activation_checkpointing,
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        trust_remote_code=True,
        torch_dtype=torch.bfloat16,
        # from_pretrained's default (eager) would override the checkpoint's setting
        attn_implementation=attn_implementation,
    ),
)

#######################################################################
#                      PART 3  Dataset & Dataloader                   #
#######################################################################
train_dataset = dict(
    type=process_hf_dataset,
    dataset=dict(type=load_dataset, path="json", data_files=dict(train=data_path)),
    tokenizer=tokenizer,
    max_length=max_length,
    dataset_map_fn=openai_map_fn,
    template_map_fn=dict(type=template_map_fn_factory, template=prompt_template),
    remove_unused_columns=True,
    shuffle_before_pack=True,
    pack_to_max_length=False,  # packing happens per batch, in rope_collate_fn
)

train_dataloader = dict(
    batch_size=batch_size,
    num_workers=dataloader_num_workers,
    dataset=train_dataset,
    sampler=dict(type=DefaultSampler, shuffle=True),
    collate_fn=dict(
        type=rope_collate_fn,
        pack=pack,
        max_length=max_length,
        use_varlen_attn=False,
    ),
)

#######################################################################
#                    PART 4  Scheduler & Optimizer                    #
#######################################################################
# What `xtuner train --deepspeed <json>` would set up, written out so the recipe is complete.
# The string type lets `xtuner train` see that DeepSpeed is already configured.
optim_wrapper = dict(
    type="DeepSpeedOptimWrapper",
    optimizer=dict(type=optim_type, lr=lr, betas=betas, weight_decay=weight_decay),
)

strategy = dict(
    type=DeepSpeedStrategy,
    config=deepspeed_config,
    gradient_accumulation_steps=accumulative_counts,
    train_micro_batch_size_per_gpu=batch_size,
    gradient_clipping=max_norm,
    exclude_frozen_parameters=True,
    sequence_parallel_size=1,
)

runner_type = "FlexibleRunner"

param_scheduler = [
    dict(
        type=LinearLR,
        start_factor=1e-5,
        by_epoch=True,
        begin=0,
        end=warmup_ratio * max_epochs,
        convert_to_iter_based=True,
    ),
    dict(
        type=CosineAnnealingLR,
        eta_min=0.0,
        by_epoch=True,
        begin=warmup_ratio * max_epochs,
        end=max_epochs,
        convert_to_iter_based=True,
    ),
]

train_cfg = dict(type=TrainLoop, max_epochs=max_epochs)

#######################################################################
#                           PART 5  Runtime                           #
#######################################################################
custom_hooks = [
    # xtuner-rope: validated fp32 RoPE + document-isolating attention, and per-batch checks.
    dict(type=ValidatedRoPEHook),
    dict(type=PackedBatchCheckHook),
    dict(type=DatasetInfoHook, tokenizer=tokenizer),
    dict(
        type=EvaluateChatHook,
        tokenizer=tokenizer,
        every_n_iters=evaluation_freq,
        evaluation_inputs=evaluation_inputs,
        prompt_template=prompt_template,
    ),
]

default_hooks = dict(
    timer=dict(type=IterTimerHook),
    logger=dict(type=LoggerHook, log_metric_by_epoch=False, interval=10),
    param_scheduler=dict(type=ParamSchedulerHook),
    checkpoint=dict(
        type=CheckpointHook,
        by_epoch=False,
        interval=save_steps,
        max_keep_ckpts=save_total_limit,
    ),
    sampler_seed=dict(type=DistSamplerSeedHook),
)

env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method="fork", opencv_num_threads=0),
    dist_cfg=dict(backend="nccl"),
)

visualizer = None
log_level = "INFO"
load_from = None
resume = False
randomness = dict(seed=seed, deterministic=False)
log_processor = dict(by_epoch=False)
