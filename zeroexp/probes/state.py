"""What each rank really holds of parameters, gradients and optimizer state, checked against ZeRO's formulas.

At the optimizer boundary of ``schedule.state_step`` (after the step, once Adam's moments exist) every rank
asks the strategy adapter where its state lives (``ctx.adapter.state_tensors``) and counts those tensors by
kind. A storage is counted once however many tensors view it (FSDP ``use_orig_params`` views, DDP bucket
views). Logical bytes are the elements of the model's real parameters a tensor stands for; physical bytes
are what its storage allocates (FSDP padding included). The aggregate factor of a kind is its logical bytes
summed over ranks divided by P, the logical fp32 bytes of the model's parameters (ZeRO, arXiv:1910.02054,
section 5.1); ``zeroexp.formulas.zero_state_factors`` gives what each stage expects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import pandas as pd

from zeroexp._lib.storages import storage_address
from zeroexp.probes.base import Probe, ProbeReport, RunContext
from zeroexp.results.cells import column
from zeroexp.results.format import NA, byte_unit, fmt_factor, missing
from zeroexp.results.section import CORE_KINDS, Column, ReportTable, joined, raw_rows
from zeroexp.results.verdict import Check, Code, Reason
from zeroexp.cell.schedule import PROBE_STEPS

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["StateProbe", "count_state", "check_factors", "FACTOR_TOL"]

#: Logical factors are ratios of exact integers; the step scalars and the padding are reported apart, so
#: any difference beyond float rounding is a real deviation from the formula.
FACTOR_TOL = 1e-6
COLUMNS = ["rank", "kind", "logical_bytes", "physical_bytes", "host_bytes", "dtype", "device", "numel"]


def count_state(items: Iterable[Any]) -> list[dict[str, Any]]:
    """Bytes per kind of ``(kind, tensor, logical_numel)`` items, one row per kind in first-seen order.

    Physical bytes: each storage (keyed by device and ``untyped_storage().data_ptr()``, or the storage
    itself for a FakeTensor's, which has no data) is counted once,
    under the first kind that reaches it, at its full allocated size. Logical bytes: ``logical_numel x
    itemsize`` of every tensor, except one whose element range lies inside a range of the same storage
    already counted (a view of a tensor that was itself yielded), which would count the same elements twice.
    """
    rows: dict[str, dict[str, Any]] = {}
    storages: set[tuple[str, int]] = set()
    ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for kind, tensor, logical_numel in items:
        row = rows.setdefault(kind, {"kind": kind, "logical_bytes": 0, "physical_bytes": 0, "host_bytes": 0,
                                     "dtype": set(), "device": set(), "numel": 0})
        storage = tensor.untyped_storage()
        # A FakeTensor's storage (zeroexp.rank.dryrun) has no data: data_ptr() is 0 for all of them; its identity is.
        key = (str(tensor.device), storage.data_ptr() or (storage_address(storage) if storage.nbytes() else 0))
        if key not in storages and storage.nbytes() > 0:
            storages.add(key)
            row["physical_bytes"] += storage.nbytes()
            row["host_bytes"] += storage.nbytes() if tensor.device.type == "cpu" else 0  # physical, in host memory
        start = tensor.storage_offset() * tensor.element_size()
        span = (start, start + tensor.numel() * tensor.element_size())
        seen = ranges.setdefault(key, [])
        if tensor.numel() and any(lo <= span[0] and span[1] <= hi for lo, hi in seen):
            continue
        seen.append(span)
        row["logical_bytes"] += int(logical_numel) * tensor.element_size()
        row["numel"] += int(logical_numel)
        row["dtype"].add(str(tensor.dtype).removeprefix("torch."))
        row["device"].add(str(tensor.device))
    return [{**r, "dtype": "+".join(sorted(r["dtype"])), "device": "+".join(sorted(r["device"]))}
            for r in rows.values()]


def check_factors(factors: dict[str, float], expected: dict[str, float], per_kind_bytes: dict[str, int],
                  param_bytes: int, world_size: int, basis: str | None = None, note: str = "") -> list[Reason]:
    """Why the measured factors do not match the expected ones (empty: PASS); each reason names the numbers.
    ``basis``: how the bytes were counted (default ``summed over N ranks``; a dry run's ``= rank 0 x N``); ``note``
    ends each reason."""
    basis = basis or f"summed over {world_size} ranks"
    reasons = []
    for kind, want in expected.items():
        got = factors.get(kind, 0.0)
        if abs(got - want) > FACTOR_TOL:
            reasons.append(Reason(Code.STATE_FACTOR_DIFFERS, f"{kind}: measured factor {got:.6g} "
                                  f"({per_kind_bytes.get(kind, 0)} B {basis} / P = {param_bytes} B), expected {want:g}"
                                  f"{note}"))
    return reasons


def state_check(reasons: list[Reason]) -> dict[str, Any]:
    """The state section's verdict fields, its one writer: FAIL with ``reasons``, else PASS."""
    return Check.failed_if(reasons).fields()


def state_table(ok: pd.DataFrame) -> ReportTable:
    """State factors (logical bytes summed over ranks / P), expected, check, and the largest rank's bytes."""
    expected = [k.removeprefix("state.expected.") for k in ok.columns if k.startswith("state.expected.")]
    extra = [k for k in dict.fromkeys(expected) if k not in CORE_KINDS
             and any(not missing(v) and float(v) != 0 for v in column(ok, f"state.expected.{k}"))]
    kinds = [*CORE_KINDS, *extra]
    raw = raw_rows(ok, [f"state.{f}.{k}" for f in ("factors", "expected", "max_rank_bytes") for k in kinds]
               + ["state.check", "state.padding_bytes", "state.owner_imbalance", "state.logical_param_bytes"])
    has = [not missing(v) for v in raw["state.check"]]
    for key in [f"state.{f}.{k}" for f in ("factors", "max_rank_bytes") for k in kinds]:  # a kind not held is 0
        raw[key] = [0 if h and missing(v) else v for h, v in zip(has, raw[key])]
    raw["expected"] = [joined([raw.at[i, f"state.expected.{k}"] for k in kinds], fmt_factor) for i in raw.index]
    raw["other kinds"] = [_other_kinds(row, kinds) for _, row in ok.iterrows()]
    unit = byte_unit([*(v for k in kinds for v in raw[f"state.max_rank_bytes.{k}"]), *raw["state.padding_bytes"]])
    raw["max-rank"] = [joined([raw.at[i, f"state.max_rank_bytes.{k}"] for k in kinds], unit) for i in raw.index]
    short = "/".join(k[0].upper() if k in CORE_KINDS else k for k in kinds)
    cols = [Column("cell", "label", str),
            *(Column(f"{k} ×P", f"state.factors.{k}", fmt_factor) for k in kinds),
            Column(f"expected {short}", "expected", str),
            Column("other kinds ×P", "other kinds", str), Column("check", "state.check"),
            Column(f"max-rank {short} {unit}", "max-rank", str),
            Column(f"padding {unit}", "state.padding_bytes", unit),
            Column("owner imbalance", "state.owner_imbalance", lambda v: NA if missing(v) else f"{float(v):.3f}")]
    p_values = {fmt_factor(v) for v in raw["state.logical_param_bytes"] if not missing(v)}
    p_text = (f"P = {unit(raw['state.logical_param_bytes'].dropna().iloc[0])} {unit} (logical fp32 parameter "
              "bytes); " if len(p_values) == 1 else "")
    note = (f"{p_text}a factor is a kind's logical bytes summed over all ranks / P, counted at the optimizer "
            "boundary after warm-up (ZeRO, arXiv:1910.02054, section 5.1: stage 0 N/N/2N ... stage 3 1/1/2). "
            f"Max-rank and padding columns are physical bytes in {unit} (2^{20 if unit.name == 'MiB' else 30} "
            "bytes).")
    semantics = {}
    for label, text in zip(raw["label"], column(ok, "state.semantics")):
        if not missing(text):
            semantics.setdefault(str(text), []).append(str(label))
    bullets = [f"{', '.join(labels)}: {text}" for text, labels in semantics.items()]
    return ReportTable("state", "Model state per rank", raw, cols, note, bullets=bullets)


def state_line(s: dict[str, Any]) -> str:
    f = s.get("factors", {})
    core = " / ".join(fmt_factor(f.get(k)) for k in ("param", "grad", "optim"))
    unit = byte_unit(s.get("max_rank_bytes", {}).values())
    per_rank = " / ".join(unit(s.get("max_rank_bytes", {}).get(k)) for k in ("param", "grad", "optim"))
    return f"P/G/O x P (sum over ranks) {core}; largest rank {per_rank} {unit}"


class StateProbe(Probe):
    """Counts the rank-local model state by kind at the optimizer boundary of ``schedule.state_step``."""

    name = "state"
    order = 20
    steps = PROBE_STEPS["state"]  # declared in zeroexp.cell.schedule

    digest_line = staticmethod(state_line)
    report_table = staticmethod(state_table)

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.rows: list[dict[str, Any]] = []
        self.param_numel = self.trained_numel = self.buffer_bytes = 0
        self.loss_scale: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before the strategy wraps the model: the original parameters, each once (tied weights too).
        self.param_numel = sum(p.numel() for p in pl_module.parameters())
        self.trained_numel = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        self.buffer_bytes = sum(b.numel() * b.element_size() for b in pl_module.buffers())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """At ``schedule.state_step``, after its optimizer step: count what the adapter says this rank holds."""
        if batch_idx == self.ctx.schedule.state_step:
            if self.ctx.expect.groups is None:  # the expectation reads the live groups (their frozen, ungraded)
                try:
                    self.ctx.expect.groups = self.ctx.adapter.live_groups(trainer.strategy.model, trainer.optimizers[0])
                except NotImplementedError:
                    pass
            items = self.ctx.adapter.state_tensors(trainer.strategy.model, trainer.optimizers[0])
            self.rows = count_state(items)
            self.loss_scale = self.ctx.adapter.current_loss_scale()

    def rank_result(self) -> dict[str, Any]:
        """Per-kind rows, P, and what the adapter expects and claims (aggregate sees no adapter)."""
        return {
            "rows": self.rows,
            "step": self.ctx.schedule.state_step,
            "logical_param_bytes": 4 * self.param_numel,  # P: numel x 4 (fp32), formulas.py convention
            "trained_param_bytes": 4 * self.trained_numel,  # the parameters that train (requires_grad)
            "expected": self.ctx.expect.state_factors(self.trained_numel / max(self.param_numel, 1),
                                                      self.buffer_bytes / max(4 * self.param_numel, 1)),
            "semantics": self.ctx.adapter.semantics,
            "beyond_canonical": self.ctx.adapter.beyond_canonical(),
            "offload": str(self.ctx.cfg.offload.name),
            "device_type": self.ctx.device.type,
            "loss_scale": self.loss_scale,
        }

    @classmethod
    def aggregate(cls, results: list[dict[str, Any]], cell: Any) -> ProbeReport:
        """Factors, padding, imbalance and the PASS/FAIL check; ``rank_state.csv`` with a row per rank per kind."""
        first, n = results[0], len(results)
        p_bytes, expected = int(first["logical_param_bytes"]), dict(first["expected"])
        kinds = list(dict.fromkeys([*expected, *(row["kind"] for res in results for row in res["rows"])]))
        blank = {"logical_bytes": 0, "physical_bytes": 0, "host_bytes": 0, "dtype": "", "device": "", "numel": 0}
        records = []
        for rank, res in enumerate(results):
            by_kind = {row["kind"]: row for row in res["rows"]}
            records += [{**blank, **by_kind.get(k, {}), "rank": rank, "kind": k} for k in kinds]
        frame = pd.DataFrame(records, columns=COLUMNS)
        total = frame.groupby("kind", sort=False)[["logical_bytes", "physical_bytes", "host_bytes"]].sum()
        logical, physical = total.logical_bytes.to_dict(), total.physical_bytes.to_dict()
        per_rank = {k: frame[frame.kind == k].set_index("rank") for k in kinds}
        factors = {k: logical[k] / p_bytes for k in kinds}
        reasons = check_factors(factors, expected, logical, p_bytes, n)
        reasons += [Reason(Code.STATE_PHYSICAL_BELOW_LOGICAL,
                           f"{k}: physical {physical[k]} B < logical {logical[k]} B")
                    for k in kinds if physical[k] < logical[k]]
        optim = per_rank.get("optim")
        mean_optim = float(optim.logical_bytes.mean()) if optim is not None else 0.0
        section = {
            "step": int(first["step"]),
            "factors": factors,
            "physical_factors": {k: physical[k] / p_bytes for k in kinds},
            "per_rank_factors": {k: [float(v) / p_bytes for v in per_rank[k].logical_bytes] for k in kinds},
            "expected": expected,
            "max_rank_bytes": {k: int(per_rank[k].physical_bytes.max()) for k in kinds},
            "logical_param_bytes": p_bytes,
            "trained_param_bytes": int(first.get("trained_param_bytes", p_bytes)),
            "physical_param_bytes": int(physical.get("param", 0)),
            "padding_bytes": int(physical.get("param", 0) - logical.get("param", 0)),
            "padding_bytes_by_kind": {k: int(physical[k] - logical[k]) for k in kinds},
            "optim_scalar_bytes": int(physical.get("optim_scalar", 0)),
            "owner_imbalance": float(optim.logical_bytes.max()) / mean_optim if mean_optim else None,
            "unchecked_kinds": [k for k in kinds if k not in expected],
            **state_check(reasons),
            "semantics": first["semantics"],
            "dtypes": {k: "+".join(sorted({d for d in per_rank[k].dtype if d})) for k in kinds},
            # Per kind, physical bytes summed over ranks: in host memory and on the training device (an accelerator;
            # on a CPU-only cell the training device is the host, so offload moves nothing: device_bytes is 0).
            "placement": {k: {"host_bytes": int(total.host_bytes[k]),
                              "device_bytes": int(physical[k] - total.host_bytes[k])} for k in kinds},
            "offload": first.get("offload", "none"),
            "device_type": first.get("device_type"),
            "loss_scale": first.get("loss_scale"),  # fp16's dynamic loss scale at the state step; None: no scaling
            # Kinds the strategy keeps beyond the canonical fp32 formula (param, grad, 2 moments; ZeRO 5.1): which
            # tensors and how many logical bytes, summed over ranks; they are in ``expected`` too.
            "beyond_canonical": {k: {"tensors": why, "bytes": int(logical.get(k, 0)),
                                     "max_rank_bytes": int(per_rank[k].logical_bytes.max()) if k in per_rank else 0}
                                 for k, why in first.get("beyond_canonical", {}).items()},
        }
        return ProbeReport(section=section, tables={"rank_state.csv": frame})

    @classmethod
    def derived(cls, ctx: RunContext, groups: Any) -> list[dict[str, Any]]:
        """Every rank's state table from ``groups`` (:func:`zeroexp.formulas.rank_state_bytes`), as its records."""
        from zeroexp.formulas import rank_state_bytes

        cfg, expect = ctx.cfg, ctx.expect
        itemsize, dtype = expect.itemsize, str(cfg.precision.param_dtype)
        p_bytes = 4 * (groups.numel + sum(groups.frozen))  # P: every parameter, frozen ones included
        table = rank_state_bytes(expect.layout, groups, itemsize, expect.knobs, str(cfg.offload.name))
        compute = {"param", "grad"}  # in the compute dtype; masters, moments and step scalars in fp32
        return [{"rows": [{"kind": k, "logical_bytes": v[r][0], "physical_bytes": v[r][1],
                           "dtype": dtype if k in compute else "float32", "device": "",
                           "numel": v[r][0] // (itemsize if k in compute else 4)} for k, v in table.items()],
                 "step": ctx.schedule.state_step, "logical_param_bytes": p_bytes,
                 "expected": expect.state_factors(groups.numel / max(groups.numel + sum(groups.frozen), 1)),
                 "semantics": ctx.adapter.semantics} for r in range(ctx.world_size)]

    @classmethod
    def dry_report(cls, results: list[dict[str, Any]], cell: Any, source: str) -> ProbeReport:
        """Derived: every rank's table (the formulas'). Traced: rank 0's bytes x N, checked against rank 0's bytes
        by the formulas x N (:data:`FACTORS_BASIS`)."""
        if source == "derived":
            report = cls.aggregate(results, cell)
            return ProbeReport({**report.section, "ranks_in_table": "every rank (formulas)"}, report.tables)
        report = cls.aggregate(results, cell)
        s, n, p = report.section, cell.world_size, int(results[0]["logical_param_bytes"])
        frame = report.tables["rank_state.csv"]
        logical = {k: n * int(frame[frame.kind == k].logical_bytes.sum()) for k in s["factors"]}
        physical = {k: n * int(frame[frame.kind == k].physical_bytes.sum()) for k in s["factors"]}
        reasons = check_factors({k: v / p for k, v in logical.items()}, _rank0_factors(cell, s["expected"], n, p),
                                logical, p, n, basis=f"= rank 0 x {n}",
                                note=" (rank 0's bytes by the formulas x N: see factors_basis)")
        s.update(factors={k: v / p for k, v in logical.items()},
                 physical_factors={k: v / p for k, v in physical.items()},
                 padding_bytes=physical.get("param", 0) - logical.get("param", 0),
                 padding_bytes_by_kind={k: physical[k] - logical[k] for k in logical},
                 physical_param_bytes=physical.get("param", 0), optim_scalar_bytes=physical.get("optim_scalar", 0),
                 owner_imbalance=None, **state_check(reasons), factors_basis=FACTORS_BASIS, ranks_in_table="rank 0")
        return ProbeReport(s, {"rank_state.csv": frame})


#: How a traced dry run's factors are read: rank 0's bytes times N.
FACTORS_BASIS = ("rank 0 x world_size: a dry run measures rank 0 only. Exact when every rank holds as much as "
                 "rank 0 (N divides every unit, or every parameter's dim 0 for FSDP2); otherwise above the sum "
                 "over ranks by the padding the last ranks hold instead of parameters. Checked against rank 0's "
                 "bytes by the formulas x world_size (zeroexp.formulas.rank_state_bytes), padding included")


def _rank0_factors(cell: Any, expected: dict[str, float], n: int, p: int) -> dict[str, float]:
    """The factors rank 0's bytes x N give by the formulas (``zeroexp.plan.check.cell.rank_state_of``): the strategy's
    ``expected`` where every rank holds as much as rank 0, above them by the padding the last ranks hold instead of
    parameters otherwise; ``expected`` itself for a kind, precision or offload the formulas do not model."""
    from zeroexp.plan.check.cell import rank_state_of

    table = rank_state_of(cell)
    if table is None:
        return expected
    return {k: n * table[k][0][0] / p if k in table else v for k, v in expected.items()}


# The digest line and the report section (Probe.digest_line, Probe.report_table).


def _other_kinds(row: pd.Series, shown: list[str]) -> str:
    if missing(row.get("state.check")):
        return NA
    parts = []
    for key in row.index:
        kind = key.removeprefix("state.factors.")
        if key.startswith("state.factors.") and kind not in shown and not missing(row[key]) and float(row[key]):
            parts.append(f"{kind} {fmt_factor(row[key])}")
    return ", ".join(parts) or "-"

