"""Where every shard state lives: the units a model's parameters are grouped into (units.py),
the bytes a policy places in each tier (plan.py's MemoryPlan) and the tier manager that holds
and moves them (manager.py)."""
