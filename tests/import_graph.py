"""What the engine's and the operator's layout tests share about an import graph (module -> the
modules it imports): a module's dotted name from its file, and the circles in a graph."""

from __future__ import annotations

from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """`root`/a/b/c.py -> a.b.c; a package's __init__.py -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each module that lies on one, as the path that closes it."""
    found, on_circle = [], set()
    for start in sorted(graph):
        if start in on_circle:
            continue
        # Depth-first from start, looking for a way back to it.
        stack, seen = [(start, [start])], {start}
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    found.append(path + [start])
                    on_circle.update(path)
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found
