"""Memory accounting of the backward-cost measurement (`tools/backward_cost.py`, issue 33 item 1).

The issue's bound is "peak RSS <= 2x (weights + their gradients + activations)". Its terms, as measured here:

- weights: the layer's checkpoint bytes; their gradients: the same bytes again (one gradient per weight, in the
  weight's dtype, as torch's autograd gives them);
- activations: the bytes torch autograd saves for the backward of the same layer on the same input, in the twin
  (`saved_activation_bytes`): every distinct storage packed by `torch.autograd.graph.saved_tensors_hooks` during
  the forward and still held by the graph when it returns, less the storages of the layer's parameters (weights are
  counted above; a saved view of a weight, e.g. `w.t()` in `linear`, shares its storage). The layer's input counts
  when autograd saves it. This is an
  independent measure (the eager framework's own need between forward and backward, not the JAX side's); a weight
  copy the twin computes in another dtype and saves counts as an activation, as autograd must keep it.

torch and jax are imported lazily (the module imports without either).
"""

from __future__ import annotations

import os
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

GB = 2**30


def distinct_storage_bytes(records: Iterable[tuple[int, int]], exclude: Iterable[int] = ()) -> int:
    """Sum of nbytes over distinct storage pointers in `records` ((data_ptr, nbytes) pairs), less those in
    `exclude`. A storage saved twice (x * x saves x twice) or through several views is held once."""
    skip = set(exclude)
    seen: dict[int, int] = {}
    for ptr, nbytes in records:
        if ptr not in skip:
            seen[ptr] = max(seen.get(ptr, 0), nbytes)
    return sum(seen.values())


@contextmanager
def saved_tensor_log() -> Iterator[list[tuple[Any, int, int]]]:
    """Within the block, every tensor autograd saves for backward is logged as (weak reference, storage data_ptr,
    storage nbytes). No strong reference is kept, so the log does not extend any tensor's life; the backward unpacks
    the same data."""
    import torch

    log: list[tuple[Any, int, int]] = []

    def pack(t):
        # A detached alias (same storage, no grad_fn): the graph holds it alone, so its weak reference dies with the
        # graph, and an output saved by its own grad_fn makes no reference cycle
        a = t.detach()
        s = a.untyped_storage()
        log.append((weakref.ref(a), s.data_ptr(), s.nbytes()))
        return a

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda a: a):
        yield log


def saved_activation_bytes(forward: Callable[[], Any], params: Iterable[Any]) -> tuple[Any, int]:
    """(forward's result, the activation bytes autograd holds for its backward): distinct saved storages still held
    when the forward returns (a branch that does not reach the result frees its graph, and with it what it saved),
    less the storages of `params` (module doc)."""
    with saved_tensor_log() as log:
        out = forward()
    held = [(ptr, nbytes) for ref, ptr, nbytes in log if ref() is not None]
    return out, distinct_storage_bytes(held, (p.untyped_storage().data_ptr() for p in params))


def rss_bound_ratio(peak_bytes: float, weight_bytes: float, activation_bytes: float) -> float:
    """peak / (weights + their gradients + activations): the issue's bound is <= 2."""
    return peak_bytes / (2 * weight_bytes + activation_bytes)


def xla_memory(compiled: Any) -> dict[str, int]:
    """The sizes `compiled.memory_analysis()` reports (bytes; fields it lacks are left out): XLA's temporaries
    (its working memory beside arguments and outputs), arguments, outputs, aliased, generated code."""
    ma = compiled.memory_analysis()
    names = {"temp": "temp_size_in_bytes", "argument": "argument_size_in_bytes", "output": "output_size_in_bytes",
             "alias": "alias_size_in_bytes", "code": "generated_code_size_in_bytes"}
    return {k: int(getattr(ma, v)) for k, v in names.items() if getattr(ma, v, None) is not None}


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples this process's RSS every 5 ms on a thread; `peak()` is the highest seen since the start or the last
    `reset()`; `stop()` ends the thread and returns the peak (bytes). Sampling misses peaks shorter than 5 ms."""

    def __init__(self) -> None:
        self._peak, self._done = rss_bytes(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._done.wait(0.005):
            self._peak = max(self._peak, rss_bytes())

    def peak(self) -> int:
        return max(self._peak, rss_bytes())

    def reset(self) -> None:
        self._peak = rss_bytes()

    def stop(self) -> int:
        self._done.set()
        self._t.join()
        return self.peak()
