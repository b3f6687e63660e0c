"""Asynchronous Orbax checkpoints in two tiers (MegaScale's two-stage save).

  fast tier        frequent, few kept, on local disk or /dev/shm: a restart
                   after a process crash loses at most `fast_every` steps
  persistent tier  less frequent, more kept, any path Orbax supports: survives
                   the loss of the machine

Each checkpoint holds three items: `state` (params + LAMB state + step, the
layout every mesh shares), `data` (the data iterator's state, JSON) and
`meta` (the resolved config and the step, JSON). Saves are asynchronous: the
step returns as soon as the arrays are copied off the devices, and Orbax
writes in a background thread. Orbax writes into a temporary directory and
renames it when complete, so a crash or `kill -9` mid-save leaves the previous
checkpoints untouched and the partial one is ignored (and cleaned up at the
next start).

Restore takes the newest step across both tiers; a checkpoint that fails to
read (truncated, corrupted, missing files) is reported and skipped, and the
next older one is used; once that one is read, the failed one is moved aside
(`damaged-<step>-<time>`), so that it takes no slot of the steps kept.

Single-replica restore (MegaScale's): params and LAMB moments are replicated
over the `data` mesh axis, so when the data-parallel replicas live in
different processes, one replica (data index 0) reads the state and a
collective sends it to the others; a restart reads the state's bytes once
instead of once per replica (192 times for a 175B layout with data = 192).
It applies when every array of the state is replicated over `data` (size
> 1) and no process holds devices of two replicas; otherwise, or with
`CheckpointConfig.single_replica_restore = False`, every process reads the
shards its devices hold, as Orbax does by default. Both paths give the same
bits (tests/test_multihost.py; figures from bench/restore_bench.py).

In a multi-process job every process must restore the same step, or they
hang in their first collective: each one lists what it sees, only steps
every process sees are candidates, and a failed read in any process moves
all of them to the next one (agreed through the coordination service,
mjax/distributed.py, before any collective runs).

Who sees a tier (`CheckpointConfig.fast_scope` for the fast tier; the
persistent tier is always shared):
  shared  one directory every process sees at the same path: Orbax's
          process 0 commits a save only once every process has written its
          shards there. The default fast tier, /dev/shm, is shared by the
          processes of one machine but not across machines, so at start-up
          process 0 leaves a probe file in each shared tier, and a tier some
          process cannot see it in is a configuration error (exit 2) naming
          the tier and the processes.
  host    (MegaScale's first save stage: device -> host memory, for
          multi-host jobs without a shared filesystem.) Each process writes
          the shards it holds, and the data position and checksums, to its
          own directory, <fast_directory>/process-<i>, committed by itself.
          Such a step is a restore candidate only when every process has its
          copy of it, saved by the same layout (process count, mesh, the
          blocks each process holds) with the same checksums; otherwise the
          persistent tier (or an older step) is used. Before each such save
          the processes meet at a barrier, which tells each that every copy
          of the earlier steps is committed; only then does it drop its
          copies beyond `fast_keep`, so a save cut off in any process leaves
          an older step that every process still has. After a restore, each
          process drops its copies newer than the step restored: they belong
          to a timeline the job left. Offline tools (mjax-report, mjax-eval)
          see none of these steps: one process's copy is not a checkpoint.

Resume semantics (decided in `resume`, and nowhere else):
  1. the workdir has a readable checkpoint in either tier: resume from the
     newest one (the usual restart after a fault or pre-emption);
  2. else `CheckpointConfig.restore_from` names a checkpoint: start from its
     train state (and data position, unless `restore_data` is False);
  3. else initialize from `TrainConfig.seed`.

The package, by concern:
  checkpointer  the Checkpointer (saves, restore with fallback, the host-local
                tier) and `resume`, the resume policy
  directories   where a run's checkpoints live, which steps are complete, and
                whose they are (claims, run ids)
  guards        what a start checks before it writes anything
  locks         one run at a time in a workdir and its tiers
  integrity     per-array checksums, and `verify_step` for offline checks
  replica       single-replica restore
  failures      a full disk, a failed save or a damaged read, said once
"""

from mjax.checkpoint.checkpointer import (CheckpointNotFound, Checkpointer, NoUsableCheckpoint, Restored, resume,
                                          restore_from_path)

__all__ = ['CheckpointNotFound', 'Checkpointer', 'NoUsableCheckpoint', 'Restored', 'resume', 'restore_from_path']
