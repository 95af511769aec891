"""XTuner's after-training tools, run with the plugin loaded: convert, merge, chat.

xtuner 0.2.0's tools never load the plugin and ``xtuner`` exits 0 when they crash:
:func:`run_xtuner_tool` runs XTuner's own tool in this process after the compat patches and
returns its real exit status.
"""

from __future__ import annotations

import functools
import runpy
import shutil
import sys
from pathlib import Path

from . import xtuner_parsers

# The sub-commands, as `xtuner` names them, and the modules that implement them.
XTUNER_TOOLS = {
    ("convert", "pth_to_hf"): "xtuner.tools.model_converters.pth_to_hf",
    ("convert", "merge"): "xtuner.tools.model_converters.merge",
    ("chat",): "xtuner.tools.chat",
}
MODEL_PATH_KEY = "pretrained_model_name_or_path"
# The option xtuner-rope adds to `convert pth_to_hf` and `convert merge`.
DTYPE_CHOICES = ("bf16", "fp16", "fp32")
DTYPE_HELP = {
    "pth_to_hf": (
        "the dtype to save in (default: the dtype the run trained in, read from the "
        "checkpoint; --fp32 is --dtype fp32). DeepSpeed checkpoints are read at fp32; values "
        "the cast overflows to inf or flushes to zero are counted and named."
    ),
    "merge": "load the base, merge and save in this dtype (default: fp16, XTuner's).",
}


def dtype_help(tool: str) -> str:
    """What ``-h`` of ``convert TOOL`` prints after XTuner's own help: the ``--dtype`` option."""
    return f"\nxtuner-rope adds:\n  --dtype {{{','.join(DTYPE_CHOICES)}}}\n    {DTYPE_HELP[tool]}"


def _model_path_keys(node: object, prefix: str = "") -> list[str]:
    """Dotted keys of every ``pretrained_model_name_or_path`` in a config (lists by index)."""
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = ((str(i), value) for i, value in enumerate(node))
    else:
        return []
    keys = []
    for key, value in items:
        if key == MODEL_PATH_KEY:
            keys.append(f"{prefix}{key}")
        keys += _model_path_keys(value, f"{prefix}{key}.")
    return keys


def resolved_model_options(config: str, cfg_options: dict | None = None) -> list[str]:
    """``key=path`` ``--cfg-options`` that give a tool the model path ``xtuner train`` trained
    from (``model_resource``'s resolved path; the user's ``cfg_options`` applied first); empty
    when there is no ``model_resource`` or the path is unchanged."""
    cfg = _load_config(config, cfg_options)
    resource = cfg.get("model_resource")
    if not resource or MODEL_PATH_KEY not in cfg:
        return []
    path = cfg[MODEL_PATH_KEY]
    resolved = resource["fn"](path, **resource.get("args", {}))
    if resolved == path:
        return []
    return [f"{key}={resolved}" for key in _model_path_keys(cfg.to_dict())]


def _config_and_options(argv: list[str]) -> tuple[str, str, dict | None]:
    """The config, checkpoint and ``--cfg-options`` of a ``pth_to_hf`` command line."""
    import argparse

    from mmengine.config import DictAction

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("config")
    parser.add_argument("pth_model")
    parser.add_argument("--cfg-options", nargs="+", action=DictAction)
    known, _ = parser.parse_known_args(argv)
    return known.config, known.pth_model, known.cfg_options


def parser_answer(command: tuple[str, ...], argv: list[str]) -> int | None:
    """XTuner's tool ``command`` (a key of :data:`XTUNER_TOOLS`) answering ``-h`` (0) or a
    usage error (2) without being imported; None when the tool must run to answer."""
    script = xtuner_parsers.tool_script(XTUNER_TOOLS[command])
    return xtuner_parsers.parser_answer(script, argv, prog=_prog(command))


def _prog(command: tuple[str, ...]) -> str:
    """The tool's ``sys.argv[0]``: its name as ``xtuner`` spells it."""
    return f"xtuner {' '.join(command)}"


def run_xtuner_tool(command: tuple[str, ...], argv: list[str], dtype: str | None = None) -> int:
    """Run XTuner's tool ``command`` with ``argv`` after loading the plugin.

    Args:
        command: A key of :data:`XTUNER_TOOLS`, e.g. ``("convert", "pth_to_hf")``.
        dtype: ``--dtype`` of ``convert``; None: the trained dtype (``pth_to_hf``), fp16
            (``merge``).

    Returns:
        The tool's exit status (2 for ``--fp32`` with another ``--dtype``).

    Raises:
        KeyError: ``command`` is not one of :data:`XTUNER_TOOLS`.
    """
    from xtuner_rope import compat
    from xtuner_rope.compat import xtuner_merge

    from . import convert_dtype  # torch: not before the usage errors have answered

    compat.apply()  # idempotent: the patches are in place before XTuner's tool imports

    module = XTUNER_TOOLS[command]
    if command == ("convert", "pth_to_hf") and "-h" not in argv and "--help" not in argv:
        return _convert_pth_to_hf(argv, dtype)
    if command == ("convert", "merge") and dtype:
        print(f"xtuner-rope convert merge: base loaded, merged and saved in {dtype} (asked).")
        with xtuner_merge.merge_loading_in(convert_dtype.DTYPES[dtype]):
            return _run_module(module, command, argv)
    return _run_module(module, command, argv)


