"""Reads a folder of TensorBoard event files with TensorBoard's own loader (EventAccumulator, the
code `tensorboard --logdir` runs) and prints every scalar as JSON: {tag: [[step, value], ...]}.

  tensorboard_ref.py read DIR
"""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main():
    if len(sys.argv) != 3 or sys.argv[1] != "read":
        sys.exit("usage: tensorboard_ref.py read DIR")
    acc = EventAccumulator(sys.argv[2], size_guidance={"scalars": 0})
    acc.Reload()
    out = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
