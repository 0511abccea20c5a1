"""Every environment variable lvx reads is listed in docs/configuration.md (CTest config_knobs).

Scans the production code (src/, kernels/, models/, video/) for variables read by name:
getenv("NAME") and the LVX_ names it otherwise looks up ("LVX_..." string literals). A name the
page does not mention fails the check, naming the file and line; so does an LVX_ name the page
lists that no code reads any more (a stale row). Options' LVX_<OPTION> mirrors are listed by
--help and need no row."""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
DIRS = ["src", "kernels", "models", "video"]


def read_names():
    found = {}
    for d in DIRS:
        for f in sorted((ROOT / d).rglob("*")):
            if f.suffix not in (".cpp", ".h", ".cu", ".cuh"):
                continue
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                for name in re.findall(r'getenv\("([A-Z_0-9]+)"\)', line) + \
                        re.findall(r'"(LVX_[A-Z_0-9]+)"', line):
                    found.setdefault(name, "%s:%d" % (f.relative_to(ROOT), n))
    return found


def main():
    page = PAGE.read_text()
    listed = set(re.findall(r"`([A-Z][A-Z_0-9]+)`", page))
    found = read_names()
    missing = sorted(n for n in found if n not in listed)
    for n in missing:
        print("config_knobs: %s (read at %s) is not in docs/configuration.md" % (n, found[n]))
    # LVX_ rows of the first table that no production code reads (benchmarks' and tests' own
    # variables are named in the text below it, not in a table row).
    rows = set(re.findall(r"^\| `(LVX_[A-Z_0-9]+)` \|", page, re.M))
    # LVX_API_KEY is read as --api-key's mirror (by name through the option parser, never as a
    # literal), yet has its row: the launcher's way of handing the keys to the ranks.
    stale = sorted(n for n in rows if n not in found and n != "LVX_API_KEY")
    for n in stale:
        print("config_knobs: docs/configuration.md lists %s, which no code reads" % n)
    if missing or stale:
        return 1
    print("config_knobs: %d variables read, all listed" % len(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
