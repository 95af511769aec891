"""xtuner-rope: correct, crash-free RoPE and packed short-dialogue SFT for XTuner 0.x.

Turn it on in an XTuner config with ``model_resource = dict(fn=enable_xtuner_rope)`` (see
``xtuner_rope.startup``). Importing the package applies the third-party patches of ``xtuner_rope.compat`` (each only
where its gap exists) and registers the hooks in MMEngine's ``HOOKS`` and the collate
function in MMEngine's ``FUNCTIONS``, so configs can name them by string as well as by object.
"""

from mmengine.registry import FUNCTIONS, HOOKS

from . import compat

compat.apply()

from xtuner_rope.ops.rope import apply_rotary_pos_emb  # noqa: E402

from .collate import rope_collate_fn  # noqa: E402
from .collate_llava import llava_collate_fn  # noqa: E402
from .hooks import PackedBatchCheckHook, ValidatedRoPEHook  # noqa: E402
from .loss_norm import TokenWeightedLossHook  # noqa: E402
from .models.internlm2 import patch_internlm2_attention  # noqa: E402
from .models.internlm2_rope import ValidatedRotaryEmbedding  # noqa: E402
from .monitor import NonFiniteTripwireHook, PackingMetricsHook  # noqa: E402
from .startup import enable_xtuner_rope  # noqa: E402

HOOKS.register_module(module=ValidatedRoPEHook, force=True)
HOOKS.register_module(module=PackedBatchCheckHook, force=True)
for _hook in (PackingMetricsHook, NonFiniteTripwireHook):
    HOOKS.register_module(module=_hook, force=True)
HOOKS.register_module(module=TokenWeightedLossHook, force=True)
FUNCTIONS.register_module(module=rope_collate_fn, force=True)
FUNCTIONS.register_module(module=llava_collate_fn, force=True)

__version__ = "0.1.0"
__all__ = [
    "NonFiniteTripwireHook",
    "PackedBatchCheckHook",
    "PackingMetricsHook",
    "TokenWeightedLossHook",
    "ValidatedRoPEHook",
    "ValidatedRotaryEmbedding",
    "apply_rotary_pos_emb",
    "enable_xtuner_rope",
    "patch_internlm2_attention",
    "rope_collate_fn",
    "llava_collate_fn",
]
