"""Communicator reconstruction: the worker side of the hot-swap protocol (see docs/hot-swap.md)."""
