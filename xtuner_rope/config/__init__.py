"""The config's start-up: what ``enable_xtuner_rope`` inspects, fixes and refuses, and re-checks.

docs/architecture.md lists the modules. Importing the package registers its findings modules:
``inspect_config`` never runs without the start-up's own findings.
"""

from . import (
    checkpoint_findings,
    families,
    frameworks,
    heldout,
    internvl,
    launch,
    llava_tower,
    moss,
    multimodal,
    optimizer_state,
    packing,
    patch_needs,
    preference,
    rope_scaling,
    runtime,
    sequence_parallel,
)

__all__ = [
    "checkpoint_findings",
    "families",
    "frameworks",
    "heldout",
    "internvl",
    "launch",
    "llava_tower",
    "moss",
    "multimodal",
    "optimizer_state",
    "packing",
    "patch_needs",
    "preference",
    "rope_scaling",
    "runtime",
    "sequence_parallel",
]
