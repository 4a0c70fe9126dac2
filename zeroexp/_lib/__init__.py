"""Library internals, fenced: zeroexp's shims over torch's and Lightning's own machinery -- MemTracker as zeroexp
uses it (:mod:`.memtrack`), a dry run's functional collectives on the fake group (:mod:`.fake_collectives`), a
class made a Lightning callback where it runs (:mod:`.callbacks`), torch's fake tensors (:mod:`.fake_tensors`),
FSDP2's parameter chunking (:mod:`.fsdp2`) and the Trainer's SIGTERM broadcast (:mod:`.trainer`). A private name of
torch, Lightning, Hydra, DeepSpeed or W&B is used here alone (tests/test_private_names.py, which lists what is not
yet moved here); each shim has its test in tests/test_lib_shims.py. Nothing of zeroexp is imported here."""
