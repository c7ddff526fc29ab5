"""Typed configuration: `Config.load(path, overrides)`, then `validate(cfg, world_size)`."""
from verl_mcore.config.loading import ConfigError
from verl_mcore.config.schema import Config
from verl_mcore.config.validate import ModelShape, data_parallel_size, validate

__all__ = ["Config", "ConfigError", "ModelShape", "data_parallel_size", "validate"]
