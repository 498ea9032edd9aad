"""A stress-test worker: reserve random shares of a simulated device, hold briefly, release.

Run as a script (not collected by pytest):
    python share_worker.py INDEX COUNT SEED START_AT OUT CAPACITY WAIT

Each grant is written to OUT as a JSON line with this process's own CLOCK_MONOTONIC times taken
after `reserve` returned and before `release` was called, so the test can check capacity from
the workers' side too, independently of the ledger's journal.
"""

import json
import random
import sys
import time

import jaxmem
from jaxmem.units import MiB


def main() -> int:
    index, count, seed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    start_at, out, capacity, wait = float(sys.argv[4]), sys.argv[5], sys.argv[6], float(sys.argv[7])
    rng = random.Random(seed)
    total = jaxmem.parse_size(capacity)
    while time.time() < start_at:  # all workers start together, so they really race
        time.sleep(0.001)
    with open(out, "w") as f:
        for i in range(count):
            nbytes = rng.randint(64, total // MiB // 2) * MiB
            r = jaxmem.reserve(nbytes, capacity=capacity, wait=wait, label=f"w{index}-{i}")
            t0 = time.monotonic()
            time.sleep(rng.uniform(0, 0.003))
            t1 = time.monotonic()
            r.release()
            f.write(json.dumps({"worker": index, "id": r.id, "ticket": r.ticket, "bytes": nbytes, "t0": t0, "t1": t1}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
