"""Pipelines across nodes: one schedule cut into chunks that run in flight together.

One schedule runs its steps in turn, and the link to another node idles
while a rank reduces, copies or (hierarchical) works inside its node.  A
*pipeline* cuts a large call into chunks, each the same algorithm's schedule
for its part of the call, and interleaves their steps so that while one
chunk's data is reduced the next chunks' messages are already posted and
crossing the link.  It is a transform of schedules: the result is one
schedule, run by the executor as any other (its chunks named: Schedule.parts).

The cut
    AllReduce: the array (chunk c: elements ``n*c//k .. n*(c+1)//k``).
    ReduceScatter and AllGather: every rank's block alike (chunk c: part c of
    each block, at its place in the input or output), so each chunk is an
    ordinary vector call on the same buffers.  A ReduceScatter of :data:`SPAN`
    (a schedule that all-reduces the input's span, from 0 to the last block's
    end, then keeps this rank's block) cuts the span instead: each chunk is an
    AllReduce into one work buffer, and this rank's block is copied out of it
    at the end.  Each chunk is a schedule of the same algorithm, so results
    are bitwise what that algorithm gives, equal on every rank.

The chunks in flight
    The chunks' ops lie one chunk after the other in the schedule, each
    chunk's messages on a tag of its own (``Send.chunk``: a chunk's messages
    match in issue order, whatever the other chunks do), and the schedule
    names them (``Schedule.parts``).  The executor advances the first
    :data:`PIPELINE_DEPTH` unfinished chunks together: each runs until a
    ``Wait`` whose messages are not complete, and only when none can move does
    the operation block, on its oldest chunk's wait.  So while one chunk's
    data is reduced, the next chunks' messages are already posted and crossing
    the link, and no order in which ranks finish their chunks can hang (every
    rank blocks only on its oldest unfinished chunk, after posting all it can
    of the others).  A chunk's work buffers are named by its slot, ``c %
    PIPELINE_DEPTH``: chunk c opens only once chunk c - PIPELINE_DEPTH has
    ended, so work memory is :data:`PIPELINE_DEPTH` chunks' worth.

The sizes are the emulated cluster's best (docs/cluster.md, "Measuring on it"):
deeper or finer gained nothing there, 2 in flight lost at 16 MiB.
"""

from __future__ import annotations

from .schedule import DST, SRC, Copy, Recv, Reduce, Region, Schedule, Send, Wait

# A blocking collective across nodes from this size runs as a pipeline of chunks:
# PIPELINE_CHUNKS of at least PIPELINE_CHUNK_BYTES, PIPELINE_DEPTH open at a time
PIPELINE_BYTES = 2 << 20
PIPELINE_CHUNKS = 32
PIPELINE_CHUNK_BYTES = 512 << 10
PIPELINE_DEPTH = 4
# ReduceScatter schedules that all-reduce the input's span into a work array and copy
# this rank's block out: as chunks of its blocks each chunk would move the whole span
# (32x the bytes), so the pipeline cuts the span, each chunk an AllReduce
SPAN = frozenset({("reduce_scatter", "recursive_doubling")})


def applies(collective: str, name: str, shape, nbytes: int) -> bool:
    """Whether a blocking call of algorithm ``name`` with ``shape`` moving ``nbytes`` runs as
    a pipeline: across nodes, from :data:`PIPELINE_BYTES`, every algorithm but the ring
    (which pipelines its own segments) and the shared algorithms (one region of node
    memory per call), not a ReduceScatter in place (its result overwrites
    the start of the input, part c of block 0, which another chunk still reads), and
    blocks of at least two elements."""
    return (name != "ring" and not shape.shared and nbytes >= PIPELINE_BYTES
            and len(set(shape.nodes)) > 1
            and not (shape.in_place and collective == "reduce_scatter")
            and (collective == "allreduce" or min(shape.counts) >= 2))


