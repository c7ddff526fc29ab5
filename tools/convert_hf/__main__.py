"""`python -m tools.convert_hf {hf-to-mcore, mcore-to-hf, verify} ...` from a checkout: the
`verl-mcore-convert-hf` command (verl_mcore/convert_hf/__main__.py)."""
import sys

from verl_mcore.convert_hf.__main__ import main

if __name__ == "__main__":  # required: dist_checkpointing and verify start spawn processes
    sys.exit(main())
