"""Every patch xtuner-rope applies to a third-party package, in one place.

Each patch names the versions it was written against and the symptom it removes, and is
applied only where the gap exists: on a CUDA machine with a complete stack, ``apply()`` leaves
everything as it was. ``apply()`` is idempotent and runs when ``xtuner_rope`` is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import sys
import threading
import types
import warnings

import torch

_APPLIED: list[str] = []

# Model patches that lived here once and now live with their family in ``models``.
MOVED_NAMES = {"patch_hf_fp32_rotation": "xtuner_rope.models.hf_rope"}


def __getattr__(name: str) -> object:
    """``compat.<moved name>``: the name from its new module, with a warning naming it."""
    if name not in MOVED_NAMES:
        raise AttributeError(f"module 'xtuner_rope.compat' has no attribute {name!r}")
    new = MOVED_NAMES[name]
    warnings.warn(
        f"xtuner_rope.compat.{name} is deprecated: it is a model patch, import it from "
        f"{new} (`from {new} import {name}`).",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(new), name)


def _cpu_is_bf16_supported(including_emulation: bool = True) -> bool:
    """Stand-in for ``torch.cuda.is_bf16_supported`` on the ``torch.cpu`` namespace.

    Answers False so that XTuner's "auto" dtype logic keeps full fp32 on a CPU machine: CPU
    bf16 matmuls are emulated on most x86 parts (slower than fp32), and fp32 is what the
    tiny CPU recipes are tested with.
    """
    del including_emulation
    return False


def patch_torch_cpu_bf16_query() -> bool:
    """Give ``torch.cpu`` the ``is_bf16_supported`` that XTuner assumes every device has.

    xtuner 0.2.0 (``xtuner.utils.device.get_torch_device``) returns the ``torch.cpu`` module on
    a machine without CUDA/NPU, then calls ``.is_bf16_supported()`` on it in
    ``SupervisedFinetune._prepare_for_flash_attn`` and ``auto_dtype_of_deepspeed_config``.
    torch (checked 2.4 - 2.15) has no ``torch.cpu.is_bf16_supported``: every ``xtuner train``
    on CPU dies with ``AttributeError: module 'torch.cpu' has no attribute
    'is_bf16_supported'``.

    Returns:
        True if the patch was applied, False if torch already has the function.
    """
    if hasattr(torch.cpu, "is_bf16_supported"):
        return False
    torch.cpu.is_bf16_supported = _cpu_is_bf16_supported
    return True


def register_internlm2_auto_classes() -> bool:
    """Register XTuner's shipped InternLM2 classes with the ``transformers`` Auto factories.

    transformers 4.48 has no ``internlm2`` model type: real checkpoints carry remote code, and a
    locally built checkpoint without it cannot be loaded offline
    (``ValueError: The checkpoint you are trying to load has model type `internlm2` but
    Transformers does not recognize this architecture``). XTuner 0.2.0 ships the current
    InternLM2 code at ``xtuner._lite.modelings.internlm2``; registering it makes
    ``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained(dir)`` work without remote code.

    Returns:
        True if the classes were registered now, False if ``internlm2`` was already known.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "internlm2" in CONFIG_MAPPING:
        return False
    from xtuner._lite.modelings.internlm2.configuration_internlm2 import InternLM2Config
    from xtuner._lite.modelings.internlm2.modeling_internlm2 import (
        InternLM2ForCausalLM,
        InternLM2Model,
    )

    AutoConfig.register("internlm2", InternLM2Config)
    AutoModel.register(InternLM2Config, InternLM2Model)
    AutoModelForCausalLM.register(InternLM2Config, InternLM2ForCausalLM)
    return True


