"""The planner's store on disk (zeroexp.cell.store): a second plan of the same model and code reads its shape, units,
traced steps and forwards back and computes none of them, in a fresh process without importing the model's modeling
code, and answers exactly what the first answered; another fingerprint, a truncated file, a model on PYTHONPATH,
``cache=false`` and the suite's own ``ZEROEXP_CACHE_DIR=off`` read nothing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import HF_LLAMA, REPO, run_cli

pytest.importorskip("transformers")

#: A shrunk Hugging Face Llama planned at two sizes with selective checkpointing and a network: its shape, units,
#: every row's traced steps and forwards, and the FLOPs of selective_op's recompute share are all answers to store.
PLAN = (*HF_LLAMA, "world_size=[2,3]", "batch_size=2", "activation_checkpointing=selective_op", "network=h100_ib",
        "format=json")
#: The tables the plan above writes (zeroexp.cell.memo.STORED_TABLES but activation_bytes, which recommend asks).
WRITTEN = {"plan_shapes", "wrap_units", "step_traces", "forward_traces", "op_counts"}


def _plan(store, *extra: str, cwd=None) -> subprocess.CompletedProcess:
    """The plan as a fresh invocation (the session's memo holds answers of its own: conftest) with ``store``."""
    from zeroexp.cell.memo import invocation_memo

    env = {**os.environ, "ZEROEXP_CACHE_DIR": str(store)}
    with invocation_memo(fresh=True):
        out = run_cli(*PLAN, *extra, app="zeroexp.cli.plan", env=env, cwd=cwd or REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def _counts(err: str) -> tuple[int, int] | None:
    """(read, written) from the plan's note on the store, None without one."""
    m = re.search(r"cache: (\d+) answer\(s\) .* read from .*, (\d+) written", err)
    return (int(m.group(1)), int(m.group(2))) if m else None


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """The plan computed once into a store of its own: (store, its JSON output, the files written)."""
    store = tmp_path_factory.mktemp("store")
    out = _plan(store)
    files = sorted(p.relative_to(store) for p in store.rglob("*.pkl"))
    return store, out.stdout, out.stderr, files


def test_a_second_plan_reads_every_answer_and_computes_none(first, tmp_path, monkeypatch):
    store, stdout, stderr, files = first
    assert {p.parts[0] for p in files} == WRITTEN
    assert _counts(stderr) == (0, len(files))
    copy = tmp_path / "store"
    shutil.copytree(store, copy)

    def computed(*_a, **_k):
        raise AssertionError("computed again")
    import zeroexp.cli.planned_model as planned
    import zeroexp.models.build as build
    import zeroexp.plan.activations as activations
    import zeroexp.plan.flops as flops
    import zeroexp.plan.steptrace as steptrace

    for module, name in ((steptrace, "trace_steps"), (activations, "trace_activations"), (planned, "_built_shape"),
                         (build, "wrap_paths"), (flops, "_step_flops")):
        monkeypatch.setattr(module, name, computed)
    again = _plan(copy)
    assert json.loads(again.stdout) == json.loads(stdout)
    read, written = _counts(again.stderr)
    assert read >= len(WRITTEN) and written == 0
    assert sorted(p.relative_to(copy) for p in copy.rglob("*.pkl")) == files  # nothing new written


def test_a_fresh_process_answers_from_the_store_without_the_models_code(first, tmp_path):
    """``python -m zeroexp.plan`` as a user runs it, on the store the first plan wrote: exit 0, the same records,
    and transformers never imported (``-X importtime`` lists every module the process imports)."""
    store, stdout, _, _ = first
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    env = {**os.environ, "ZEROEXP_CACHE_DIR": str(copy), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "zeroexp.plan", *PLAN], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == json.loads(stdout)
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
    assert "torch" in imported and not {m for m in imported if m.split(".")[0] == "transformers"}
    assert _counts(out.stderr)[0] > 0


def test_another_fingerprint_or_a_truncated_answer_computes_again(first, tmp_path, monkeypatch):
    """An edit of zeroexp's sources (another fingerprint) reads nothing and writes every answer anew, beside the old
    ones; a truncated answer is computed again, rewritten whole, and the plan answers as before."""
    import zeroexp.cell.store as store_module

    store, stdout, _, files = first
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    truncated = copy / files[0]
    truncated.write_bytes(truncated.read_bytes()[:10])
    out = _plan(copy)
    assert json.loads(out.stdout) == json.loads(stdout)
    assert _counts(out.stderr)[1] >= 1 and truncated.stat().st_size == (store / files[0]).stat().st_size
    monkeypatch.setattr(store_module, "_zeroexp_sources", lambda: "an edited zeroexp")
    out = _plan(copy)
    assert json.loads(out.stdout) == json.loads(stdout)
    assert _counts(out.stderr) == (0, len(files))
    assert len(list(copy.rglob("*.pkl"))) == 2 * len(files)
    assert not list(copy.rglob("*.tmp"))  # each written whole: no temporary file left


def test_nothing_is_stored_for_code_the_fingerprint_cannot_name_or_when_turned_off(tmp_path):
    """A model whose factory is a module on PYTHONPATH (no installed distribution: it may change under its name),
    ``cache=false``, and ``ZEROEXP_CACHE_DIR=off`` (the suite's) write no answer and say nothing of a store."""
    corpus = ("model=custom", "model._target_=corpus.conv_bn", "model.input_shape=[3,6,6]", "world_size=2",
              "batch_size=2", "format=json")
    from zeroexp.cell.memo import invocation_memo

    for args, where in ((corpus, tmp_path / "a"), ((*PLAN, "cache=false"), tmp_path / "b"), (PLAN, "off")):
        env = {**os.environ, "ZEROEXP_CACHE_DIR": str(where), "PYTHONPATH": str(REPO / "tests")}
        with invocation_memo(fresh=True):
            out = run_cli(*args, app="zeroexp.cli.plan", env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        assert _counts(out.stderr) is None and not list(tmp_path.rglob("*.pkl"))


def test_a_key_naming_an_address_is_never_stored(tmp_path):
    """A key whose text holds an object's address is another key in the next process: not written, not read."""
    from zeroexp.cell.store import AnswerStore

    store = AnswerStore(tmp_path, "f" * 64)
    store.save("step_traces", ("model", object()), 1)
    assert not list(tmp_path.rglob("*")) and store.load("step_traces", ("model", object())) == (False, None)
    store.save("step_traces", ("model", 2), {"a": 1})
    assert store.load("step_traces", ("model", 2)) == (True, {"a": 1}) and store.written == store.read == {
        "step_traces": 1}
    assert AnswerStore(tmp_path, "e" * 64).load("step_traces", ("model", 2)) == (False, None)


def test_an_editable_install_is_not_a_version_to_store_under(tmp_path, monkeypatch):
    """A distribution's version names its code unless it is installed editable (PEP 610's ``dir_info.editable``:
    the code changes under the same version): then the fingerprint of a model using it is None, nothing stored."""
    from zeroexp.cell.store import _distribution, fingerprint

    for name, editable in (("zx_fixed_pkg", False), ("zx_edited_pkg", True)):
        info = tmp_path / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "direct_url.json").write_text(json.dumps({"url": "file:///src", "dir_info": {"editable": editable}}))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _distribution("zx_fixed_pkg.models.Net") == "zx_fixed_pkg==1.0"
    assert _distribution("zx_edited_pkg.models.Net") is None
    assert fingerprint(["zx_fixed_pkg.models.Net"]) is not None and fingerprint(["zx_edited_pkg.models.Net"]) is None
