"""The commands a user runs: ``tiered`` (cli.py, with ``tiered plan MODEL`` in plan_model.py),
``tiered-launch`` (launcher.py) and what each of its ranks runs first (rank_entry.py)."""
