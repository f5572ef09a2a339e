"""The per-node tier service (issue 18): one process per node holds the DRAM pool that every
training rank on the node takes its pinned memory from, and keeps a failed job's state for a
while after its trainers are gone.

Not called ``daemon``: python-daemon owns that import name. ``daemon/`` at the top of the
repository holds what runs it as a system service.
"""
from .channel import Channel, ServiceLost
from .client import ServiceSlabSource
from .control import (JobHold, ensure_service, running_service, service_status, start_service,
                      stop_service)
from .paths import ServiceError, service_paths
from .server import ServiceConfig, TierService

__all__ = ["Channel", "JobHold", "ServiceConfig", "ServiceError", "ServiceLost",
           "ServiceSlabSource", "TierService", "ensure_service", "running_service",
           "service_paths", "service_status", "start_service", "stop_service"]
