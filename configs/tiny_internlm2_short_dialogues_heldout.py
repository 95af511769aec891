# xtuner-rope `make demo` recipe: the default recipe (tiny_internlm2_short_dialogues.py, same
# settings) with a held-out split: the last 5% of the sample dialogues are held out (training
# keeps the first 95%, no dialogue in both), TokenLossMetric every 50 iterations and at the end,
# the training and held-out loss curves in <work_dir>/heldout_curves.png (docs/evaluation.md).
#   xtuner train configs/tiny_internlm2_short_dialogues_heldout.py   # from the repository root
# The plugin is turned on by `from xtuner_rope import tiny_checkpoint` below: MMEngine parses
# XTuner configs in lazy-import mode (`custom_imports` is silently ignored) and reads that name
# when XTuner calls `model_resource`, and reading a name of the package activates the plugin.
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
from mmengine.optim import CosineAnnealingLR, LinearLR, OptimWrapper
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer

from xtuner.dataset import process_hf_dataset
from xtuner.dataset.map_fns import openai_map_fn, template_map_fn_factory
from xtuner.engine.hooks import DatasetInfoHook, EvaluateChatHook
from xtuner.engine.runner import TrainLoop
from xtuner.model import SupervisedFinetune
from xtuner.utils import PROMPT_TEMPLATE
from xtuner_rope.data.collate import rope_collate_fn
from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook
from xtuner_rope.hooks.loss_norm import TokenWeightedLossHook
from xtuner_rope.hooks.random_state import RandomStateHook
from xtuner_rope.hooks.monitor import NonFiniteTripwireHook, PackingMetricsHook
from xtuner_rope import tiny_checkpoint

#######################################################################
#                          PART 1  Settings                           #
#######################################################################
# Model: built offline from the sample data when missing (paths relative to the repo root).
pretrained_model_name_or_path = "models/tiny-internlm2"
# `xtuner train` calls this first: it builds the tiny checkpoint if needed; read from the
# package, the name turned the plugin on (compat patches, hooks) before XTuner builds anything.
model_resource = dict(fn=tiny_checkpoint, args=dict(data_path="data/short_dialogues.jsonl"))
attn_implementation = "sdpa"

# Data
data_path = "data/short_dialogues.jsonl"
prompt_template = PROMPT_TEMPLATE.internlm2_chat
max_length = 512  # longest dialogue after templating is well below this
pack = True  # collate-time packing: each batch's dialogues share as few rows as possible
pad_to_multiple_of = 64

# Scheduler & Optimizer
batch_size = 16  # dialogues per device and step (packed into rows of max_length)
accumulative_counts = 1
dataloader_num_workers = 0
max_epochs = 1
optim_type = AdamW
lr = 3e-3  # a 200k-parameter model from scratch wants a large step
betas = (0.9, 0.98)
weight_decay = 0.0
max_norm = 1.0  # grad clip
warmup_ratio = 0.03

# Save
save_steps = 100
save_total_limit = 1  # keep only the newest checkpoint

# Evaluate the generation performance during the training
evaluation_freq = 100
evaluation_inputs = ["Hello!", "What is 7 plus 5?"]
evaluation_max_new_tokens = 24

# Reproducibility
seed = 0

# Held-out evaluation: the start-up writes val_dataloader / val_evaluator / val_cfg from this
# one setting (a fraction in whole percents, or dict(data_files=PATH) for another file).
heldout = dict(fraction=0.05, interval=50)

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
    use_activation_checkpointing=False,
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        trust_remote_code=True,
        torch_dtype=torch.float32,
        # stored in config.json but overridden by from_pretrained's default (eager)
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
    pack_to_max_length=False,
    map_num_proc=1,
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
        pad_to_multiple_of=pad_to_multiple_of,
    ),
)

#######################################################################
#                    PART 4  Scheduler & Optimizer                    #
#######################################################################
# fp32 OptimWrapper: MMEngine's AmpOptimWrapper refuses a CPU-only machine.
optim_wrapper = dict(
    type=OptimWrapper,
    optimizer=dict(type=optim_type, lr=lr, betas=betas, weight_decay=weight_decay),
    clip_grad=dict(max_norm=max_norm, error_if_nonfinite=False),
    accumulative_counts=accumulative_counts,
)

param_scheduler = [
    dict(
        type=LinearLR,
        start_factor=1e-2,
        by_epoch=True,
        begin=0,
        end=warmup_ratio * max_epochs,
        convert_to_iter_based=True,
    ),
    dict(
        type=CosineAnnealingLR,
        eta_min=lr * 0.1,
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
    # packing figures next to the loss; stop at the first NaN/inf loss or grad norm, save the batch
    dict(type=PackingMetricsHook),
    dict(type=NonFiniteTripwireHook),
    # every supervised token of an optimizer step weighs the same (opt out:
    # loss_normalization = "micro_batch")
    dict(type=TokenWeightedLossHook),
    # every process's random state with each checkpoint: a resume draws what the run drew
    dict(type=RandomStateHook),
    dict(type=DatasetInfoHook, tokenizer=tokenizer),
    dict(
        type=EvaluateChatHook,
        tokenizer=tokenizer,
        every_n_iters=evaluation_freq,
        evaluation_inputs=evaluation_inputs,
        prompt_template=prompt_template,
        max_new_tokens=evaluation_max_new_tokens,
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
