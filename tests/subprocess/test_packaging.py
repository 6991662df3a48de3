"""What an install relies on: every module imports on a plain install (no optional extra), and our
own deprecation and future warnings fail the test run (pyproject.toml's filterwarnings)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest

# The optional extras' import names (pyproject's [project.optional-dependencies]: deepspeed, peers,
# flash-attn-4; FlashAttention-3's module, built by hand)
# and the official StreamBP code (its own virtualenv). Each is imported inside the function that uses
# it, so a plain `pip install -e .` runs every command.
EXTRAS = ("deepspeed", "liger_kernel", "streambp", "flash_attn", "flash_attn_interface")
# `python -m sbpbench`: importing it runs the CLI.
SCRIPTS = ("sbpbench.__main__",)

_IMPORT_ALL = textwrap.dedent(
    """
    import importlib, pkgutil, sys, traceback, warnings

    import sbpbench

    for extra in sys.argv[1].split(","):
        sys.modules[extra] = None  # `import extra` raises ImportError, as when it is not installed
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("error", category=category, module="sbpbench")
    names = [m.name for m in pkgutil.walk_packages(sbpbench.__path__, "sbpbench.")]
    failed = 0
    for name in names:
        if name in sys.argv[2].split(","):
            continue
        try:
            importlib.import_module(name)
        except BaseException:
            failed += 1
            print(f"{name}:", traceback.format_exc(limit=-3))
    print(len(names))
    sys.exit(1 if failed else 0)
    """
)


@pytest.mark.slow
def test_every_module_imports_without_the_optional_extras():
    """Every module of the package imports in a fresh interpreter with the optional extras made
    unimportable and our deprecation warnings as errors: no module needs an extra (or a package
    pyproject does not declare) just to be imported."""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, ",".join(EXTRAS), ",".join(SCRIPTS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert int(result.stdout.split()[-1]) > 100, result.stdout  # the walk found the whole package


def test_our_deprecation_and_future_warnings_are_errors():
    """A deprecation or future warning attributed to one of our modules (where a library points its
    warning at the caller) raises in the test run; one a library raises from inside itself does not."""
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        for module in ("sbpbench.plot.common", "tests.test_plot"):
            with pytest.raises(category):
                warnings.warn_explicit("deprecated", category, f"{module}.py", 1, module=module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn_explicit("deprecated", DeprecationWarning, "pandas/core/frame.py", 1, module="pandas.core.frame")
    assert [w.category for w in caught] == [DeprecationWarning]
