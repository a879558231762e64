"""Out-of-bounds loads and stores in Triton's interpreter, caught and explained.

On a GPU a load past the end of a tensor reads whatever lies there (or faults much later); the
interpreter reads host memory just as blindly. Inside :func:`bounds_checked`, every load and
store whose mask lets a lane through must land inside one of the launch's tensor arguments;
otherwise :class:`OutOfBounds` is raised *before* the access, naming the program id, the
argument it strayed from, the element offsets and the lane of the block that did it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from labkit.device import interpreter_on


class OutOfBounds(RuntimeError):
    """A load or store outside every tensor argument of the launch; nothing was accessed."""


@dataclass
class _Extent:
    name: str
    tensor: torch.Tensor
    start: int
    end: int            # one past the last byte any index of the tensor reaches

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "_Extent":
        start = t.data_ptr()
        if t.numel() == 0:
            return cls(name, t, start, start)
        last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        return cls(name, t, start, start + (last + 1) * t.element_size())

    def describe(self, offset: int) -> str:
        """``K[37, 0, 3]``-style position of an element offset (contiguous tensors)."""
        t = self.tensor
        if offset < 0:
            return f"{-offset} element(s) before {self.name}[0]"
        if not t.is_contiguous() or t.dim() == 0:
            return f"element {offset} of {self.name}"
        idx, rest = [], offset
        for st in t.stride():
            idx.append(rest // st if st else 0)
            rest = rest % st if st else rest
        return f"{self.name}[{', '.join(map(str, idx))}]"


def _describe(op: str, program_id, extents, addr: np.ndarray, active: np.ndarray,
              inside: np.ndarray, elsize: int) -> str:
    bad = active & ~inside
    lane = tuple(int(i) for i in np.argwhere(bad)[0])
    bad_addr = addr[bad].astype(np.int64)
    first = int(addr[lane])
    if extents:
        def gap(e):  # bytes from the address to the extent
            return 0 if e.start <= first < e.end else min(abs(first - e.start), abs(first - e.end))
        near = min(extents, key=gap)
        offsets = (bad_addr - near.start) // elsize
        where = (f"{near.name} at element offsets {int(offsets.min())}..{int(offsets.max())} "
                 f"(the first bad lane {'reads' if op == 'load' else 'writes'} "
                 f"{near.describe(int((first - near.start) // elsize))}), "
                 f"but {near.name} holds {near.tensor.numel()} elements "
                 f"(shape {tuple(near.tensor.shape)})")
    else:
        where = "memory that belongs to no tensor argument"
    verb = "loaded from" if op == "load" else "stored to"
    return (f"out-of-bounds {op}: program id {tuple(program_id)} {verb} {where}. "
            f"{int(bad.sum())} of {int(active.sum())} active lanes are outside; the first is lane "
            f"{lane} of the {tuple(addr.shape)} block. Mask this {op} (mask=offsets < length) "
            "or keep the offsets in range.")


@contextlib.contextmanager
def bounds_checked():
    """Check every interpreted load/store against the launch's tensor arguments.

    Yields a dict whose ``"violation"`` holds the last message raised (the interpreter wraps
    the exception; the message survives here). With no interpreter (a GPU) it does nothing and
    yields None.
    """
    if not interpreter_on():
        yield None
        return
    from triton.runtime import interpreter as interp

    builder, state = interp.interpreter_builder, {"extents": [], "violation": None}
    init_args, load, store = (interp.GridExecutor._init_args_hst, builder.create_masked_load,
                              builder.create_masked_store)
    patched = ("create_masked_load", "create_masked_store")
    before = {name: builder.__dict__[name] for name in patched if name in builder.__dict__}

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        named = list(zip(self.arg_names, args_hst)) + list(kwargs_hst.items())
        state["extents"] = [_Extent.of(n, interp._unwrap_tensor(t)) for n, t in named
                            if isinstance(interp._unwrap_tensor(t), torch.Tensor)]
        return args_hst, kwargs_hst

    def check(op, ptrs, mask):
        addr = np.asarray(ptrs.data).astype(np.uint64)
        raw = mask if isinstance(mask, np.ndarray) else mask.data  # block pointers pass arrays
        active = np.broadcast_to(np.asarray(raw, dtype=bool), addr.shape)
        if not active.any():
            return
        elsize = max(ptrs.get_element_ty().primitive_bitwidth // 8, 1)
        inside = np.zeros(addr.shape, dtype=bool)
        for e in state["extents"]:
            inside |= (addr >= e.start) & (addr + elsize <= e.end)
        if (active & ~inside).any():
            msg = _describe(op, builder.grid_idx, state["extents"], addr, active, inside, elsize)
            state["violation"] = msg
            raise OutOfBounds(msg)

    def load_checked(ptrs, mask, other, *rest):
        check("load", ptrs, mask)
        return load(ptrs, mask, other, *rest)

    def store_checked(ptrs, value, mask, *rest):
        check("store", ptrs, mask)
        return store(ptrs, value, mask, *rest)

    interp.GridExecutor._init_args_hst = init_args_checked
    builder.create_masked_load, builder.create_masked_store = load_checked, store_checked
    try:
        yield state
    finally:
        interp.GridExecutor._init_args_hst = init_args
        for name in patched:  # back to what was there: the class's methods, or an outer check
            if name in before:
                setattr(builder, name, before[name])
            else:
                delattr(builder, name)


def find_out_of_bounds(error: BaseException) -> str | None:
    """The OutOfBounds message inside an interpreter error chain, if there is one."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OutOfBounds):
            return str(error)
        error = error.__cause__ or error.__context__
    return None
