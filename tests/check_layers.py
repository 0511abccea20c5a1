"""No lower layer includes a higher one (CTest layer_order; docs/architecture.md lists the layers).

Each folder has a layer; a file may include headers of its own layer or below. Known exceptions
would be listed below by file and header (none today), so that a new one fails and a listed one,
once fixed, is noticed: an exception that no longer occurs fails too."""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [  # (folder prefix, layer): the longest prefix wins
    ("src/common/", 1), ("kernels/", 2), ("src/dist/", 3), ("src/attention/", 4),
    ("src/planner/", 5), ("models/", 6), ("video/", 6), ("src/runtime/", 7), ("tools/", 7),
    ("src/serve/", 8), ("src/cli/", 8), ("python/", 8),
]
ALLOWED = set()  # (file, included header): known exceptions


def layer(path):
    best = None
    for prefix, n in LAYERS:
        if path.startswith(prefix) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, n)
    return best[1] if best else None


def main():
    bad, seen = [], set()
    for prefix, _ in LAYERS:
        for f in sorted((ROOT / prefix).rglob("*")):
            if f.suffix not in (".cpp", ".h", ".cu", ".cuh"):
                continue
            rel = str(f.relative_to(ROOT))
            mine = layer(rel)
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
                if not m:
                    continue
                theirs = layer(m.group(1))
                if theirs is None or theirs <= mine:
                    continue
                if (rel, m.group(1)) in ALLOWED:
                    seen.add((rel, m.group(1)))
                    continue
                bad.append("%s:%d (layer %d) includes %s (layer %d)" % (rel, n, mine, m.group(1),
                                                                      theirs))
    for b in bad:
        print("layer_order: " + b)
    for gone in sorted(ALLOWED - seen):
        print("layer_order: the exception %s -> %s no longer occurs: remove it" % gone)
    if bad or ALLOWED - seen:
        return 1
    print("layer_order: every include goes to its own layer or below (%d known exceptions)"
          % len(ALLOWED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
