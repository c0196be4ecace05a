"""TrainConfig, cut by job: the schema (schema.py: every knob, typed, validated and documented once), its TOML and
alias I/O (files.py, where TrainConfig gets its TOML methods), checks of the world outside it (world.py), the CLI
flags generated from it (flags.py) and the config a run resolves to (resolve.py). Import from here; never imports
torch or gradio (the UI reads it)."""
from __future__ import annotations

from .files import TrainConfig, alias_table, build_config, read_toml, resolve_aliases
from .flags import add_config_arguments, config_from_args
from .network_rates import TOY_DEMO_RATES
from .resolve import resolve
from .schema import (AUTO_SPLIT_MIN_IMAGES, AUTO_VALIDATION_SPLIT, GROUPS, PATH_KNOBS, SCHEDULERS, ConfigError,
                     TrainConfigSchema, knob)
from .world import (PICKLE_SUFFIXES, check_inputs, output_inside_dataset, output_inside_reg_dir,
                    safetensors_problem)

__all__ = ["AUTO_SPLIT_MIN_IMAGES", "AUTO_VALIDATION_SPLIT", "ConfigError", "GROUPS", "PATH_KNOBS", "PICKLE_SUFFIXES",
           "SCHEDULERS", "TOY_DEMO_RATES", "TrainConfig", "TrainConfigSchema", "add_config_arguments", "alias_table",
           "build_config", "check_inputs", "config_from_args", "knob", "output_inside_dataset", "output_inside_reg_dir",
           "read_toml", "resolve", "resolve_aliases", "safetensors_problem"]
