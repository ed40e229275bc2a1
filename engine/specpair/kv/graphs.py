"""CUDA graphs the engine records itself: a step over static device buffers recorded once and
replayed as one launch (`CapturedGraph`), the fixed step's (`CapturedStep`), and the steps that
read no cache (`StepGraphs`: Medusa's heads)."""

from __future__ import annotations

import gc
import logging
import os
import time

import torch

from specpair.errors import SpecpairError


log = logging.getLogger(__name__)


def cuda_graphs_wanted() -> bool:
    """Whether a compiled fixed step on CUDA replays recorded graphs (`CapturedStep`): yes unless
    SPECPAIR_CUDA_GRAPHS=off, which runs the same compiled layers call by call (a way to tell a
    fault in recording from one in the step)."""
    value = os.environ.get("SPECPAIR_CUDA_GRAPHS", "on")
    if value not in ("on", "off"):
        raise SpecpairError(f"SPECPAIR_CUDA_GRAPHS={value!r}: choose on or off")
    return value == "on"


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on the device in one copy: through pinned memory and without waiting
    on CUDA (the copy is ordered on the stream before the step that reads it), as is elsewhere."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class CapturedGraph:
    """A step over static device buffers recorded once as a CUDA graph: a replay is one launch,
    no dynamo guards, no Python per layer. The outputs are the graph's own buffers, overwritten
    by the next replay: callers copy what they keep. `state`: input buffers the step itself
    updates in place (a drafting head's next token, feature and position): the run before
    recording changes them, so they are put back after it, and the first replay computes what
    that run did (its cache writes are the same writes again)."""

    def __init__(self, device: torch.device, step, state=()):
        saved = [t.clone() for t in state]
        # Run once outside the graph first (compiles the layer for this shape if it has not
        # been, and lets cuBLAS and the allocator set up): capture may not allocate lazily. The
        # run is a real step on these inputs: recording only records, and the replay that
        # follows writes the same keys and values again. Both on a side stream, as capture
        # needs; capture_begin/end directly, not torch.cuda.graph(), whose gc.collect() and
        # empty_cache() per recording cost more than the recording.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        self.graph = torch.cuda.CUDAGraph()
        # No garbage collection while recording: a collection that frees another graph (a
        # released cache's) destroys it mid-capture, which CUDA forbids, and the recording is
        # lost ("operation not permitted when stream is capturing", seen on an H100 with old
        # engines' graphs awaiting collection). torch.cuda.graph() collects before each recording
        # instead, which costs more than the recording.
        collecting = gc.isenabled()
        try:
            with torch.cuda.stream(side):
                step()
                gc.disable()
                # thread_local: the server's other threads may touch CUDA while this one records.
                self.graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.outputs = step()
                finally:
                    self.graph.capture_end()
        finally:          # (a failed recording too: the step then runs uncaptured from them)
            if collecting:
                gc.enable()
            torch.cuda.current_stream(device).wait_stream(side)
            for t, before in zip(state, saved):
                t.copy_(before)

    def replay(self):
        self.graph.replay()
        return self.outputs


class CapturedStep(CapturedGraph):
    """The fixed step recorded once as a CUDA graph at one (rows, tokens) shape over one cache's
    tensors (its capacity is theirs). A call copies the step's ids, positions and slots into the
    graph's own input buffer (one copy from pinned memory) and replays it. A new cache (grown or
    shrunk) gets new graphs (`StaticKVModel._allocate`): recording one costs a few replays. A
    paged cache's `table` is read where it is: the cache updates it in place between replays."""

    def __init__(self, runner: "StaticLlama", host: torch.Tensor, caches, compiled: bool,
                 head: bool = True, table=None):
        device = runner.device
        self.inputs = torch.empty(host.shape, dtype=torch.long, device=device)
        self.inputs.copy_(host)
        self.pinned = torch.empty(host.shape, dtype=torch.long, pin_memory=True)
        self.copied = torch.cuda.Event()
        ids, positions, slots = self.inputs[:3]
        # A fourth plane: the cache row of each step row (a prompt's step, run apart).
        kv_rows = self.inputs[3, :, 0] if host.shape[0] == 4 else None

        def step():
            return runner.fixed_step(ids, positions, slots, caches, compiled=compiled, head=head,
                                     kv_rows=kv_rows, table=table)

        super().__init__(device, step)

    def __call__(self, host: torch.Tensor):
        # Through a pinned buffer of its own (pinning a new tensor every step cost ~30 us); the
        # event keeps the next call from overwriting it before this copy has left.
        self.copied.synchronize()           # at once when never recorded
        self.pinned.copy_(host)
        self.inputs.copy_(self.pinned, non_blocking=True)
        self.copied.record()
        return self.replay()


def capture_graph(owner, step, state=()) -> CapturedGraph | None:
    """`step`, a function of device buffers, recorded as a CUDA graph (CapturedGraph, `state` as
    there) where `owner` records graphs (its `captures_graphs`, on its `device`); None where it
    does not, or where recording fails: reported once in the owner's `capture_error`, and its
    steps run uncaptured from then on. The owner's `recorded` counts graphs and seconds."""
    if not (owner.captures_graphs and owner.capture_error is None):
        return None
    started = time.perf_counter()
    try:
        graph = CapturedGraph(owner.device, step, state)
    except Exception as exc:     # noqa: BLE001 - any capture failure: run uncaptured
        owner.capture_error = f"{type(exc).__name__}: {exc}"
        log.warning("CUDA graph capture failed, the step runs uncaptured: %s", owner.capture_error)
        return None
    owner.recorded["graphs"] += 1
    owner.recorded["seconds"] += time.perf_counter() - started
    return graph


class StepGraphs:
    """Steps kept by key with the CUDA graphs recorded of them (`capture_graph`), for steps that
    read no cache (Medusa's heads): one per model, shared by every batch that runs it."""

    def __init__(self, device: torch.device, captures_graphs: bool):
        self.device, self.captures_graphs = device, captures_graphs
        self.capture_error: str | None = None
        self.recorded = {"graphs": 0, "seconds": 0.0}
        self.steps: dict = {}

    def capture(self, step, state=()) -> CapturedGraph | None:
        return capture_graph(self, step, state)
