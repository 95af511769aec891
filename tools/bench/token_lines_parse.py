"""The ``.bin`` row parse: pyarrow's JSON reader (``data.token_lines``) against the numpy parser.

Issue 59 asked to time ``pyarrow.json`` (explicit ``list<int64>`` schema) against the
hand-written numpy parser ``data.token_lines`` had (a strict subset of JSON integers checked
byte by byte, eight digits read at a time), and to keep the latter only if it is >= 1.2x
faster. Writes the ``bin_rows.py`` corpus (``intern_repo_pack.make_corpus``: ``N`` documents
of 8-100 tokens), takes ``--rows`` random rows of ``--docs`` documents (a packed row of 8192
tokens holds about 150) and parses each row's lines both ways, in alternating rounds in this
one process: ``parse_token_lines`` (the package's) and ``parse_int_lists`` of the numpy
parser's module, given as a file (``git show 02b7751:xtuner_rope/data/token_lines.py >
/tmp/token_lines_numpy.py``). Prints tokens per second of each round and the ratio; checks
both parse the same integers.

Usage:
    python tools/bench/token_lines_parse.py --numpy-parser /tmp/token_lines_numpy.py
        [--documents 1000000] [--rows 300] [--docs 150] [--rounds 3]
"""

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from intern_repo_pack import make_corpus

from xtuner_rope.data.token_lines import parse_token_lines


def numpy_parser(path: str):
    """``parse_int_lists`` of the numpy parser's module at ``path`` (imported as a module of
    ``xtuner_rope.data``, whose ``pack_plans`` it reads)."""
    spec = importlib.util.spec_from_file_location("xtuner_rope.data._token_lines_numpy", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    suffix = len(module.SUFFIX)
    return lambda lines: module.parse_int_lists([x[x.index(b"[") + 1 : -suffix] for x in lines])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numpy-parser", required=True)
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--docs", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ways = {"pyarrow": parse_token_lines, "numpy": numpy_parser(args.numpy_parser)}
    with tempfile.TemporaryDirectory(prefix="token-lines-bench-") as tmp:
        make_corpus(args.documents, Path(tmp))
        lines = (Path(tmp) / "corpus.bin").read_bytes().split(b"\n")[:-1]
    rng = np.random.default_rng(0)
    rows = [
        [lines[i] for i in rng.integers(0, len(lines), args.docs).tolist()]
        for _ in range(args.rows)
    ]
    for row in rows:
        (a, n), (b, m) = ways["pyarrow"](row), ways["numpy"](row)
        assert (a == b).all() and (n == m).all(), "the parsers disagree"
    for r in range(args.rounds):
        rates = {}
        for name, parse in ways.items():
            start, tokens = time.perf_counter(), 0
            for row in rows:
                tokens += len(parse(row)[0])
            rates[name] = tokens / (time.perf_counter() - start) / 1e6
        print(
            f"round {r}: pyarrow {rates['pyarrow']:.2f}M tokens/s, numpy parser "
            f"{rates['numpy']:.2f}M, numpy / pyarrow {rates['numpy'] / rates['pyarrow']:.2f}x"
        )


if __name__ == "__main__":
    main()