def _triton_lacks_ops() -> bool:
    """True if triton is installed without the ``triton.ops`` package (removed in triton 3.2)."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return False
    return not any(
        os.path.isdir(os.path.join(loc, "ops")) for loc in spec.submodule_search_locations
    )


def _forget_failed_bitsandbytes_import() -> bool:
    """Drop the modules a failed ``import bitsandbytes`` left behind; True if there were any.

    Python removes the package that raised from ``sys.modules`` but keeps the submodules that
    finished loading (``bitsandbytes.triton.triton_utils`` among them). A later import would
    reuse those and fail again, whatever the probe answers.
    """
    leftovers = [m for m in sys.modules if m.startswith("bitsandbytes.")]
    if "bitsandbytes" in sys.modules or not leftovers:
        return False
    for name in leftovers:
        del sys.modules[name]
    return True


def patch_bitsandbytes_triton_probe() -> bool:
    """Let bitsandbytes 0.45 import next to a triton without ``triton.ops``.

    xtuner 0.2.0 pins ``bitsandbytes==0.45.0``, whose optional int8 "SwitchBack" triton
    kernels import ``triton.ops.matmul_perf_model`` whenever triton is installed. triton 3.2+
    (shipped with torch >= 2.6, e.g. triton 3.9 with torch 2.15) removed ``triton.ops``, so
    ``import bitsandbytes`` fails with ``ModuleNotFoundError: No module named 'triton.ops'`` and
    takes every LoRA/QLoRA ``get_peft_model`` with it (peft imports bitsandbytes for its bnb
    layers). bitsandbytes already has a path for "no triton": we answer its own probe
    (``bitsandbytes.triton.triton_utils.is_triton_available``) with False, which disables only
    those optional triton kernels; 4-bit QLoRA does not use them.

    Whatever was imported first: ``xtuner train`` imports peft before any config code runs,
    and peft's availability check half-imports bitsandbytes (the package fails, its finished
    submodules stay in ``sys.modules``). Those leftovers are dropped so that the next import,
    from ``get_peft_model``, starts clean and meets the probe.

    Returns:
        True if applied (triton lacks ``triton.ops`` and bitsandbytes is not fully imported).
    """
    name = "bitsandbytes.triton.triton_utils"
    if "bitsandbytes" in sys.modules or not _triton_lacks_ops():
        return False
    _forget_failed_bitsandbytes_import()
    probe = types.ModuleType(name, "xtuner_rope.compat: triton without triton.ops counts as absent")
    probe.is_triton_available = lambda: False
    sys.modules[name] = probe
    return True


def cpu_only() -> bool:
    """True where no accelerator MMEngine can drive (CUDA, NPU, MLU, MUSA) is present."""
    if torch.cuda.is_available():
        return False
    from mmengine.device import is_mlu_available, is_musa_available, is_npu_available

    return not (is_npu_available() or is_mlu_available() or is_musa_available())


def _init_dist_pytorch_cpu(backend: str, init_backend: str = "torch", **kwargs) -> None:
    """mmengine 0.10.6's ``_init_dist_pytorch`` for a CPU-only machine.

    Same steps minus ``torch.cuda.set_device(local_rank)``, and NCCL (which needs GPUs)
    replaced by gloo, the backend torch ships for CPU tensors.
    """
    if backend == "nccl":
        backend = "gloo"
    if init_backend == "torch":
        torch.distributed.init_process_group(backend=backend, **kwargs)
    elif init_backend == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, **kwargs)
    else:
        raise ValueError(
            f"xtuner_rope.compat: init_backend {init_backend!r} is not supported on "
            "a CPU-only machine; use 'torch' (DDP) or 'deepspeed'."
        )


def patch_mmengine_dist_init_on_cpu() -> bool:
    """Let ``--launcher pytorch`` start a process group on a CPU-only machine.

    mmengine 0.10.6 ``mmengine.dist.utils._init_dist_pytorch`` (used by ``Runner`` and by the
    DeepSpeed strategy) always calls ``torch.cuda.set_device(local_rank)``, which dies with
    ``RuntimeError: Found no NVIDIA driver on your system`` on a CPU-only machine (torch 2.15
    CUDA build), and XTuner configs ask for ``dist_cfg=dict(backend='nccl')``, which needs GPUs.
    ``init_dist`` looks the function up at call time, so replacing it is enough.

    Returns:
        True if applied (no CUDA/NPU/MLU/MUSA device here).
    """
    if not cpu_only():
        return False
    import mmengine.dist.utils as dist_utils

    dist_utils._init_dist_pytorch = _init_dist_pytorch_cpu
    return True


def patch_mmengine_ddp_device_ids_on_cpu() -> bool:
    """Wrap CPU models in DDP without ``device_ids`` on a CPU-only machine.

    mmengine 0.10.6 ``Runner.wrap_model`` (and ``DDPStrategy``) always passes
    ``device_ids=[LOCAL_RANK]`` to ``MMDistributedDataParallel``; torch's DDP refuses that for a
    CPU module (``ValueError: DistributedDataParallel device_ids and output_device arguments
    only work with single-device/multiple-device GPU modules or CPU modules``). On a machine
    without accelerators every module is on the CPU, where ``device_ids`` must be None.

    Returns:
        True if applied (no CUDA/NPU/MLU/MUSA device here).
    """
    if not cpu_only():
        return False
    from mmengine.model import MMDistributedDataParallel

    original_init = MMDistributedDataParallel.__init__

    @functools.wraps(original_init)
    def init_without_device_ids(self, module, detect_anomalous_params=False, **kwargs):
        kwargs["device_ids"] = None
        kwargs["output_device"] = None
        original_init(self, module, detect_anomalous_params, **kwargs)

    MMDistributedDataParallel.__init__ = init_without_device_ids
    return True


def _deepspeed_flat_buffer_requires_grad() -> bool:
    """True if the installed DeepSpeed predates 0.19.0 (which detached ZeRO-1/2's flat buffer)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        return Version(version("deepspeed")) < Version("0.19.0")
    except PackageNotFoundError:
        return False


def patch_deepspeed_cpu_allgather_grad_mode() -> bool:
    """Let DeepSpeed < 0.19 ZeRO-1/2 take its optimizer step over gloo on a CPU-only machine.

    deepspeed 0.17.6 - 0.18.9 build ZeRO-1/2's flat parameter buffer with ``torch.cat`` of the
    parameters and keep it attached to autograd (0.19.0 added ``.detach()``). After the step,
    ``runtime.utils.all_gather_into_tensor_dp_groups`` gathers the updated partitions into it;
    torch 2.15's gloo ``all_gather_into_tensor`` writes through ``split`` views of its output,
    so the first ``optimizer.step()`` dies with ``RuntimeError: Output 0 of Split is a view and
    is being modified inplace``. NCCL writes the buffer directly (GPUs are unaffected). The
    gather is a weight update, never differentiated: run it under ``torch.no_grad()``.

    Returns:
        True if applied (no CUDA/NPU/MLU/MUSA device here and deepspeed < 0.19.0 installed).
    """
    if not cpu_only() or not _deepspeed_flat_buffer_requires_grad():
        return False
    import deepspeed.runtime.utils as ds_utils

    gather = getattr(ds_utils, "all_gather_into_tensor_dp_groups", None)
    if gather is None:  # an older DeepSpeed gathers another way
        return False

    @functools.wraps(gather)
    def gather_without_grad(*args, **kwargs):
        with torch.no_grad():
            return gather(*args, **kwargs)

    ds_utils.all_gather_into_tensor_dp_groups = gather_without_grad
    return True


class _GatherHandleRecorder:
    """``deepspeed.comm`` as ``partition_parameters`` sees it, recording async gather handles.

    Every attribute is DeepSpeed's own; ``all_gather_into_tensor`` and ``all_gather`` also put
    the handle they return into this thread's open recording, if one is open (see
    ``every_gather_waited``). Outside a recording they behave exactly as before.
    """

    def __init__(self, comm: types.ModuleType):
        self._comm = comm
        self._local = threading.local()

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def _record(self, handle):
        pending = getattr(self._local, "pending", None)
        if pending is not None and handle is not None:
            pending.append(handle)
        return handle

    def all_gather_into_tensor(self, *args, **kwargs):
        return self._record(self._comm.all_gather_into_tensor(*args, **kwargs))

    def all_gather(self, *args, **kwargs):
        return self._record(self._comm.all_gather(*args, **kwargs))

    @contextlib.contextmanager
    def every_gather_waited(self):
        """Record the gathers started inside the block; on leaving it, wait for each."""
        outer = getattr(self._local, "pending", None)
        self._local.pending = []
        try:
            yield
            for handle in self._local.pending:
                handle.wait()
        finally:
            self._local.pending = outer


def _waits_only_for_last_gather(method) -> bool:
    """True if DeepSpeed's coalesced gather still waits on its last handle only (no PR #8539)."""
    try:
        return "launch_handles[-1].wait()" in inspect.getsource(method)
    except (OSError, TypeError):  # no source shipped: waiting twice is harmless, so patch
        return True


def patch_deepspeed_zero3_cpu_gather() -> bool:
    """Make ZeRO-3's coalesced parameter gather wait for every all-gather on the CPU accelerator.

    deepspeed 0.19.6 (the pinned version) ``Init._allgather_params_coalesced``
    (``runtime/zero/partition_parameters.py``) starts one async ``all_gather_into_tensor`` per
    parameter, waits on the last handle only, points ``param.data`` at the gather buffers and
    skips the closing ``synchronize`` because the CPU accelerator ``resolves_data_dependency()``.
    On CUDA the gathers run in order on one stream; gloo runs them on background threads, out of
    order, so a rank reads parameters that are not yet written (symptom: 2-process ZeRO-3 on CPU
    gives one rank a wrong loss at a random iteration, then both drift; parameters still
    changing after ``engine.step()`` returned, ``tools/repro/zero3_gather.py``). DeepSpeed PR
    #8539 waits for every handle, in releases mmengine 0.10.6 can no longer import. We do the
    same from outside: the module's ``dist`` records the handles the method starts, and the
    method returns only once each of them is waited.

    Returns:
        True if applied (DeepSpeed picked its CPU accelerator and lacks the upstream fix).
    """
    if not cpu_only():
        return False
    import deepspeed.runtime.zero.partition_parameters as zero3
    from deepspeed.accelerator import get_accelerator

    coalesced = zero3.Init._allgather_params_coalesced
    if (
        get_accelerator().device_name() != "cpu"
        or isinstance(zero3.dist, _GatherHandleRecorder)
        or not _waits_only_for_last_gather(coalesced)
    ):
        return False
    recorder = _GatherHandleRecorder(zero3.dist)

    @functools.wraps(coalesced)
    def gather_waiting_for_all(self, *args, **kwargs):
        with recorder.every_gather_waited():
            return coalesced(self, *args, **kwargs)

    zero3.dist = recorder
    zero3.Init._allgather_params_coalesced = gather_waiting_for_all
    return True


def _load_from_local_checked(filename: str, map_location=None):
    """MMEngine's loader for local checkpoint paths, through ``checkpoint.load_checkpoint``."""
    from .checkpoint import load_checkpoint

    filename = os.path.expanduser(filename)
    if not os.path.isfile(filename):
        raise FileNotFoundError(f"{filename} can not be found.")
    return load_checkpoint(filename, map_location)


def _seed_from_checkpoint(path: str) -> int:
    """The seed stored in an MMEngine checkpoint file or a DeepSpeed checkpoint directory."""
    from .checkpoint import load_checkpoint

    if os.path.isdir(path):
        from deepspeed.utils.zero_to_fp32 import get_model_state_files

        path = get_model_state_files(path)[0]
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"Cannot find {path}")
    return load_checkpoint(path)["meta"]["seed"]


