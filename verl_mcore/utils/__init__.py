"""Small helpers shared across packages: the compute device, RNG state capture, atomic file
writes, and reading checkpoint files safely (safe_read.py, manifest.py: used by the engine's
checkpoints, model loading, resume checks and the converters alike)."""
