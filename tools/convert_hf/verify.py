"""Checkout shim: the code is verl_mcore/convert_hf/verify.py (`pip install .` installs no `tools`)."""
import sys

from verl_mcore.convert_hf import verify

# This name is the module itself, so patching tools.convert_hf.verify.X patches what runs.
sys.modules[__name__] = verify
