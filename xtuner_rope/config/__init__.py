"""The config's start-up: what ``enable_xtuner_rope`` inspects, fixes and refuses, and re-checks.

``startup`` (the findings engine), ``fields`` (a config read without building it), one findings
module per topic (docs/architecture.md lists them; ``heldout`` is a package), and ``overrides``
(the re-check of ``--cfg-options``). Importing the package registers its findings modules:
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
