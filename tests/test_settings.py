"""The settings table (sbpbench/settings) is the one torch-free declaration of every setting: its
choices are the registries' names and its names are the specs' fields."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

from sbpbench.config import DTYPES, FIELD_NAMES, MaxlenSpec
from sbpbench.data import OBJECTIVES
from sbpbench.methods import METHODS, STEPS
from sbpbench.settings import (
    DTYPE_NAMES,
    EVERY_METHOD,
    METHOD_NAMES,
    POINT_SETTINGS,
    PROTOCOLS,
    SEARCH_SETTINGS,
    SETTINGS,
)
from sbpbench.settings import OBJECTIVES as SETTING_OBJECTIVES
from sbpbench.settings import STEPS as SETTING_STEPS


def test_choices_are_the_registries_names():
    """--method lists the method registry's names in its order, --dtype the dtype table's; the
    objectives and steps the data and methods packages use are these very tuples."""
    assert METHOD_NAMES == tuple(METHODS)
    assert SETTINGS["method"].choices == (*METHODS, EVERY_METHOD)
    assert DTYPE_NAMES == tuple(DTYPES) and SETTINGS["dtype"].choices == DTYPE_NAMES
    assert OBJECTIVES is SETTING_OBJECTIVES and STEPS is SETTING_STEPS
    assert SETTINGS["objective"].choices == OBJECTIVES and SETTINGS["protocol"].choices == PROTOCOLS


def test_every_spec_field_has_one_entry():
    """The point settings are RunSpec's fields with MethodSettings' in place of `settings`; the
    search settings are MaxlenSpec's own fields (besides its base point)."""
    assert set(POINT_SETTINGS) == set(FIELD_NAMES) and len(POINT_SETTINGS) == len(FIELD_NAMES)
    assert set(SEARCH_SETTINGS) == {f.name for f in fields(MaxlenSpec)} - {"base"}


def test_the_table_imports_no_torch():
    """Importing the settings table in a fresh interpreter loads neither torch nor transformers."""
    code = "import sys, sbpbench.settings; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