def patch_checkpoint_loading() -> bool:
    """Let ``xtuner train --resume`` and ``load_from`` load on torch >= 2.6, still weights-only.

    torch 2.6 made ``weights_only=True`` the default of ``torch.load``. mmengine 0.10.6
    (``runner.checkpoint.load_from_local``) and xtuner 0.2.0
    (``tools.utils.get_seed_from_checkpoint``, called first by ``xtuner train --resume``) load
    the runner's own checkpoints without an allow-list; those hold the message hub
    (``HistoryBuffer``, numpy scalars), so resuming dies with ``UnpicklingError: Weights only
    load failed ... Unsupported global: GLOBAL mmengine.logging.history_buffer.HistoryBuffer``
    (mmengine issue #1655). Both loaders go through ``checkpoint.load_checkpoint``:
    ``weights_only=True`` with exactly those types allowed; any other type is refused with its
    name and the way to load a file you trust (``XTUNER_ROPE_TRUSTED_CHECKPOINTS``).

    Returns:
        True if applied (torch >= 2.6).
    """
    from packaging.version import Version

    if Version(torch.__version__.split("+")[0]) < Version("2.6"):
        return False
    import xtuner.tools.utils as xtuner_tool_utils
    from mmengine.runner.checkpoint import CheckpointLoader

    CheckpointLoader.register_scheme(prefixes="", force=True)(_load_from_local_checked)
    # `xtuner/tools/train.py` (run as __main__) imported the function by name: rebind it there.
    original = xtuner_tool_utils.get_seed_from_checkpoint
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is not None and namespace.get("get_seed_from_checkpoint") is original:
            module.get_seed_from_checkpoint = _seed_from_checkpoint
    return True


