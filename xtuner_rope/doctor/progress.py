"""What the doctor is doing, on stderr (stage lines, bars over the tokens); ``--quiet`` silences
it."""

from __future__ import annotations

import contextlib
import sys
import time

from tqdm import tqdm

from xtuner_rope.doctor.token_columns import TOKENS_PER_BLOCK


class Progress:
    """Stage lines and per-pass bars on stderr; nothing when not ``enabled`` (``--quiet``)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.started = time.monotonic()

    def stage(self, text: str) -> None:
        """One line: the step and its counts, with the seconds since the doctor started."""
        if self.enabled:
            seconds = time.monotonic() - self.started
            print(f"doctor: {text} ({seconds:.0f} s)", file=sys.stderr, flush=True)

    def bar(self, total: int, desc: str, unit: str = "tokens") -> tqdm:
        """A bar over ``total`` units, shown when enabled and ``total`` spans several blocks."""
        return tqdm(
            total=total,
            desc=f"doctor: {desc}",
            unit=f" {unit}",
            unit_scale=True,
            file=sys.stderr,
            disable=not self.enabled or total <= TOKENS_PER_BLOCK,
        )


QUIET = Progress(enabled=False)


@contextlib.contextmanager
def datasets_bars(shown: bool):
    """The datasets library's progress bars left as they are, or hidden in this block if not
    ``shown``."""
    import datasets

    if shown or not datasets.is_progress_bar_enabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()
