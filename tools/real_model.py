"""`python -m tools.real_model [--cache-dir DIR] [--gguf FILE]` from a checkout: prints the
SmolLM2-135M-Instruct Hugging Face directory, made on first use. The code is
verl_mcore/real_model.py, inside the package, beside the tiny model (tests and recipes of an
installed package use it too, and `pip install .` installs no `tools` package)."""
import sys

from verl_mcore import real_model

if __name__ == "__main__":
    sys.exit(real_model.main())
# Imported: this name is the module itself, so `tools.real_model.X` is verl_mcore's X.
sys.modules[__name__] = real_model
