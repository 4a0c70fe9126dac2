"""zeroexp: what each data-parallel sharding strategy keeps, sends, peaks at, and computes, per rank."""

__version__ = "0.1.0"

#: The oldest torch zeroexp supports (pyproject.toml: ``torch>=2.13``): its formulas follow torch 2.13's FSDP and
#: FSDP2 layouts, and its shims over torch's internals (zeroexp._lib) target torch 2.13.
TORCH_AT_LEAST = (2, 13)


def _check_torch(installed: "str | None" = None) -> None:
    """Raise ImportError when the installed torch (its distribution's version, read without importing torch) is
    older than :data:`TORCH_AT_LEAST`. No torch installed, or a version that does not parse: nothing raised here."""
    import re

    if installed is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("torch")
        except PackageNotFoundError:
            return
    found = re.match(r"(\d+)\.(\d+)", installed)
    if found is not None and (int(found[1]), int(found[2])) < TORCH_AT_LEAST:
        wanted = ".".join(map(str, TORCH_AT_LEAST))
        raise ImportError(f"zeroexp supports torch>={wanted} (pyproject.toml); torch {installed} is installed")


_check_torch()
