"""Build the embedded tiny InternLM2 checkpoint (tokenizer + seeded weights), offline.

    python tools/make_tiny_internlm2.py --out models/tiny-internlm2

Same as ``python tools/make_tiny.py --family internlm2`` (which builds every family).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ holds make_tiny.py

from make_tiny import main  # noqa: E402

if __name__ == "__main__":
    main("internlm2")
