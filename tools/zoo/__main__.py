"""Sweep XTuner's stock configs: one edit, tiny model, a few real iterations, one row each.

    python -m tools.zoo 'internlm2_chat_1_8b_*alpaca*' 'llama2_7b_chat_qlora_alpaca_e3' \\
        --jobs 1 --out work_dirs/zoo --results docs/zoo/results.json --markdown docs/zoo/zoo.md

Resumable: rows already in the results file are skipped (``--only missing``, the default);
``--only failed`` re-runs crashed/leaked/mispredicted rows, ``--only all`` everything selected;
``--table-only`` rewrites the markdown from the results file (e.g. after an interrupted sweep).
``--classes`` prints the classes of all stock configs with the rows that cover them
(``--classes-markdown FILE`` writes the table). See ``tools/zoo/`` for what each row does. Run from the repository root.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from tools import zoo


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.zoo", description=__doc__.splitlines()[0])
    p.add_argument(
        "patterns",
        nargs="*",
        default=["*"],
        help="glob patterns of `xtuner list-cfg` names (default: all 594)",
    )
    p.add_argument("--out", default="work_dirs/zoo", help="working folder (copies, runs, logs)")
    p.add_argument("--results", default="docs/zoo/results.json", help="JSON results file")
    p.add_argument("--markdown", default="docs/zoo/zoo.md", help="markdown table to write")
    p.add_argument("--jobs", type=int, default=1, help="rows run at once (each is 1-2 cores)")
    p.add_argument("--only", choices=["missing", "failed", "all"], default="missing")
    p.add_argument("--iters", type=int, default=4, help="training iterations per row")
    p.add_argument(
        "--models",
        default=None,
        help="folder of the tiny checkpoints, built once per family (default: "
        "OUT/models; the tests use the repository's models/)",
    )
    p.add_argument("--list", action="store_true", help="print the selected configs and exit")
    p.add_argument(
        "--rejudge",
        action="store_true",
        help="apply the current judging rules to the recorded rows of the results file (a "
        "row recorded as trained isolated with no row of two documents becomes not "
        "exercised), rewrite it and the markdown, and exit",
    )
    p.add_argument(
        "--classes",
        action="store_true",
        help="print the classes of all stock configs (read from their text) with the swept "
        "rows covering each, and exit (1 when a class is uncovered)",
    )
    p.add_argument("--classes-markdown", default=None, help="with --classes: also write it here")
    p.add_argument(
        "--table-only",
        action="store_true",
        help="rewrite the markdown table from the results file and exit",
    )
    args = p.parse_args(argv)
    results_path = Path(args.results)
    if args.classes:
        table, uncovered = zoo.classes_markdown(zoo.stock_texts(), zoo.load_results(results_path))
        print(table, end="")
        if args.classes_markdown:
            Path(args.classes_markdown).write_text(table, encoding="utf-8")
        return 1 if uncovered else 0
    if args.rejudge:
        rows = {n: zoo.rejudge(r) for n, r in zoo.load_results(results_path).items()}
        results_path.write_text(json.dumps(rows, indent=1, sort_keys=True), encoding="utf-8")
        args.table_only = True
    if args.table_only:
        Path(args.markdown).write_text(
            zoo.markdown(zoo.load_results(results_path)), encoding="utf-8"
        )
        return 0
    if args.list:
        names = zoo.select(
            zoo.list_configs(args.patterns), zoo.load_results(results_path), args.only
        )
        print("\n".join(names))
        return 0
    start = time.time()

    def progress(done: int, total: int, row: dict) -> None:
        width = 30
        bar = "#" * (width * done // max(total, 1))
        print(
            f"[{bar:<{width}}] {done}/{total} {time.time() - start:6.0f}s  {row['config']}: "
            f"{row['outcome']} (doctor {'exit ' + str(row['doctor']['exit_code']) if row.get('doctor') else '-'})"
            f"  {str(row.get('message', ''))[:100]}",
            flush=True,
        )

    results = zoo.sweep(
        args.patterns,
        Path(args.out),
        results_path,
        jobs=args.jobs,
        only=args.only,
        iters=args.iters,
        models=args.models,
        progress=progress,
    )
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(zoo.markdown(results), encoding="utf-8")
    counts = zoo.counts(results)
    print(", ".join(f"{k} {v}" for k, v in counts.items()))
    failed = counts[zoo.CRASHED] + counts[zoo.LEAKED] + counts[zoo.SWEEP_ERROR]
    return 1 if failed or counts["doctor wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
