"""xtuner-rope: correct, crash-free RoPE and packed short-dialogue SFT for XTuner 0.x.

Importing the package applies the third-party patches of ``xtuner_rope.compat`` (each only
where its gap exists) and registers the hooks in MMEngine's ``HOOKS`` and the collate
functions in MMEngine's ``FUNCTIONS``, so configs can name them by string as well as by object.
"""

from . import compat

compat.apply()

__version__ = "0.1.0"
