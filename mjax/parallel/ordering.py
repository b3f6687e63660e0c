"""Collectives in one order on every device, for XLA's CPU runtime.

XLA:CPU runs a program's independent operations concurrently, on one
thread pool that all of a process's devices share, and each in-process
collective holds its thread until every participant has arrived. Two ops
that hold collectives and do not depend on each other (a 1F1B tick's
backward and forward, each with its tensor-parallel gathers, and the
stage shifts) can then start in different orders on different devices.
Once every pool thread waits in a collective whose last participant sits
queued behind them, the step deadlocks, and after 40 s XLA aborts the
process ("Termination timeout for `collective permute` ... Exiting to
ensure a consistent program state"). Under load this happened in about one
step in five for 1F1B with accumulation slices and FSDP gathered once a
step, on 8 host devices.

`after(x, dep)` gives `x` a data dependency on `dep`, which XLA can neither
fold nor reorder, so that the ops reading `x` start after the op that made
`dep` has finished, on every device. It costs one scalar read and a fused
add of zero. Programs for GPUs do not take it: there every device runs its
collectives in the one order of the compiled schedule, and a dependency
would keep the scheduler from overlapping a transfer with computation.
"""

import jax
import jax.numpy as jnp


def after(x, dep):
  """`x`, unchanged in value, computed after `dep`'s first element.

  Adds zero made from that element: `d * 0`, or 0 where `d` is not finite
  (inf * 0 would be NaN). XLA does not fold `d * 0` for floating point,
  since it is NaN for NaN `d`, so the dependency stays in the program."""
  d = jax.tree.leaves(dep)[0].reshape(-1)[0].astype(jnp.float32)
  zero = jnp.where(jnp.isfinite(d), d * 0, 0)
  return jax.tree.map(lambda a: a + zero.astype(a.dtype), x)
