"""`python -m tools.make_tiny_model --out DIR` from a checkout. The code is verl_mcore/tiny_model.py,
inside the package, because an installed quickstart (model.make_tiny_if_missing) needs it and
`pip install .` installs no `tools` package."""
import sys

from verl_mcore import tiny_model

if __name__ == "__main__":
    sys.exit(tiny_model.main())
# Imported: this name is the module itself, so `tools.make_tiny_model.X` is verl_mcore's X.
sys.modules[__name__] = tiny_model
