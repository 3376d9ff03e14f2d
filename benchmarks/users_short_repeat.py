"""The users suite's short group (B * N = 16k, N = 512, fwd+bwd, D 64 / 128 / 256, causal and not, against cuDNN
SDPA) three times in one process, each as `flashtriton bench --suite users` runs it (device timer: eager calls after
an L2 flush, 3 rounds): issue 35's "3 runs out of 3" for short N.

    PYTHONPATH=src python benchmarks/users_short_repeat.py    # on a GPU machine; writes $OUT/users_short_repeat.json
"""

import json
import os

import torch

from flashtriton.bench import users
from flashtriton.bench.users_calls import attach_users_ratios, run_user_case

RUNS, ROUNDS = 3, 3


def main() -> None:
    device = torch.device("cuda")
    cases = [c for c in users.gpu_cases() if c.group == "short"]
    runs = []
    for run in range(RUNS):
        results = []
        for case in cases:
            results += run_user_case(case, list(case.providers), device, ROUNDS)
        attach_users_ratios(results)
        rows = [
            dict(d=r.case.head_dim, causal=r.case.causal, ms=r.ms, ratios=r.ratios)
            for r in results
            if r.provider == "flashtriton"
        ]
        for row in rows:
            print(run, row, flush=True)
        runs.append(rows)
    with open(os.environ.get("OUT", ".") + "/users_short_repeat.json", "w") as f:
        json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
