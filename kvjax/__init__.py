"""kvjax: a JAX research framework for KV-cache-efficient language models."""

from kvjax.cache import KVCache, RingKVCache
from kvjax.compress import Policy, parse_policy
from kvjax.config import Config, ConfigError, DecodingConfig, ModelConfig, load_config
from kvjax.engine import Engine, Request
from kvjax.generate import GenerationResult, Generator, generate
from kvjax.ops import attention
from kvjax.plan import init_caches

__all__ = [
    "Config",
    "ConfigError",
    "DecodingConfig",
    "Engine",
    "GenerationResult",
    "Generator",
    "KVCache",
    "ModelConfig",
    "Policy",
    "Request",
    "RingKVCache",
    "attention",
    "generate",
    "init_caches",
    "load_config",
    "parse_policy",
]
