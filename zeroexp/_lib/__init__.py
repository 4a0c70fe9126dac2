"""Library internals, fenced: zeroexp's shims over torch's, Lightning's, Hydra's and DeepSpeed's own machinery --
MemTracker as zeroexp uses it (:mod:`.memtrack`; the step's tracker: :mod:`.step_memtrack`), a dry run's functional
collectives on the fake group (:mod:`.fake_collectives`), a class made a Lightning callback where it runs
(:mod:`.callbacks`), torch's fake tensors (:mod:`.fake_tensors`), FSDP2's parameter chunking and groups (:mod:`.fsdp2`),
the activation checkpoint wrapper (:mod:`.checkpointing`), dispatch modes, op schemas, named process groups and pytrees
(:mod:`.dispatch`), the profiler's state and event tags (:mod:`.profiler`), nn.Module's and FSDP1's private names
(:mod:`.modules`), a storage's identity (:mod:`.storages`), DDP's, ZeroRedundancyOptimizer's and Lightning's hooks
(:mod:`.parallel`), DeepSpeed's optimizer links (:mod:`.deepspeed_internals`), Hydra's app internals
(:mod:`.hydra_internals`) and the Trainer's SIGTERM broadcast (:mod:`.trainer`). A private name of torch, Lightning,
Hydra, DeepSpeed or W&B is used here alone (tests/test_private_names.py, whose NOT_YET_FENCED lists what is not moved
here yet); each shim has its test in tests/test_lib_shims.py. Nothing of zeroexp outside ``_lib`` is imported here."""
