"""Intern-repo ``.bin`` rows served: the bulk parse of a row's lines against XTuner's reader.

Writes ``N`` tokenized documents (those of ``intern_repo_pack.py``), packs them with
``build_whole_packed_dataset`` (stock arguments) and reads random rows, in alternating rounds
in this one process, two ways: ``packed[i]`` (the lines of the row's documents parsed in one
numpy pass, ``token_lines.TokenLines``) and the same row built document by document through
XTuner's ``JsonlDataset.__getitem__`` (``json.loads`` a line; what rows cost before). Prints
tokens per second of each round and the ratio; checks the rows are equal.

Usage:
    python tools/bench/bin_rows.py [--documents 1000000] [--reads 300] [--rounds 3]
"""

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from intern_repo_pack import make_corpus

from xtuner_rope.data.intern_repo_packing import pieces_by_reader


def by_xtuners_reader(packer, row: int) -> dict:
    """Row ``row`` of ``packer`` built document by document through XTuner's reader (the
    package's own fallback, ``intern_repo_packing.pieces_by_reader``)."""
    pieces = slice(packer.row_pieces[row], packer.row_pieces[row + 1])
    sizes = packer.sizes[pieces]
    ids, labels = pieces_by_reader(
        packer.dataset, packer.documents[pieces], packer.offsets[pieces], sizes
    )
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    positions = (np.arange(bounds[-1]) - np.repeat(bounds[:-1], sizes)).tolist()
    return {
        "input_ids": ids,
        "cumulative_len": bounds.tolist(),
        "position_ids": positions,
        "labels": labels,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--reads", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from xtuner.dataset import intern_repo

    from xtuner_rope.data.intern_repo_packing import build_whole_packed_dataset

    with tempfile.TemporaryDirectory(prefix="bin-rows-bench-") as tmp:
        make_corpus(args.documents, Path(tmp))
        cfg = dict(type=intern_repo.load_intern_repo_tokenized_dataset, folder=tmp)
        (packer,) = build_whole_packed_dataset(cfg, packed_length=8192, seed=1024).datasets
        rng = np.random.default_rng(0)
        ways = {"bulk": packer.__getitem__, "reader": lambda i: by_xtuners_reader(packer, i)}
        for i in rng.integers(0, len(packer), 5).tolist():
            assert ways["bulk"](i) == ways["reader"](i), f"row {i} differs"
        for r in range(args.rounds):
            rates = {}
            for name, read in ways.items():
                rows = rng.integers(0, len(packer), args.reads).tolist()
                start, tokens = time.perf_counter(), 0
                for i in rows:
                    tokens += len(read(i)["input_ids"])
                rates[name] = tokens / (time.perf_counter() - start) / 1e6
            print(
                f"round {r}: bulk parse {rates['bulk']:.2f}M tokens/s, XTuner's reader "
                f"{rates['reader']:.2f}M, ratio {rates['bulk'] / rates['reader']:.2f}x"
            )


if __name__ == "__main__":
    main()
