"""What a step will cost before it runs: the node's measured rates (node.py), the planner of
``tier: auto`` (planner.py), the activations a forward keeps (activations.py) and the plan as a
report (report.py)."""
