"""Planning: what a config needs of the machine (memory.py), before and while it runs."""
