"""Library internals, fenced: zeroexp's shims over torch's and Lightning's own machinery -- MemTracker as zeroexp
uses it (:mod:`.memtrack`), a dry run's functional collectives on the fake group (:mod:`.fake_collectives`), and a
class made a Lightning callback where it runs (:mod:`.callbacks`). Nothing of zeroexp is imported here."""
