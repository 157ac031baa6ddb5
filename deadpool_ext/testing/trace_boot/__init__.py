"""Not imported as a package: this folder goes on a traced job's ``PYTHONPATH`` (``testing.trace_modules``) so that
Python runs its ``sitecustomize`` at start-up."""
