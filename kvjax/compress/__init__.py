"""Token-level KV cache compression as pure functions over caches: scorers, allocators, reducers and
policies (see `kvjax.compress.policy` for the policy syntax and the budget convention)."""

from kvjax.compress.apply import (
    check_policy,
    compress_caches,
    compressed_cache_bytes,
    compressible,
    needs_calibration,
    plan_stages,
    prepare_policy,
)
from kvjax.compress.policy import Policy, Stage, parse_policy

__all__ = [
    "Policy",
    "Stage",
    "check_policy",
    "compress_caches",
    "compressed_cache_bytes",
    "compressible",
    "needs_calibration",
    "parse_policy",
    "plan_stages",
    "prepare_policy",
]