def _refuse_unconsumed_boundaries(forward):
    """Wrap ``SupervisedFinetune.forward``: boundaries left in ``data`` name the missing hook."""

    @functools.wraps(forward)
    def checked_forward(self, data, data_samples=None, mode="loss"):
        if isinstance(data, dict) and "cumulative_len" in data:
            raise ValueError(
                "xtuner-rope: the batch reached the model with 'cumulative_len' still in it "
                "(the HF forward does not take it): the hook that consumes it is missing. "
                "Add to PART 1 of the config:\n    from xtuner_rope import enable_xtuner_rope\n"
                "    model_resource = dict(fn=enable_xtuner_rope)\n(it adds the plugin's hooks), "
                "or, without xtuner-rope, collate with use_varlen_attn=False."
            )
        return forward(self, data, data_samples, mode)

    checked_forward.xtuner_rope_checked = True
    return checked_forward


def patch_sft_forward_names_missing_hook() -> bool:
    """Turn "unexpected keyword argument 'cumulative_len'" into an error naming the fix.

    xtuner 0.2.0 ``SupervisedFinetune._forward`` passes the whole batch to the HF model. A
    collate function that returns document boundaries (``rope_collate_fn``, or XTuner's own
    ``default_collate_fn(use_varlen_attn=True)``) relies on a hook to take them out first;
    without it every step dies with ``TypeError: InternLM2ForCausalLM.forward() got an
    unexpected keyword argument 'cumulative_len'``, which names neither the hook nor the fix.

    Returns:
        True if applied (xtuner's SupervisedFinetune is importable).
    """
    try:
        from xtuner.model.sft import SupervisedFinetune
    except ImportError:
        return False
    if getattr(SupervisedFinetune.forward, "xtuner_rope_checked", False):
        return False
    SupervisedFinetune.forward = _refuse_unconsumed_boundaries(SupervisedFinetune.forward)
    return True


def patch_sft_sequence_parallel_loss() -> bool:
    """Give plugin-patched models the sequence-parallel loss of ``models.sequence_parallel``.

    xtuner 0.2.0 ``SupervisedFinetune._compute_sequence_parallel_loss`` splits ``labels`` with
    the row and lets the model shift them inside each shard: the first label of every shard
    after the first (predicted by the previous shard's last token) is dropped, silently, one
    supervised token per shard boundary. It also back-propagates each rank's unweighted mean
    (wrong gradients when shards hold unequal token counts), and its attention would see only
    the shards' boundaries. For a model whose attention xtuner-rope patched, the loss goes
    through ``sequence_parallel_loss`` instead (full-row boundaries published, labels shifted
    over the full row, token-weighted); other models keep XTuner's method unchanged.

    Returns:
        True if applied (xtuner's SupervisedFinetune has the method).
    """
    try:
        from xtuner.model.sft import SupervisedFinetune
    except ImportError:
        return False
    original = getattr(SupervisedFinetune, "_compute_sequence_parallel_loss", None)
    if original is None or getattr(original, "xtuner_rope_sp", False):
        return False

    @functools.wraps(original)
    def _compute_sequence_parallel_loss(self, data):
        from xtuner_rope.models.dispatch import isolates_documents
        from xtuner_rope.models.sequence_parallel import sequence_parallel_loss

        if not isolates_documents(self.llm):
            return original(self, data)
        return sequence_parallel_loss(self.llm, data)

    _compute_sequence_parallel_loss.xtuner_rope_sp = True
    SupervisedFinetune._compute_sequence_parallel_loss = _compute_sequence_parallel_loss
    return True


def _xtuner_train_modules() -> list:
    """The loaded copies of ``xtuner/tools/train.py`` (``xtuner train`` runs it as __main__)."""
    found = []
    for name in ("__main__", "xtuner.tools.train"):
        module = sys.modules.get(name)
        path = str(getattr(module, "__file__", "") or "").replace(os.sep, "/")
        if path.endswith("xtuner/tools/train.py") and hasattr(module, "check_cfg"):
            found.append(module)
    return found


