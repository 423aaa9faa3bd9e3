"""kvjax: a JAX research framework for KV-cache-efficient language models."""

from kvjax.cache import KVCache, RingKVCache, init_caches
from kvjax.compress import Policy, parse_policy
from kvjax.config import Config, ConfigError, DecodingConfig, ModelConfig, load_config
from kvjax.generate import GenerationResult, Generator, generate
from kvjax.ops import attention

__all__ = [
    "Config",
    "ConfigError",
    "DecodingConfig",
    "GenerationResult",
    "Generator",
    "KVCache",
    "ModelConfig",
    "Policy",
    "RingKVCache",
    "attention",
    "generate",
    "init_caches",
    "load_config",
    "parse_policy",
]
