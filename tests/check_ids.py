"""Compare two collections of test IDs, old IDs mapped by tests/renames.txt: was a test lost?

    bash tests/run_tests.sh --collect BEFORE     # in the old tree (or any ID lists)
    bash tests/run_tests.sh --collect AFTER      # in the new one
    python tests/check_ids.py BEFORE AFTER [--renames tests/renames.txt]

BEFORE and AFTER are folders of ``<run>.txt`` files (``local.txt``, ``np3.txt``,
``torch-np2.txt``, ...), one test ID a line.  For every run in BEFORE each ID is
mapped through the renames (a test's own line first, then its file's; the new ID
again, so a test moved and later renamed is followed to its last name) and must be
among that run's IDs in AFTER, unless a line says it was removed.  Prints one line
per run (IDs before, after, lost, removed, added) and every lost ID; exit status 1
if an ID was lost or a run of BEFORE is missing from AFTER.  Added IDs (new tests)
are counted, not refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def read_renames(path: Path) -> list[tuple[str, str]]:
    """The (old, new) pairs of a renames file, tests' own lines before files' lines.

    A line is ``OLD NEW``, or ``OLD => NEW`` where an ID holds spaces (a parameter's text);
    NEW ``-`` says the test was removed (its comment says why).
    """
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue
        if " => " in line:
            pairs.append(tuple(part.strip() for part in line.split(" => ", 1)))
            continue
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise SystemExit(f"{path}:{number}: expected OLD NEW, got {line!r}")
        pairs.append((parts[0], parts[1]))
    return sorted(pairs, key=lambda p: "::" not in p[0])


REMOVED = "-"


def mapped(test_id: str, renames: list[tuple[str, str]], used: set) -> str | None:
    """``test_id`` under the first rename whose old part is its file or its test, and the
    result under the renames again (a later move or rename), each line at most once (a
    test given a parameter, ``test_x`` -> ``test_x[a]``, is not renamed again); None for a
    removed test."""
    applied = set()
    while True:
        for old, new in renames:
            sep = "[" if "::" in old else "::"
            if old not in applied and (test_id == old or test_id.startswith(old + sep)):
                used.add(old)
                applied.add(old)
                if new == REMOVED:
                    return None
                test_id = new + test_id[len(old):]
                break
        else:
            return test_id


def read_ids(path: Path) -> set:
    return {line.strip() for line in path.read_text().splitlines() if line.strip()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--renames", type=Path, default=HERE / "renames.txt")
    args = parser.parse_args(argv)
    renames = read_renames(args.renames)
    used: set = set()
    bad = False
    print(f"{'run':<12} {'before':>7} {'after':>7} {'lost':>5} {'removed':>8} {'added':>6}")
    for old_file in sorted(args.before.glob("*.txt")):
        new_file = args.after / old_file.name
        if not new_file.exists():
            print(f"{old_file.stem:<12} missing in {args.after}")
            bad = True
            continue
        before = [mapped(t, renames, used) for t in read_ids(old_file)]
        old = {t for t in before if t is not None}
        new = read_ids(new_file)
        lost, added = sorted(old - new), new - old
        print(f"{old_file.stem:<12} {len(old):>7} {len(new):>7} {len(lost):>5} "
              f"{before.count(None):>8} {len(added):>6}")
        for t in lost:
            print(f"    lost: {t}")
        bad = bad or bool(lost)
    unused = [old for old, _ in renames if old not in used]
    if unused:
        print(f"renames that matched no ID: {', '.join(unused)}")
    print("no test lost" if not bad else "TESTS LOST")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