def patch_xtuner_train_sequence_parallel_check() -> bool:
    """Lift ``xtuner train``'s flash-attn requirement for sequence parallel where xtuner-rope serves.

    xtuner 0.2.0 ``tools/train.py`` ``check_cfg`` asserts ``flash_attn`` is installed and
    ``attn_implementation`` is unset or ``"flash_attention_2"`` whenever
    ``sequence_parallel_size > 1`` (symptom: "`flash_attn` is required if you want to use
    sequence parallel." on every machine without flash-attn, CPU included). With the config
    prepared by ``enable_xtuner_rope`` the plugin's packed attention runs the sequence-parallel
    attention on every backend (``models.sequence_parallel``): the check runs with that
    requirement lifted (logged) and XTuner's DeepSpeed requirement for sequence parallel kept.
    The wrapper applies once the plugin is imported by the config's ``model_resource``, which
    ``xtuner train`` calls before ``check_cfg``.

    Returns:
        True if applied (``xtuner/tools/train.py`` is running in this process).
    """
    modules = [
        m for m in _xtuner_train_modules() if not getattr(m.check_cfg, "xtuner_rope_sp", False)
    ]
    for module in modules:
        original = module.check_cfg

        @functools.wraps(original)
        def check_cfg(cfg, args, _original=original):
            from mmengine.logging import print_log

            # compat sits below the start-up (config/): read it only if it was imported; if
            # not, nothing was prepared.
            startup = sys.modules.get("xtuner_rope.config.startup")
            sp = cfg.get("sequence_parallel_size", 1)
            prepared = startup is not None and startup.is_prepared()
            if not (prepared and isinstance(sp, int) and sp > 1):
                return _original(cfg, args)
            if args.deepspeed is None:  # a refusal before loading, listed as the start-up's
                raise startup.ConfigConflict(
                    startup.conflict_message(
                        [
                            startup.Finding(
                                "sequence_parallel_size",
                                f"sequence_parallel_size = {sp} without "
                                "DeepSpeed: XTuner trains sequence parallel only under DeepSpeed",
                                "Add `--deepspeed <json>` to `xtuner train` (on CPU: "
                                "configs/deepspeed/zero2_fp32_cpu.json), or set sequence_parallel_size = 1",
                            )
                        ]
                    )
                )
            print_log(
                f"xtuner-rope: sequence_parallel_size = {sp} is served by xtuner-rope's "
                "packed attention on every backend; XTuner's flash-attn requirement for "
                "sequence parallel is lifted.",
                logger="current",
            )
            cfg.sequence_parallel_size = 1
            try:
                return _original(cfg, args)
            finally:
                cfg.sequence_parallel_size = sp

        check_cfg.xtuner_rope_sp = True
        module.check_cfg = check_cfg
    return bool(modules)


@contextlib.contextmanager
def xtuner_pack_step(pack_fn):
    """Run XTuner's ``process_hf_dataset`` with ``pack_fn`` as its pack step, for one call.

    xtuner 0.2.0 ``xtuner.dataset.huggingface.process`` packs through the module's
    ``pack_dataset``, which maps the ``Packer`` over ``map_num_proc`` (default 32) shards:
    each worker drops its own leftover below ``max_length`` (38% of the tokens and labels of
    2,400 short alpaca dialogues lost, silently). Used only by
    ``xtuner_rope.data.packed_dataset.lossless_process_hf_dataset`` (the config names it, the
    start-up logs it); XTuner's function is restored on exit.

    Args:
        pack_fn: Same arguments as XTuner's ``pack_dataset``.
    """
    import xtuner.dataset.huggingface as hf

    original = hf.pack_dataset
    hf.pack_dataset = pack_fn
    try:
        yield
    finally:
        hf.pack_dataset = original


