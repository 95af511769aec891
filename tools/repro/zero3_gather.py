"""Count ZeRO-3 steps whose parameters are still being written after ``engine.step()`` returned.

DeepSpeed 0.19.6 on the CPU accelerator re-gathers every small ("persistent") parameter after
the optimizer step with one async gloo all-gather per parameter and waits only for the last
(see ``xtuner_rope.compat.deepspeed_cpu.patch_deepspeed_zero3_cpu_gather``). If a gather is still running
when ``step()`` returns, the parameter read right after differs from the same parameter read a
moment later. Nothing of XTuner or xtuner-rope is involved unless ``--patched`` is given, which
activates ``xtuner_rope`` (and so applies its compat patches) before DeepSpeed starts.

Run on 2 processes over gloo::

    torchrun --nproc_per_node 2 tools/repro/zero3_gather.py --steps 400
    torchrun --nproc_per_node 2 tools/repro/zero3_gather.py --steps 400 --patched

Each rank prints ``rank R: N of S steps read parameters still being gathered``.
"""

import argparse
import time

import torch


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument(
        "--patched",
        action="store_true",
        help="activate xtuner_rope first (applies xtuner_rope.compat)",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help='DeepSpeed\'s own workaround: "stage3_allgather_sequential": true',
    )
    return parser.parse_args()


def _engine(args: argparse.Namespace):
    import deepspeed

    zero = {"stage": 3, "overlap_comm": False, "stage3_allgather_sequential": args.sequential}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
    }
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(
            *(torch.nn.Linear(args.width, args.width) for _ in range(args.layers))
        )
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=model.parameters()
    )
    return engine


def _snapshot(engine) -> list[torch.Tensor]:
    return [p.data.clone() for p in engine.module.parameters()]


def main() -> None:
    args = _parse()
    if args.patched:
        import xtuner_rope

        xtuner_rope.activate()  # applies xtuner_rope.compat
    engine = _engine(args)
    rank = torch.distributed.get_rank()
    torch.manual_seed(1 + rank)
    racy = 0
    for _ in range(args.steps):
        x = torch.randn(4, args.width)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        right_after = _snapshot(engine)
        time.sleep(0.002)  # any gather still running lands in this window
        later = _snapshot(engine)
        racy += any(not torch.equal(a, b) for a, b in zip(right_after, later))
    print(
        f"rank {rank}: {racy} of {args.steps} steps read parameters still being gathered",
        flush=True,
    )


if __name__ == "__main__":
    main()
