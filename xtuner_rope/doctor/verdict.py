"""The doctor's verdict when the data cannot be built: the start-up's refusal comes first."""

from __future__ import annotations

import contextlib

from xtuner_rope.config.findings import ConfigConflict, conflict_message


@contextlib.contextmanager
def refusal_when_data_fails(config: str, cfg_options: dict | None = None):
    """Turn a failed data build into the start-up's refusal of ``config``, where it has one.

    Raises:
        ConfigConflict: the build failed and the start-up refuses the config; the message is
            the start-up's, followed by the build's error.
        Exception: the build's own error, when the start-up would not refuse.
    """
    try:
        yield
    except ConfigConflict:  # the start-up's refusal itself, already the verdict
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised unless the start-up refuses
        from xtuner_rope.doctor.diagnose import start_like_xtuner_train

        try:
            _, findings, _ = start_like_xtuner_train(config, cfg_options)
        except Exception:  # noqa: BLE001 - the original error is the one to show
            raise exc from None
        conflicts = [f for f in findings if f.fix is None]
        if not conflicts:
            raise
        raise ConfigConflict(
            f"{conflict_message(conflicts)}\n(the doctor could not build the data "
            f"either: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''})"
        ) from exc


def launch_problems(sp: object, deepspeed: str | None) -> list[str]:
    """What ``xtuner train CONFIG [--deepspeed X]`` refuses from its command line alone
    (``check_cfg``: ``sequence_parallel_size > 1`` without ``--deepspeed``)."""
    if deepspeed or not isinstance(sp, int) or sp <= 1:
        return []
    return [
        f"sequence_parallel_size: sequence_parallel_size = {sp} without DeepSpeed: XTuner "
        "trains sequence parallel only under DeepSpeed (xtuner train refuses it before "
        "loading)\n  -> pass the run's --deepspeed to the doctor as to xtuner train (on CPU: "
        "configs/deepspeed/zero2_fp32_cpu.json), or set sequence_parallel_size = 1"
    ]
