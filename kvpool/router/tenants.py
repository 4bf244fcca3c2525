"""Tenants of the router: moved to `kvpool.tenants` (the master reads the same file for pool quotas)."""

from kvpool.tenants import OPEN_TENANT, Tenant, Tenants

__all__ = ["OPEN_TENANT", "Tenant", "Tenants"]
