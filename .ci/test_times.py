"""Per-test times of a CTest run, from its JUnit file (ctest --output-junit): the total per label
and the slowest tests, as the tables of docs/development.md show. The labels are CTest's own
(ctest --show-only=json-v1).

    python .ci/test_times.py build            # reads build/ctest-junit.xml
"""
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def test_times(junit):
    root = ET.parse(junit).getroot()
    cases = root.iter("testcase")
    return {c.get("name"): (float(c.get("time") or 0), c.get("status") or "run") for c in cases}


def test_labels(build):
    out = subprocess.run(["ctest", "--test-dir", build, "--show-only=json-v1"], check=True,
                         capture_output=True, text=True).stdout
    labels = {}
    for t in json.loads(out)["tests"]:
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        labels[t["name"]] = props.get("LABELS", [])
    return labels


def main(build="build", slowest=15):
    times = test_times(build + "/ctest-junit.xml")
    labels = test_labels(build)
    per_label = defaultdict(lambda: [0, 0.0])
    for name, (sec, _) in times.items():
        for label in labels.get(name, ["(none)"]):
            per_label[label][0] += 1
            per_label[label][1] += sec
    print("| label | tests | seconds (sum) |\n|---|---|---|")
    for label, (n, sec) in sorted(per_label.items(), key=lambda kv: -kv[1][1]):
        print("| %s | %d | %.0f |" % (label, n, sec))
    print("| all | %d | %.0f |" % (len(times), sum(s for s, _ in times.values())))
    print("\n| slowest tests | seconds |\n|---|---|")
    for name, (sec, _) in sorted(times.items(), key=lambda kv: -kv[1][0])[:slowest]:
        print("| %s | %.1f |" % (name, sec))


if __name__ == "__main__":
    main(*sys.argv[1:2])
