"""Reading a policy file: its raw mapping, or a PolicyError naming the file and what is wrong.

Kept apart from policy.py, which turns that mapping into typed dataclasses.
"""
from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, SequenceNode

from ..core.errors import PolicyError

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping.

    PyYAML keeps the last value silently, so ``params: {tier: dram}`` followed later in the file
    by ``params: {tier: hbm}`` would quietly mean hbm. Keys a ``<<`` merge brings in may still be
    overridden: that is what the merge is for. The whole document is checked before anything
    is built, because building a mapping that merges another copies the merged keys into that
    other node (PyYAML's flatten_mapping), where they would look like its own.
    """

    def construct_document(self, node):
        self._check_unique_keys(node, set())
        return super().construct_document(node)

    def _check_unique_keys(self, node, seen: set[int]) -> None:
        if id(node) in seen:  # an alias: the same node again
            return
        seen.add(id(node))
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
        if isinstance(node, (MappingNode, SequenceNode)):
            for child in node.value:
                for item in child if isinstance(child, tuple) else (child,):
                    self._check_unique_keys(item, seen)


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """The raw mapping of a policy file, or a PolicyError naming the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise PolicyError(f"policy file {path} does not exist") from None
    except UnicodeDecodeError as e:
        # Named here: a bare UnicodeDecodeError would say neither the file nor what it lacks.
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
