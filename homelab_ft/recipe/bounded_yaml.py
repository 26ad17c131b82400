"""YAML reading with bounded aliases, for every file a user hands us (recipes, cluster files). Torch-free.

`yaml.safe_load` builds an alias as a shared reference, so two shapes of user file pass it and
break whatever walks the result: an anchor that contains its own alias (`m: &m {again: *m}`) is a
cyclic object, and deep-copying or validating it gave a ~3,000-line RecursionError; nine levels of
ten aliases each (a "billion laughs" file of ~400 bytes) stand for 10**9 values, and expanding them
hung; and a file nested ~1,000 deep overflowed the stack. The loader here measures the composed
node graph before anything is built from it and refuses all three as a `yaml.MarkedYAMLError`, so
callers' existing "is not valid YAML" line names the file, the line and the problem.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_EXPANDED_NODES = 100_000
"""How many values a file may stand for once its aliases are expanded. The largest shipped recipe
is ~100 values and a cluster file ~30, so 100,000 leaves room for a long `data.sources` list while
an alias bomb (10**9) is refused after counting each distinct node once (milliseconds)."""


MAX_DEPTH = 100
"""How deeply values may nest. A recipe nests 4 deep (data.sources[0].fields); a file nested ~1,000
deep (`[[[[...]]]]`) overflowed Python's stack in PyYAML's composer or in whatever walked it next."""


class YAMLBoundError(yaml.MarkedYAMLError):
    """A recursive alias, one that expands past MAX_EXPANDED_NODES, or nesting past MAX_DEPTH."""


def safe_load(text: str) -> Any:
    """`yaml.safe_load(text)`, refusing recursive anchors and alias bombs (YAMLBoundError) first."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node)
        return loader.construct_document(node)
    except RecursionError:  # the composer recurses per level, before _check_expanded_size sees the nodes
        raise _too_deep(None) from None
    finally:
        loader.dispose()


def _check_expanded_size(root: yaml.Node) -> None:
    """Count the values `root` stands for with every alias expanded, each distinct node's size
    worked out once (memoised by identity), iteratively so deep nesting is no RecursionError."""
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        children = _children(node)
        if children_done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            height[key] = 1 + max((height[id(c)] for c in children), default=0)
            if height[key] > MAX_DEPTH:
                raise _too_deep(node.start_mark)
            if size[key] > MAX_EXPANDED_NODES:
                raise YAMLBoundError(problem=f"its aliases expand to more than {MAX_EXPANDED_NODES:,} values; "
                                         "write the values out instead of nesting aliases", problem_mark=node.start_mark)
            continue
        if key in size:
            continue
        on_path.add(key)
        stack.append((node, True))
        for child in children:
            if id(child) in on_path:
                raise YAMLBoundError(problem="an alias refers to itself (an anchor contains its own alias); "
                                         "write the values out", problem_mark=child.start_mark)
            if id(child) not in size:
                stack.append((child, False))


def _too_deep(mark) -> YAMLBoundError:
    return YAMLBoundError(problem=f"values nest deeper than {MAX_DEPTH} levels; flatten the file", problem_mark=mark)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []
