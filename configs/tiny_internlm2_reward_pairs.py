# xtuner-rope reward-model recipe: the embedded tiny InternLM2 with a scalar head, trained to
# score chosen above rejected on our sample preference pairs (data/preference_pairs.jsonl),
# packed pairs, on CPU in about a minute.
#
#   xtuner train configs/tiny_internlm2_reward_pairs.py   # run from the repository root
#
# XTuner's stock `internlm2_chat_1_8b_reward_full_varlenattn_ultrafeedback` made tiny:
# the same model, dataset, packing (PackedDatasetWrapper: whole pairs, chosen then rejected,
# `cumulative_len` per response) and collate function. The plugin's packed attention isolates
# every response on any attention backend, no flash-attn: each response gets the score it gets
# alone.
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

from xtuner.dataset.collate_fns.preference_collate_fn import preference_collate_fn
from xtuner.dataset.preference_dataset import build_preference_dataset, orpo_dpo_mix_40k_map_fn
from xtuner.engine.hooks import DatasetInfoHook
from xtuner.engine.runner import TrainLoop
from xtuner.model.reward import RewardModel
from xtuner_rope.hooks import PackedBatchCheckHook, ValidatedRoPEHook
from xtuner_rope.hooks.loss_norm import TokenWeightedLossHook
from xtuner_rope.hooks.random_state import RandomStateHook
from xtuner_rope.hooks.monitor import NonFiniteTripwireHook, PackingMetricsHook
from xtuner_rope import tiny_checkpoint

#######################################################################
#                          PART 1  Settings                           #
#######################################################################
# Model: built offline from the sample dialogues when missing (paths relative to the repo root).
pretrained_model_name_or_path = "models/tiny-internlm2"
# `xtuner train` calls this first: it builds the tiny checkpoint if needed; read from the
# package, the name turned the plugin on (compat patches, hooks) before XTuner builds anything.
model_resource = dict(fn=tiny_checkpoint, args=dict(data_path="data/short_dialogues.jsonl"))
# Pack whole pairs (XTuner's `use_varlen_attn` of the model, dataset and collate function;
# named so because XTuner's top-level `use_varlen_attn` demands flash-attn): no flash-attn
pack_pairs = True
# Appended to every response; the score is read there. It must be inside the vocabulary and
# never produced by the tokenizer: the stock 92527 is InternLM2's [UNUSED_TOKEN_130]; the tiny
# vocabulary (1,024 ids) has <unk> (id 3), which its byte-level BPE never emits.
reward_token_id = 3
loss_type = "focal"  # XTuner's: "ranking" or "focal"
penalty_type = "log_barrier"  # XTuner's: "log_barrier", "L2" or "none"

# Data: 300 pairs built by tools/make_preference_data.py from data/short_dialogues.jsonl
data_path = "data/preference_pairs.jsonl"
max_length = 256  # per response (prompt + answer); the longest is well below
max_packed_length = max_length * 2  # one packed row: whole pairs, chosen then rejected

# Scheduler & Optimizer
batch_size = 1  # packed rows per step: XTuner's preference_collate_fn takes one
accumulative_counts = 1
dataloader_num_workers = 0
max_epochs = 1  # XTuner: a reward model should not be trained for more than 1 epoch
optim_type = AdamW
lr = 1e-3  # a 200k-parameter model wants a large step
betas = (0.9, 0.999)
weight_decay = 0.0
max_norm = 1.0  # grad clip
warmup_ratio = 0.03

# Save
save_steps = 100
save_total_limit = 1  # keep only the newest checkpoint

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
    type=RewardModel,  # llm's LM head becomes a scalar head (starting at zero)
    use_varlen_attn=pack_pairs,
    loss_type=loss_type,
    penalty_type=penalty_type,
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        trust_remote_code=True,
    ),
)

#######################################################################
#                      PART 3  Dataset & Dataloader                   #
#######################################################################
train_dataset = dict(
    type=build_preference_dataset,
    dataset=dict(type=load_dataset, path="json", data_files=dict(train=data_path)),
    tokenizer=tokenizer,
    max_length=max_length,
    dataset_map_fn=orpo_dpo_mix_40k_map_fn,
    is_dpo=False,
    is_reward=True,
    reward_token_id=reward_token_id,
    num_proc=1,
    use_varlen_attn=pack_pairs,
    max_packed_length=max_packed_length,
    shuffle_before_pack=True,
)

train_dataloader = dict(
    batch_size=batch_size,
    num_workers=dataloader_num_workers,
    dataset=train_dataset,
    sampler=dict(type=DefaultSampler, shuffle=True),
    collate_fn=dict(type=preference_collate_fn, use_varlen_attn=pack_pairs),
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
    # xtuner-rope: validated fp32 RoPE + response-isolating attention, and per-batch checks
    # (they replace XTuner's VarlenAttnArgsToMessageHubHook: same MessageHub keys).
    dict(type=ValidatedRoPEHook),
    dict(type=PackedBatchCheckHook),
    # packing figures next to the loss (docs_per_row counts responses: two per pair); stop at
    # the first NaN/inf loss or grad norm, save the batch
    dict(type=PackingMetricsHook),
    dict(type=NonFiniteTripwireHook),
    dict(type=TokenWeightedLossHook),
    # every process's random state with each checkpoint: a resume draws what the run drew
    dict(type=RandomStateHook),
    dict(type=DatasetInfoHook, tokenizer=tokenizer),
]

default_hooks = dict(
    timer=dict(type=IterTimerHook),
    logger=dict(type=LoggerHook, log_metric_by_epoch=False, interval=5),
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
