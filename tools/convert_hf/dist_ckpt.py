"""Checkout shim: the code is verl_mcore/convert_hf/dist_ckpt.py (`pip install .` installs no `tools`)."""
import sys

from verl_mcore.convert_hf import dist_ckpt

# This name is the module itself, so patching tools.convert_hf.dist_ckpt.X patches what runs.
sys.modules[__name__] = dist_ckpt
