"""Offload policies: a YAML file (or a mapping) read, checked and turned once into frozen
dataclasses (config.py), through a schema (schema.py) of single values (values.py); a DeepSpeed
config is translated into the same (deepspeed.py, deepspeed_keys.py)."""
