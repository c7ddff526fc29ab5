"""Checkout shim: the code is verl_mcore/convert_hf/convert.py (`pip install .` installs no `tools`)."""
import sys

from verl_mcore.convert_hf import convert

# This name is the module itself, so patching tools.convert_hf.convert.X patches what runs.
sys.modules[__name__] = convert
