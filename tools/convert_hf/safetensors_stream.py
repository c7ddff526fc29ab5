"""Checkout shim: the code is verl_mcore/convert_hf/safetensors_stream.py (`pip install .` installs no `tools`)."""
import sys

from verl_mcore.convert_hf import safetensors_stream

# This name is the module itself, so patching tools.convert_hf.safetensors_stream.X patches what runs.
sys.modules[__name__] = safetensors_stream
