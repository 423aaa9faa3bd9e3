"""Serving throughput at a fixed KV memory budget: the paged engine (with and without token-level
policies) against static batching with `Generator`, on a synthetic workload. The same as
`kvjax serve-bench` (see `kvjax/serve_bench.py` and `kvjax serve-bench --help`):

    python scripts/bench_serving.py MODEL [--requests 32] [--prompt 32 256] [--new 8 128] [--shared-prefix 0]
        [--memory-mib M] [--page-size 16] [--slots 16] [--policy snapkv:0.5 --policy int:8] [--json OUT]
"""

import sys

from kvjax.commands import main

if __name__ == "__main__":
    sys.exit(main(["serve-bench", *sys.argv[1:]]))
