"""ckv: controlled pretraining and analysis of phase sensitivity from chunked KV-cache compression."""

from ckv.cache import KVCache
from ckv.config import AttentionConfig, ConfigError, ModelConfig
from ckv.model import Transformer

__all__ = ["AttentionConfig", "ConfigError", "KVCache", "ModelConfig", "Transformer"]
__version__ = "0.1.0"
