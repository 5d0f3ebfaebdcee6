"""What a backward will reach, read from the forward's outputs: every tensor inside
an output (:func:`find_tensors`) and the parameters the autograd graph leads to
from them (:func:`reachable_parameters`), for ``find_unused_parameters``."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import torch


def find_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (tensors, lists, tuples, dicts, dataclasses, nested)."""
    found: list[torch.Tensor] = []
    stack = [obj]
    seen: set[int] = set()
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif id(o) in seen:
            continue
        elif isinstance(o, (list, tuple, set, frozenset)):
            seen.add(id(o))
            stack.extend(o)
        elif isinstance(o, dict):
            seen.add(id(o))
            stack.extend(o.values())
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            seen.add(id(o))
            stack.extend(getattr(o, f.name) for f in dataclasses.fields(o))
    return found


def reachable_parameters(outputs: Iterable[torch.Tensor],
                         params: Sequence[torch.Tensor]) -> set[int]:
    """Indices of ``params`` that a backward from ``outputs`` can give a gradient.

    Walks the autograd graph from the outputs' ``grad_fn`` through
    ``next_functions``; a parameter is reached when its ``AccumulateGrad`` node is
    (that node's ``variable`` is the parameter itself). An output that *is* a
    parameter counts too.
    """
    index = {id(p): i for i, p in enumerate(params)}
    reached: set[int] = set()
    stack = []
    for t in outputs:
        if not t.requires_grad:
            continue
        if t.grad_fn is None:
            if id(t) in index:
                reached.add(index[id(t)])
        else:
            stack.append(t.grad_fn)
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in index:
            reached.add(index[id(variable)])
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return reached
