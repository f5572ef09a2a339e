"""Reading a policy file: its raw mapping, or a PolicyError naming the file and what is wrong.

Kept apart from policy.py, which turns that mapping into typed dataclasses.
"""
from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

from .errors import PolicyError

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping.

    PyYAML keeps the last value silently, so ``params: {tier: dram}`` followed later in the file
    by ``params: {tier: hbm}`` would quietly mean hbm. Keys a ``<<`` merge brings in may still be
    overridden: that is what the merge is for.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, MappingNode):
            first_lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, Hashable):
                    continue  # SafeLoader itself refuses an unhashable key
                if key in first_lines:
                    raise ConstructorError(None, None, f"the key {key!r} is given twice (first "
                                           f"at line {first_lines[key]})", key_node.start_mark)
                first_lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """The raw mapping of a policy file, or a PolicyError naming the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise PolicyError(f"policy file {path} does not exist") from None
    except UnicodeDecodeError as e:
        # A binary or non-UTF-8 file used to escape as a bare UnicodeDecodeError traceback.
        raise PolicyError(f"policy file {path}: not UTF-8 text (byte {e.start}: "
                          f"{e.reason})") from None
    except OSError as e:
        raise PolicyError(f"policy file {path} cannot be read: {e.strerror}") from None
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e)
        raise PolicyError(f"policy file {path}: malformed YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PolicyError(f"policy file {path}: the top level must be a mapping of keys "
                          f"(compute_dtype, params, ...), got {type(data).__name__}")
    return data
