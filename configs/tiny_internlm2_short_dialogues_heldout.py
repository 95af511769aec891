# `make demo`: the default recipe (tiny_internlm2_short_dialogues.py, every setting inherited)
# with a held-out split: the last 5% of the sample dialogues are held out (training keeps the
# first 95%, no dialogue in both), TokenLossMetric every 50 iterations and at the end, the
# training and held-out loss curves in <work_dir>/heldout_curves.png (docs/evaluation.md).
#   xtuner train configs/tiny_internlm2_short_dialogues_heldout.py   # from the repository root
from mmengine.config import read_base

with read_base():
    from .tiny_internlm2_short_dialogues import *  # noqa: F401,F403

#######################################################################
#                          PART 1  Settings                           #
#######################################################################
# The start-up writes val_dataloader / val_evaluator / val_cfg from this one setting.
heldout = dict(fraction=0.05, interval=50)
