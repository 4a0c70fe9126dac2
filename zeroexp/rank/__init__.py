"""One rank of a cell (runs in each forked rank, or in the one process of a dry run): the worker (:mod:`.worker`),
the dry run (:mod:`.dryrun`), micro-batches as whole steps (:mod:`.microbatches`), test-only faults (:mod:`.faults`),
the measured summary's writer (:mod:`.summary`), the parent-death signal (:mod:`.deathsig`) and the progress writer
(:mod:`.progress`). It never imports :mod:`zeroexp.launch`. The forkserver imports modules under here by name, so
this file imports nothing."""
