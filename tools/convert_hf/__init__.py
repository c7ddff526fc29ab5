"""`python -m tools.convert_hf ...` from a checkout; the code is verl_mcore/convert_hf (installed as
`verl-mcore-convert-hf`). The modules here are shims, kept for the layout users know."""
