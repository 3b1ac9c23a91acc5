"""Typed configuration: pydantic models loaded from YAML with ``key.sub=value`` overrides.

Every problem (unknown key, wrong type, out-of-range value) is reported before any work starts, as one
line that names the key and, for unknown keys, suggests the closest valid one. Each field carries its description,
range and choices, which ``flowrl config schema`` (JSON Schema, for editors) and ``flowrl config explain KEY`` print.
"""
from .base import SAMPLE_SEED_MAX, SEED_MAX, Section, check_seeds, iteration_seed, opt  # noqa: F401
from .loading import apply_override, load_config, parse_override, resolved, save_config, to_dict, validate  # noqa: F401
from .reference import explain, json_schema, method_defaults, reference_fields, reference_markdown  # noqa: F401
from .sections import (  # noqa: F401
                       AdvantageConfig,
                       AlgorithmOptions,
                       Config,
                       ContextParallelConfig,
                       DataConfig,
                       EmaConfig,
                       FSDPConfig,
                       GuardConfig,
                       LogConfig,
                       LoraConfig,
                       ModelConfig,
                       PoolConfig,
                       RewardSpec,
                       SamplerConfig,
                       TinyModelConfig,
                       TrainConfig,
                       build_algorithm,
)
