"""Time ``meshtorch plan --search`` (the layout search of :func:`meshtorch.runtime.plan_lm.plan_lm`) and write
its ranking, to compare two source trees (e.g. before/after a planner change) on the same host.

    PYTHONPATH=src python benchmarks/plan_search.py --preset base --mesh data:2,model:2,expert:2 \
        --repeats 3 --ranking /tmp/ranking.json

Prints one line per repeat (seconds of the search alone, the model built outside the timer) and writes the
ranked ``[layout, storage, pipeline, estimated seconds, total bytes]`` rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

from meshtorch.models.transformer import preset
from meshtorch.planning.cost import CostModel
from meshtorch.runtime.plan_lm import plan_lm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="base")
    ap.add_argument("--mesh", default="data:2,model:2,expert:2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranking", default=None, help="write the ranking as JSON here")
    args = ap.parse_args()
    ranked = None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ranked = plan_lm(lambda m: preset(args.preset, vocab_multiple=m), args.mesh, search=True,
                         cost=CostModel.cpu(), print_fn=lambda *a: None)
        print(f"search_s {time.perf_counter() - t0:.3f} layouts {len(ranked)}", flush=True)
    if args.ranking:
        rows = [[lay, r.storage, r.pipeline.describe() if r.pipeline else None, r.estimated_time["total_s"],
                 r.total_bytes] for lay, r in ranked]
        with open(args.ranking, "w") as f:
            json.dump(rows, f, indent=0)


if __name__ == "__main__":
    main()