def chunks_of(collective: str, name: str, shape, nbytes: int) -> int:
    """How many chunks a pipeline of this call has."""
    chunks = max(2, min(PIPELINE_CHUNKS, nbytes // PIPELINE_CHUNK_BYTES))
    if (collective, name) in SPAN:
        return min(chunks, _span(shape))
    if collective != "allreduce":
        return min(chunks, min(shape.counts))
    return min(chunks, shape.total)


def _span(shape) -> int:
    return max(d + k for d, k in zip(shape.displs, shape.counts))


def builder(collective: str, name: str, build, chunks: int, build_allreduce=None):
    """``build(shape) -> Schedule`` of the pipeline of ``chunks`` chunks of algorithm
    ``build`` (``build_allreduce``: the same algorithm's AllReduce builder, for :data:`SPAN`)."""
    span = (collective, name) in SPAN

    def pipelined(shape) -> Schedule:
        parts = [_chunk(collective, shape, build, build_allreduce, span, chunks, c)
                 for c in range(chunks)]
        tail = ()
        if span:  # this rank's block of the reduced span, the call's result
            r = shape.rank
            lo = shape.displs[r]
            tail = (Copy(Region(DST, 0, shape.counts[r]),
                         Region(_SPAN_BUF, lo, lo + shape.counts[r])),)
        sched = interleave(parts, PIPELINE_DEPTH, tail)
        if span:
            sched.work[_SPAN_BUF] = _span(shape)
        return sched

    return pipelined


_SPAN_BUF = "reduced span"


def _chunk(collective, shape, build, build_allreduce, span, chunks, c):
    """(chunk c's schedule, {buffer: (name in the pipeline, offset)}) of the pipeline."""
    if span:
        total = _span(shape)
        a, b = total * c // chunks, total * (c + 1) // chunks
        part = shape._replace(total=b - a, counts=(b - a,), displs=(0,), in_place=False)
        return build_allreduce(part), {SRC: (SRC, a), DST: (_SPAN_BUF, a)}
    if collective == "allreduce":
        n = shape.total
        a, b = n * c // chunks, n * (c + 1) // chunks
        part = shape._replace(total=b - a, counts=(b - a,), displs=(0,))
        return build(part), {SRC: (SRC, a), DST: (DST, a)}
    # chunk c of block r: elements counts[r]*c//chunks .. counts[r]*(c+1)//chunks of it
    lo = [k * c // chunks for k in shape.counts]
    cc = tuple(k * (c + 1) // chunks - x for k, x in zip(shape.counts, lo))
    cd = tuple(d + x for d, x in zip(shape.displs, lo))
    part = shape._replace(total=sum(cc), counts=cc, displs=cd)
    mine = lo[shape.rank]
    if collective == "reduce_scatter":  # (out of place: see applies)
        return build(part), {SRC: (SRC, 0), DST: (DST, mine)}
    # AllGather: SRC is this rank's block (out of place), DST the whole output
    return build(part), {SRC: (SRC, 0 if shape.in_place else mine), DST: (DST, 0)}


def interleave(parts, depth: int, tail=()) -> Schedule:
    """One schedule of ``parts`` ((schedule, {buffer: (name, offset)}) per chunk, in order):
    chunk c's ops at their place, its messages tagged as chunk c, its work buffers in
    slot ``c % depth``; ``Schedule.parts`` names each chunk's ops (the executor advances
    ``depth`` of them together).  ``tail``: ops after every chunk ended."""
    ops, work, types, bounds = [], {}, {}, []
    nsteps = max((s.nsteps for s, _ in parts), default=0)
    for c, (sched, places) in enumerate(parts):
        places = dict(places)
        for purpose, n in sched.work.items():
            name = f"{purpose} [{c % depth}]"
            places[purpose] = (name, 0)
            work[name] = max(work.get(name, 0), n)
            if purpose in sched.types:
                types[name] = sched.types[purpose]
        first = len(ops)
        index = {}
        for i, op in enumerate(sched.ops):
            index[i] = len(ops)
            ops.append(_moved(op, places, c, index))
        bounds.append((first, len(ops)))
    ops.extend(tail)
    return Schedule(tuple(ops), work, nsteps, types, parts=tuple(bounds), depth=depth)


def _region(r: Region, places) -> Region:
    name, off = places[r.buf]
    return Region(name, r.start + off, r.stop + off)


def _moved(op, places, chunk, index):
    """``op`` of chunk ``chunk`` with its regions at their place in the pipeline, its
    messages tagged as that chunk's, its waits on the pipeline's indices."""
    t = type(op)
    if t is Send or t is Recv:
        return t(op.peer, _region(op.region, places), op.label, chunk)
    if t is Wait:
        return Wait(tuple(index[h] for h in op.handles))
    if t is Reduce:
        return Reduce(_region(op.a, places), _region(op.b, places), _region(op.out, places))
    return Copy(_region(op.dst, places), _region(op.src, places))
