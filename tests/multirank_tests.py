"""Which GoogleTest tests of an area start several rank processes (tests/CMakeLists.txt labels
them `multirank` and gives them PROCESSORS 2, so that `ctest -j 2` does not run two of them at
once on two cores).

Read from the sources, so it follows the tests as they change: a test is multi-rank when its body
starts ranks (`run_ranks(`, `launch_local(`, `lvx launch`, an `nproc` flag or key that is not a
literal 1, `--world`), directly or through a helper of the same file that does. Prints a
--gtest_filter expression (`*Suite.Name*:...`), or `-` when the area has none.

    python tests/multirank_tests.py tests/test_dist*.cpp
"""
import re
import sys

STARTS_RANKS = re.compile(r"run_ranks\s*\(\s*(?![01]\s*,)|launch_local\s*\(|\blaunch --n|"
                          r"nproc(?![ =:\"']*1\b)|\blvx launch\b|--world")
TEST_HEAD = re.compile(r"^\s*TEST(?:_P|_F)?\s*\(\s*(\w+)\s*,\s*(\w+)\s*\)", re.M)
FUNCTION_HEAD = re.compile(r"^[A-Za-z_][\w:<>,\s\*&]*?\b(\w+)\s*\([^;{}]*\)\s*(?:const\s*)?\{",
                           re.M)
TOP_LEVEL_END = re.compile(r"^\}", re.M)


def blocks(text, heads):
    """(match, body) for each head: the body runs to the first `}` in column 0 after it."""
    for m in heads.finditer(text):
        end = TOP_LEVEL_END.search(text, m.end())
        yield m, text[m.end():end.end() if end else len(text)]


def helpers_starting_ranks(text):
    bodies = {m.group(1): body for m, body in blocks(text, FUNCTION_HEAD)
              if m.group(1) not in ("TEST", "TEST_P", "TEST_F", "LVX_WORKER")}
    found = {name for name, body in bodies.items() if STARTS_RANKS.search(body)}
    while True:  # helpers of helpers, to a fixpoint
        calls = re.compile(r"\b(?:%s)\s*\(" % "|".join(map(re.escape, found))) if found else None
        more = {n for n, b in bodies.items() if n not in found and calls and calls.search(b)}
        if not more:
            return found
        found |= more


def multirank_tests(paths):
    names = []
    for path in paths:
        text = open(path, encoding="utf-8").read()
        helpers = helpers_starting_ranks(text)
        calls = re.compile(r"\b(?:%s)\s*\(" % "|".join(map(re.escape, helpers))) if helpers else None
        for m, body in blocks(text, TEST_HEAD):
            if STARTS_RANKS.search(body) or (calls and calls.search(body)):
                names.append("%s.%s" % (m.group(1), m.group(2)))
    return names


if __name__ == "__main__":
    found = multirank_tests(sys.argv[1:])
    print(":".join("*%s*" % n for n in found) if found else "-")
