"""What the code under test logs to MMEngine's current logger, as records."""

import contextlib
import logging
from collections.abc import Iterator

from mmengine.logging import MMLogger


@contextlib.contextmanager
def mmengine_records() -> Iterator[list[logging.LogRecord]]:
    """Collect the records logged to MMEngine's current logger inside the block."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = MMLogger.get_current_instance()
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
