"""Not imported as a package: this folder goes on a faulted job's ``PYTHONPATH`` (``chaos.at_step.harness_env``)
so that Python runs its ``sitecustomize`` at start-up."""
