"""DeepSpeed checkpoint folders laid out as DeepSpeed 0.19 writes them (checkpoint-file tests).

Imported as ``from deepspeed_folders import deepspeed_folder`` (``tests/support`` is on
``sys.path``): tiny tensors, the real file names and the model-states keys xtuner-rope reads.
"""

import torch


def deepspeed_folder(folder, world: int, ranks: list[int], stage: int = 2):
    """The files DeepSpeed 0.19's ``save_checkpoint`` writes (one model-parallel rank): ZeRO-1/2
    ``mp_rank_00_model_states.pt`` (with ``dp_world_size`` and ``ds_config``) and one optimizer
    file per data-parallel rank; ZeRO-3 one model-states file per rank too (names as
    ``engine._get_ckpt_name`` / ``_get_zero_ckpt_name`` build them)."""
    folder.mkdir()
    state = {
        "module": {"w": torch.randn(8)},
        "dp_world_size": world,
        "ds_config": {"zero_optimization": {"stage": stage}},
    }
    models = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks] if stage == 3 else []
    for name in models or ["mp_rank_00_model_states.pt"]:
        torch.save(state, folder / name)
    for rank in ranks:
        torch.save(
            {"optimizer_state_dict": {"x": torch.randn(4)}},
            folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        )
