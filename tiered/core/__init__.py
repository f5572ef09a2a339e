"""The small pieces every layer shares: errors, byte sizes, the node's limits, liveness
locks, plain tables, the timeline, the version and the cache folder. Imports nothing of tiered."""