def _convert_pth_to_hf(argv: list[str], dtype: str | None) -> int:
    """``convert pth_to_hf``: the resolved model path, the dtype said, the cast counted."""
    from xtuner_rope.compat import guard, xtuner_to_hf, xtuner_zero_read

    from . import convert_dtype, internvl_convert

    command = ("convert", "pth_to_hf")
    config, pth, options = _config_and_options(argv)
    overrides = resolved_model_options(config, options) if Path(config).is_file() else []
    if overrides:
        argv = [*argv, "--cfg-options", *overrides]
    if not Path(pth).exists():  # XTuner's tool says so itself ("Cannot find ...")
        return _run_module(XTUNER_TOOLS[command], command, argv)
    model_cfg = (_load_config(config, options).get("model") or {}) if Path(config).is_file() else {}
    internvl = internvl_convert.is_internvl(model_cfg)
    refusal = None if internvl or not model_cfg else _no_llm_refusal(config, model_cfg)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if Path(pth).is_dir() and "patch_xtuner_zero_read_fp32" in guard.skipped():
        print(
            f"xtuner-rope convert: refused: {pth} is a DeepSpeed checkpoint and "
            f"{xtuner_zero_read.ZERO_READ_FEATURE} is off here "
            f"({guard.skipped()['patch_xtuner_zero_read_fp32']}): XTuner would read its "
            "weights as fp16. Install xtuner 0.2.x (the version the patch was written for).",
            file=sys.stderr,
        )
        return 2
    try:
        saved_as, why = convert_dtype.save_dtype(dtype, "--fp32" in argv, pth)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    print(f"xtuner-rope convert: saving in {convert_dtype.NAMES[saved_as]} ({why}).")
    if internvl:
        return _convert_internvl(argv, model_cfg, saved_as)
    with xtuner_to_hf.to_hf_in_dtype(functools.partial(_cast_and_report, dtype=saved_as)):
        return _run_module(XTUNER_TOOLS[command], command, argv)


def _load_config(config: str, cfg_options: dict | None):
    """The config with the user's ``--cfg-options`` merged, as the tool reads it."""
    from mmengine.config import Config

    cfg = Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return cfg


def _no_llm_refusal(config: str, model_cfg: dict) -> str | None:
    """Why ``pth_to_hf`` cannot convert a model without ``model.llm``, or None."""
    from .internvl_convert import INTERNVL_MODEL

    if "llm" in model_cfg:
        return None
    kind = model_cfg.get("type", "?")
    kind = getattr(kind, "__name__", kind)
    return (
        f"xtuner-rope convert pth_to_hf: refused: the model of {config} ({kind}) has no "
        "model.llm; xtuner 0.2.0's pth_to_hf converts models with one (fine-tune, LLaVA, reward, "
        f"preference), and xtuner-rope converts {INTERNVL_MODEL} itself; this "
        "model would stop XTuner's tool on an AttributeError. Save it with the model's own "
        "save_pretrained after loading the checkpoint."
    )


def _convert_internvl(argv: list[str], model_cfg: dict, dtype: object) -> int:
    """``convert pth_to_hf`` of an InternVL config in the official layout; its exit status."""
    import argparse

    from . import internvl_convert

    parser = argparse.ArgumentParser(add_help=False)
    for name in ("config", "pth_model", "save_dir"):
        parser.add_argument(name)
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--save-format", default="xtuner")
    args, _ = parser.parse_known_args(argv)
    if args.save_format == "huggingface":
        print(
            "xtuner-rope convert pth_to_hf: refused: --save-format huggingface is LLaVA's "
            f"(transformers' LlavaForConditionalGeneration); an {internvl_convert.INTERNVL_MODEL} "
            "checkpoint is saved in the official InternVL layout: drop --save-format.",
            file=sys.stderr,
        )
        return 2
    try:
        internvl_convert.convert_internvl(
            model_cfg, args.pth_model, args.save_dir, dtype, args.max_shard_size
        )
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    shutil.copyfile(args.config, Path(args.save_dir) / "xtuner_config.py")  # as pth_to_hf does
    return 0


def _cast_and_report(model: object, dtype: object) -> None:
    """``to_hf``'s first step under ``--dtype``: the model cast, what it lost printed."""
    from . import convert_dtype

    print(convert_dtype.describe_cast(convert_dtype.cast_module(model, dtype), dtype))


def _run_module(module: str, command: tuple[str, ...], argv: list[str]) -> int:
    """Run XTuner's tool module as ``__main__`` with ``argv``; its exit status."""
    saved = sys.argv
    sys.argv = [_prog(command), *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:  # argparse errors, the tools' own exit() calls
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)  # sys.exit("message"): Python prints it, status 1
        return 1
    finally:
        sys.argv = saved
    return 0


__all__ = [
    "XTUNER_TOOLS",
    "DTYPE_CHOICES",
    "DTYPE_HELP",
    "dtype_help",
    "parser_answer",
    "resolved_model_options",
    "run_xtuner_tool",
]
