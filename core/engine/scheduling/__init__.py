"""The scheduler's parts beside ``core/engine/scheduler.py``: the batch it hands the runner each step and its
decode fast path."""
