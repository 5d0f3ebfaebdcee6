"""A timeline of what ringcomm and ``ddp/`` do, per rank, in Chrome's trace
format (opens in https://ui.perfetto.dev and chrome://tracing).

Turn it on for a whole run with ``RINGCOMM_TRACE=run.json`` (each rank writes
``run.rank<r>.json`` at exit), or for part of a run::

    with ringcomm.trace.recording("step.json"):      # every rank alike
        train_one_step()

then merge the ranks' files into one, one process per rank, clocks aligned::

    python -m ringcomm.trace merge run.json run.rank*.json

What is recorded: each collective's enqueue (an instant on the caller's thread)
and its run from start to end (on the thread that ran it: the caller's or the
group's progress thread), with its algorithm, the bytes of its tensors, its
peers, its group and its number; each step of a schedule as it retires; from
``ddp/``: backward, each bucket's ready, launch, wait and copy-back, and the
optimizer step. While a ``torch.profiler`` session runs, the same spans are also
``record_function`` ranges, so they appear next to torch's own ops.

Off, every hook is one test of a module flag.
"""
from ringcomm.trace.merging import main, merge
from ringcomm.trace.recorder import (Recorder, active, annotate, complete, instant, now,
                                     rank_path, recording, span, start,
                                     start_from_environment, stop)

__all__ = ["Recorder", "active", "annotate", "complete", "instant", "merge", "main", "now",
           "rank_path", "recording", "span", "start", "start_from_environment", "stop"]
