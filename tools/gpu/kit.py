"""Split the GPU kit's wheels into parts that travel separately, and put them back together.

Standard library only: it runs on the GPU machine before anything is installed.

    python tools/gpu/kit.py split gpu_kit/wheels gpu_kit --part-mib 58 --max-parts 1
        -> gpu_kit/part1/ (and part2, ... without --max-parts), each at most 58 MiB; a wheel
           larger than a part travels as numbered pieces; gpu_kit/part1/MANIFEST.json lists every
           wheel's size and sha256 and where its pieces are. `make gpu-kit` asks for one part:
           the GPU check carries it in one call.
    python tools/gpu/kit.py assemble gpu_kit DEST
        -> DEST/*.whl, every sha256 checked; a missing part is named (which one to carry).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

MIB = 1 << 20
MANIFEST = "MANIFEST.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def _pieces(path: Path, cap: int) -> list[tuple[str, int, int]]:
    """``(piece name, offset, size)`` of a file cut into pieces of at most ``cap`` bytes."""
    size = path.stat().st_size
    if size <= cap:
        return [(path.name, 0, size)]
    return [
        (f"{path.name}.piece{i:02d}", off, min(cap, size - off))
        for i, off in enumerate(range(0, size, cap))
    ]


def split(src: Path, dest: Path, part_mib: float, max_parts: int | None = None) -> list[Path]:
    """Pack the wheels of ``src`` into ``dest/partN`` folders of at most ``part_mib`` MiB.

    First-fit by decreasing size; the manifest (a few KiB) goes into part 1 and counts there.

    Args:
        src: folder of ``*.whl``.
        dest: the kit folder (``partN`` folders are written in it).
        part_mib: the most one part may hold, in MiB.
        max_parts: refuse a kit needing more parts (the GPU check carries one: 1).

    Returns:
        The part folders, in order.

    Raises:
        SystemExit: no wheels, or more than ``max_parts`` parts needed (names the largest wheels).
    """
    cap = int(part_mib * MIB)
    wheels = sorted(src.glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True)
    if not wheels:
        raise SystemExit(f"kit.py split: no wheels in {src}")
    total = sum(w.stat().st_size for w in wheels) + 64 * 1024
    if max_parts is not None and total > max_parts * cap:
        largest = ", ".join(f"{w.name} {w.stat().st_size / MIB:.1f} MiB" for w in wheels[:3])
        raise SystemExit(
            f"kit.py split: the wheels need {total / MIB:.1f} MiB, more than {max_parts} part(s) "
            f"of {part_mib:g} MiB; the largest: {largest}. Carry only what the GPU check needs "
            "(tools/gpu/kit_requirements.txt)"
        )
    manifest = {"part_mib": part_mib, "wheels": {}}
    parts: list[list] = [[64 * 1024, []]]  # [bytes used, [(wheel, piece, offset, size)]]
    for wheel in wheels:
        entry = manifest["wheels"][wheel.name] = {
            "sha256": _sha256(wheel),
            "size": wheel.stat().st_size,
            "pieces": [],
        }
        for piece, offset, size in _pieces(wheel, cap - 64 * 1024):
            part = next((p for p in parts if p[0] + size <= cap), None)
            if part is None:
                part = [0, []]
                parts.append(part)
            part[0] += size
            part[1].append((wheel, piece, offset, size))
            entry["pieces"].append([f"part{parts.index(part) + 1}", piece])
    folders = []
    for i, (_, files) in enumerate(parts, start=1):
        folder = dest / f"part{i}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for wheel, piece, offset, size in files:
            with open(wheel, "rb") as f_in, open(folder / piece, "wb") as f_out:
                f_in.seek(offset)
                f_out.write(f_in.read(size))
        folders.append(folder)
    (folders[0] / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return folders


def assemble(kit: Path, dest: Path) -> list[Path]:
    """Rebuild every wheel of the manifest in ``dest``, each checked against its sha256.

    Raises:
        SystemExit: a part or piece is missing (names the part to carry) or a checksum differs.
    """
    manifest_path = kit / "part1" / MANIFEST
    if not manifest_path.is_file():
        raise SystemExit(
            f"kit.py assemble: {manifest_path} is missing: carry {kit}/part1 "
            "(built by `make gpu-kit`)"
        )
    manifest = json.loads(manifest_path.read_text())
    missing = sorted(
        {
            part
            for e in manifest["wheels"].values()
            for part, piece in e["pieces"]
            if not (kit / part / piece).is_file()
        }
    )
    if missing:
        raise SystemExit(
            f"kit.py assemble: {', '.join(missing)} of {kit} not here: carry them "
            "(each part alone fits one call), then run again"
        )
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for name, entry in manifest["wheels"].items():
        with open(dest / name, "wb") as f_out:
            for part, piece in entry["pieces"]:
                f_out.write((kit / part / piece).read_bytes())
        if _sha256(dest / name) != entry["sha256"]:
            raise SystemExit(f"kit.py assemble: {name} does not match its sha256: rebuild the kit")
        out.append(dest / name)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_split = sub.add_parser("split", help="wheels folder -> part folders")
    p_split.add_argument("src", type=Path)
    p_split.add_argument("dest", type=Path)
    p_split.add_argument("--part-mib", type=float, default=58.0)
    p_split.add_argument("--max-parts", type=int, default=None)
    p_asm = sub.add_parser("assemble", help="part folders -> wheels folder")
    p_asm.add_argument("kit", type=Path)
    p_asm.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "split":
        for folder in split(args.src, args.dest, args.part_mib, args.max_parts):
            size = sum(f.stat().st_size for f in folder.iterdir()) / MIB
            print(f"{folder}: {size:.1f} MiB")
    else:
        print(f"{len(assemble(args.kit, args.dest))} wheels in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