def _model_resource_config():
    """The config of a running xtuner 0.2.0 ``set_model_resource`` up the stack, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "set_model_resource" and frame.f_code.co_filename.endswith(
            os.path.join("xtuner", "tools", "utils.py")
        ):
            cfg = frame.f_locals.get("cfg")
            return cfg if hasattr(cfg, "_cfg_dict") else None
        frame = frame.f_back
    return None


def patch_model_resource_llm_path() -> bool:
    """Give a LLaVA config the ``pretrained_model_name_or_path`` XTuner's start-up reads.

    xtuner 0.2.0 ``set_model_resource`` calls ``fn(cfg["pretrained_model_name_or_path"])``;
    XTuner's LLaVA/InternVL configs name the LLM ``llm_name_or_path`` and have no such key:
    ``xtuner train`` stops with ``KeyError: 'pretrained_model_name_or_path'``. The config's
    ``from xtuner_rope import enable_xtuner_rope`` is imported (lazily) by that very call, just
    before the key is read, so here the config being started gets the key, set to its
    ``llm_name_or_path`` (logged). Applies only inside that call (``xtuner train``).
    """
    return _give_llm_path(_model_resource_config())


def _llm_path_setting(cfg) -> str | None:
    """The top-level setting that names the LLM of a config without ``pretrained_model_name_or_path``.

    LLaVA configs name it ``llm_name_or_path``; XTuner's InternVL configs name the whole model
    ``path`` (its ``model.model_path``): the start-up then refuses InternVL with its reason
    instead of XTuner's ``KeyError``.
    """
    if isinstance(dict.get(cfg._cfg_dict, "llm_name_or_path"), str):
        return "llm_name_or_path"
    model = dict.get(cfg._cfg_dict, "model")
    path = dict.get(cfg._cfg_dict, "path")
    if isinstance(path, str) and isinstance(model, dict) and model.get("model_path") == path:
        return "path"
    return None


def _give_llm_path(cfg) -> bool:
    """``cfg.pretrained_model_name_or_path = cfg.llm_name_or_path`` (or InternVL's ``path``)."""
    if cfg is None or "pretrained_model_name_or_path" in cfg._cfg_dict:
        return False
    setting = _llm_path_setting(cfg)
    if setting is None:
        return False
    llm_path = dict.get(cfg._cfg_dict, setting)
    cfg._cfg_dict["pretrained_model_name_or_path"] = llm_path
    from mmengine.logging import print_log

    print_log(
        "xtuner-rope: pretrained_model_name_or_path: missing (a LLaVA/InternVL config names "
        f"its LLM {setting}); set to {setting} = {llm_path!r} for XTuner's "
        "set_model_resource.",
        logger="current",
    )
    return True


def patch_set_model_resource_llm_path() -> bool:
    """The same gap for later callers of xtuner 0.2.0 ``set_model_resource`` in this process.

    Where ``xtuner_rope`` is already imported when the config is started (``xtuner-rope
    doctor`` / ``check`` / ``replay`` call ``xtuner.tools.utils.set_model_resource`` in
    process), :func:`patch_model_resource_llm_path` cannot act: the module's function gets the
    LLM path first instead (same ``KeyError`` otherwise).
    """
    import xtuner.tools.utils as xtuner_utils

    original = xtuner_utils.set_model_resource
    if getattr(original, "__wrapped__", None) is not None:
        return False

    @functools.wraps(original)
    def with_llm_path(cfg):
        if cfg.get("model_resource"):
            _give_llm_path(cfg)
        return original(cfg)

    xtuner_utils.set_model_resource = with_llm_path
    return True


def keep_other_model_paths(cfg, returned: str) -> bool:
    """Stop xtuner 0.2.0 ``set_model_resource`` overwriting the paths of other models.

    After ``model_resource.fn`` returns, XTuner writes its result into *every* nested
    ``pretrained_model_name_or_path`` of the config: in a LLaVA config the CLIP encoder's and
    the image processor's become the LLM's path (``OSError: ... does not appear to have a file
    named preprocessor_config.json``). Another model's path is one a top-level
    ``*_name_or_path`` setting other than the LLM's names (``visual_encoder_name_or_path``).
    Where such paths exist, XTuner's write-back is done here for every other nested path (with
    the config's own path, which xtuner-rope's ``model_resource`` functions return unchanged),
    and XTuner's walk is skipped, once, by handing it an empty ``items()`` of the config. Call
    from inside ``fn``; configs without another model's path are left to XTuner, and so is
    the write-back when ``fn`` returns another path than the config's (``returned``).

    Returns:
        True if the write-back was done here and XTuner's will be skipped.
    """
    top = cfg._cfg_dict
    path = dict.get(top, "pretrained_model_name_or_path")
    others = {
        v
        for k, v in dict.items(top)
        if isinstance(v, str)
        and v != path
        and k.endswith("_name_or_path")
        and k not in ("pretrained_model_name_or_path", "llm_name_or_path")
    }
    nested = list(_nested_paths(top))
    if (
        returned != path
        or not any(value in others for _, _, value in nested)
        or _model_resource_config() is not cfg
    ):
        return False
    for node, key, value in nested:
        if value not in others:
            node[key] = path
    base = type(top)

    class _SkipWriteBack(base):
        def items(self):
            object.__setattr__(self, "__class__", base)
            if sys._getframe(1).f_code.co_name in ("set_model_resource", "<listcomp>"):
                return []
            return base.items(self)

    object.__setattr__(top, "__class__", _SkipWriteBack)
    return True


def _nested_paths(node, depth: int = 0):
    """``(dict, key, value)`` of every ``pretrained_model_name_or_path`` below the top level."""
    items = (
        dict.items(node)
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, value in items:
        if depth and key == "pretrained_model_name_or_path":
            yield node, key, value
        if isinstance(value, (dict, list)):
            yield from _nested_paths(value, depth + 1)


def patch_llava_expansion_check(model, max_position: int | None) -> bool:
    """Check the sequence a LLaVA model's LLM really sees, after the image expansion.

    xtuner 0.2.0 ``LLaVAModel.forward`` replaces each image placeholder by the image's patch
    embeddings in ``prepare_inputs_labels_for_multimodal`` (a module global of
    ``xtuner.model.llava``) and rebuilds ``attention_mask`` and ``position_ids`` there: the
    per-batch checks before the forward never see that sequence (a row of image tokens past
    the RoPE range got no message). Wraps that function (once) so its output goes through
    ``xtuner_rope.models.llava.check_expanded_batch``; ``max_position`` is updated per call.

    Returns:
        True if ``model`` holds a ``LLaVAModel`` (the check is on), else False.
    """
    if not any(type(m).__name__ == "LLaVAModel" for m in model.modules()):
        return False
    import xtuner.model.llava as llava

    from xtuner_rope.models.llava import check_expanded_batch, restart_after_expansion

    current = llava.prepare_inputs_labels_for_multimodal
    original = getattr(current, "__wrapped__", current)

    @functools.wraps(original)
    def checked(llm, **kwargs):
        out = original(llm=llm, **kwargs)
        if kwargs.get("pixel_values") is not None:
            check_expanded_batch(out, checked.max_position)
            # Packed rows (llava_collate_fn): positions restart per sample, boundaries expanded.
            out = restart_after_expansion(
                out,
                kwargs["input_ids"],
                kwargs.get("attention_mask"),
                kwargs["pixel_values"].shape[1],
            )
        return out

    checked.max_position = max_position
    llava.prepare_inputs_labels_for_multimodal = checked
    if current is original:
        from mmengine.logging import print_log

        print_log(
            "xtuner-rope: LLaVAModel: the sequence its LLM sees after the image expansion "
            f"is checked every step (attended tokens, positions < {max_position}).",
            logger="current",
        )
    return True


class _RankWithoutGroup:
    """``torch.distributed`` as xtuner's DPO/ORPO modules see it: rank 0 without a group."""

    def __init__(self, dist: types.ModuleType):
        self._dist = dist

    def __getattr__(self, name: str):
        return getattr(self._dist, name)

    def get_rank(self, group=None) -> int:
        return self._dist.get_rank(group) if self._dist.is_initialized() else 0


def patch_xtuner_preference_rank() -> bool:
    """Let a single-process ``xtuner train`` run XTuner's packed DPO and ORPO.

    xtuner 0.2.0 ``DPO.compute_loss`` / ``ORPO.compute_loss`` (``use_varlen_attn=True``) read
    the boundaries under ``cumulative_len_rank_{dist.get_rank()}`` with torch's ``get_rank``,
    which needs a process group: a plain ``xtuner train`` (no launcher) dies at the first step
    with ``ValueError: Default process group has not been initialized``. Their module's
    ``dist`` is swapped for a view of ``torch.distributed`` whose ``get_rank`` is 0 without a
    group (MMEngine's convention, the rank ``PackedBatchCheckHook`` publishes under).

    Returns:
        True if applied (an XTuner whose DPO/ORPO call ``dist.get_rank()`` there).
    """
    applied = False
    for name, cls in (("xtuner.model.dpo", "DPO"), ("xtuner.model.orpo", "ORPO")):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if module.__dict__.get(
            "dist"
        ) is torch.distributed and "dist.get_rank()" in inspect.getsource(
            getattr(module, cls).compute_loss
        ):
            module.dist = _RankWithoutGroup(torch.distributed)
            applied = True
    return applied


def _response_targets(labels: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool: token ``t``'s target ``labels[:, t + 1]`` is supervised (not -100)."""
    targets = torch.zeros_like(labels, dtype=torch.bool)
    targets[:, :-1] = labels[:, 1:] != -100
    return targets


def _keep_target_id_zero(compute_loss):
    """Wrap ``compute_loss``: its gathered log-probs keep every supervised target, id 0 too."""

    @functools.wraps(compute_loss)
    def wrapped(self, data, data_samples=None):
        self._xtuner_rope_targets = _response_targets(data["labels"])
        try:
            return compute_loss(self, data, data_samples)
        finally:
            self._xtuner_rope_targets = None

    return wrapped


def _gather_with_targets(gather):
    """Wrap ``_gather_masked_logits``: the mask is the one recorded before -100 became 0."""

    @functools.wraps(gather)
    def wrapped(self, logits, labels, mask):
        targets = getattr(self, "_xtuner_rope_targets", None)
        if targets is not None and targets.shape != labels.shape:  # split for sequence parallel
            from xtuner.parallel.sequence import (
                get_sequence_parallel_group,
                split_for_sequence_parallel,
            )

            targets = split_for_sequence_parallel(
                targets, dim=1, sp_group=get_sequence_parallel_group()
            )
        return gather(self, logits, labels, mask if targets is None else targets.to(mask.device))

    return wrapped


def patch_xtuner_preference_target_zero() -> bool:
    """Count target token id 0 in XTuner's DPO/ORPO log-probs.

    xtuner 0.2.0 ``DPO.compute_loss`` / ``ORPO.compute_loss`` build the log-prob mask as
    ``labels[labels == -100] = 0; loss_mask = labels != 0``: every supervised target whose id
    is 0 (a real token in Llama 3 and Qwen2 vocabularies, "!") is silently left out of the
    chosen/rejected log-probs, while the IPO/ORPO denominators (``labels != -100``) still count
    it. The wrapped ``compute_loss`` records ``labels != -100`` (shifted as XTuner shifts)
    before XTuner overwrites the -100s, and ``_gather_masked_logits`` uses it.

    Returns:
        True if applied (an XTuner whose DPO/ORPO still build the mask that way).
    """
    applied = False
    for name, cls in (("xtuner.model.dpo", "DPO"), ("xtuner.model.orpo", "ORPO")):
        try:
            model = getattr(importlib.import_module(name), cls)
        except ImportError:
            continue
        if getattr(
            model.compute_loss, "_xtuner_rope_targets", False
        ) or "loss_mask = labels != 0" not in inspect.getsource(model.compute_loss):
            continue
        model.compute_loss = _keep_target_id_zero(model.compute_loss)
        model.compute_loss._xtuner_rope_targets = True
        model._gather_masked_logits = _gather_with_targets(model._gather_masked_logits)
        applied = True
    return applied


_EMBEDS_ONLY_WITHOUT_CACHE = "inputs_embeds is not None and past_key_values is None"


def _is_empty_cache(past_key_values) -> bool:
    from transformers.cache_utils import Cache

    return isinstance(past_key_values, Cache) and past_key_values.get_seq_length() == 0


def _fix_generation_from_embeds(cls: type) -> bool:
    """Wrap ``cls.prepare_inputs_for_generation`` if it has the InternLM2 gap; True if wrapped."""
    method = cls.__dict__.get("prepare_inputs_for_generation")
    if method is None or getattr(method, "_xtuner_rope_embeds", False):
        return False
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    if _EMBEDS_ONLY_WITHOUT_CACHE not in source:
        return False

    @functools.wraps(method)
    def prepare_inputs_for_generation(
        self, input_ids, past_key_values=None, attention_mask=None, inputs_embeds=None, **kwargs
    ):
        out = method(
            self,
            input_ids,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )
        if (
            inputs_embeds is not None
            and "inputs_embeds" not in out
            and _is_empty_cache(past_key_values)
        ):
            out.pop("input_ids", None)  # the empty [b, 0] ids generate() starts from
            out["inputs_embeds"] = inputs_embeds
        return out

    prepare_inputs_for_generation._xtuner_rope_embeds = True
    cls.prepare_inputs_for_generation = prepare_inputs_for_generation
    return True


def _internlm2_causal_lm_classes(module) -> list[type]:
    return [
        v
        for k, v in vars(module).items()
        if isinstance(v, type) and k.startswith("InternLM2") and k.endswith("ForCausalLM")
    ]


def patch_internlm2_generation_from_embeds() -> bool:
    """Let InternLM2's modeling code generate from ``inputs_embeds`` under transformers 4.48.

    Written against transformers 4.48.0 and InternLM2's hub ``modeling_internlm2.py`` (the
    version xtuner 0.2.0 ships at ``xtuner._lite.modelings.internlm2``); other versions not
    checked. ``generate()`` hands the first step an empty ``DynamicCache`` instead of
    ``past_key_values=None``, and the
    modeling code's ``prepare_inputs_for_generation`` feeds ``inputs_embeds`` only
    ``if inputs_embeds is not None and past_key_values is None``: it feeds the empty ``[b, 0]``
    ``input_ids`` instead, with ``cache_position`` over the ``n`` prompt embeddings, and the
    model dies in its own ``_update_causal_mask``: ``RuntimeError: The size of tensor a (0)
    must match the size of tensor b (n) at non-singleton dimension 0``. Seen in XTuner's
    ``EvaluateChatHook`` with ``evaluation_images`` (LLaVA: ``llm.generate(inputs_embeds=...)``),
    with or without xtuner-rope. Here the step is given its ``inputs_embeds`` when the cache is
    still empty (what transformers' own models check, ``cache_position[0] == 0``); later steps
    are untouched, and so is every step where the gap is absent (no ``Cache`` object, or
    ``inputs_embeds`` already fed). Applied to InternLM2 ``*ForCausalLM`` classes whose code has that check:
    XTuner's shipped copies now, remote-code classes when ``transformers`` loads them.

    Returns:
        True if the patch is installed (transformers' remote-code loader wrapped).
    """
    import transformers
    import transformers.dynamic_module_utils as dynamic

    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (4, 36):
        return False  # no Cache objects yet: generate() starts from past_key_values=None
    original = dynamic.get_class_in_module
    if getattr(original, "_xtuner_rope_embeds", False):
        return False

    @functools.wraps(original)
    def get_class_in_module(class_name, module_path, *args, **kwargs):
        cls = original(class_name, module_path, *args, **kwargs)
        for candidate in _internlm2_causal_lm_classes(sys.modules.get(cls.__module__, cls)):
            _fix_generation_from_embeds(candidate)
        return cls

    get_class_in_module._xtuner_rope_embeds = True
    dynamic.get_class_in_module = get_class_in_module
    for name, loaded in list(sys.modules.items()):  # already loaded: XTuner's copies, remote code
        if loaded is not None and "internlm2" in name.lower() and "modeling" in name:
            for cls in _internlm2_causal_lm_classes(loaded):
                _fix_generation_from_embeds(cls)
    import xtuner._lite.modelings.internlm2.modeling_internlm2 as shipped

    for cls in _internlm2_causal_lm_classes(shipped):
        _fix_generation_from_embeds(cls)
    return True


# Checks run on the schedulers MMEngine is about to build, (schedulers, iterations per epoch,
# a description of the data) -> None or raise; the start-up's warm-up check registers itself here
# (``xtuner_rope.config.warmup``), as compat may not import the start-up.
SCHEDULER_CHECKS: list = []


def patch_mmengine_warmup_rounding() -> bool:
    """Turn "end should be larger than begin, but got begin=0, end=0" into an error naming the
    warm-up, the dataset's length and the edit (``xtuner_rope.config.warmup``).

    mmengine 0.10.x ``Runner._build_param_scheduler`` converts an epoch-based scheduler with
    ``convert_to_iter_based=True`` by truncating ``end * len(train_dataloader)``; XTuner's stock
    warm-up (``end=warmup_ratio * max_epochs``) becomes 0 iterations on a small dataset and the
    scheduler's constructor raises a ``ValueError`` that names neither. The check runs just
    before the original, with the same dataloader; nothing else changes.

    Returns:
        True if applied (mmengine's Runner has ``_build_param_scheduler``).
    """
    try:
        from mmengine.runner import Runner
    except ImportError:
        return False
    original = getattr(Runner, "_build_param_scheduler", None)
    if original is None or getattr(original, "_xtuner_rope_warmup", False):
        return False

    @functools.wraps(original)
    def build(self, scheduler, optim_wrapper):
        from mmengine.runner import BaseLoop

        if isinstance(self._train_loop, BaseLoop) and SCHEDULER_CHECKS:
            loader = self.train_dataloader
            length = len(loader)
            samples = len(loader.dataset) if hasattr(loader.dataset, "__len__") else "?"
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            for check in SCHEDULER_CHECKS:
                check(
                    scheduler,
                    length,
                    f"{samples} samples, batch size {loader.batch_size}, {world} process(es)",
                )
        return original(self, scheduler, optim_wrapper)

    build._xtuner_rope_warmup = True
    Runner._build_param_scheduler = build
    return True


def apply() -> list[str]:
    """Apply every patch whose gap exists here; safe to call any number of times.

    Returns:
        The names of the patches applied so far in this process.
    """
    for patch in (
        patch_torch_cpu_bf16_query,
        patch_bitsandbytes_triton_probe,
        register_internlm2_auto_classes,
        patch_mmengine_dist_init_on_cpu,
        patch_mmengine_ddp_device_ids_on_cpu,
        patch_deepspeed_cpu_allgather_grad_mode,
        patch_deepspeed_zero3_cpu_gather,
        patch_checkpoint_loading,
        patch_sft_forward_names_missing_hook,
        patch_model_resource_llm_path,
        patch_set_model_resource_llm_path,
        patch_xtuner_preference_rank,
        patch_xtuner_preference_target_zero,
        patch_sft_sequence_parallel_loss,
        patch_xtuner_train_sequence_parallel_check,
        patch_internlm2_generation_from_embeds,
        patch_mmengine_warmup_rounding,
    ):
        if patch.__name__ not in _APPLIED and patch():
            _APPLIED.append(patch.__name__)
    return list(_APPLIED)
