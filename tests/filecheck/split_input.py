"""Print one chunk of a `// -----`-separated test file (used by lit.cfg.py as %split-input).

    split_input.py FILE INDEX

Lines outside chunk INDEX (0-based) and the separators are printed as empty lines, so the chunk
keeps its line numbers: parser locations and FileCheck's [[@LINE]] agree with the test file.
"""

from __future__ import annotations

import sys

SEPARATOR = "// -----"


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    wanted = int(argv[2])
    chunk = 0
    out = []
    for line in lines:
        if line.strip() == SEPARATOR:
            chunk += 1
            out.append("")
            continue
        out.append(line if chunk == wanted else "")
    if wanted > chunk or wanted < 0:
        print(f"{argv[1]} has {chunk + 1} chunks, no chunk {wanted}", file=sys.stderr)
        return 2
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
