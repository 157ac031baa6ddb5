"""Short import path: ``import deadpool_ext.deepspeed as dpx; engine, *_ = dpx.initialize(...)``."""
from .integrations.deepspeed import DeadpoolRuntime, initialize, register

__all__ = ["initialize", "register", "DeadpoolRuntime"]
