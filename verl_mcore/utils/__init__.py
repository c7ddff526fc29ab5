"""Small process-level helpers shared across packages (RNG state capture, atomic file writes)."""
