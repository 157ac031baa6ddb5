"""Preemption without loss: a SIGTERM drains the job instead of killing it (docs/operations.md).

``decide.py`` holds the rules (pure: the budget, what to persist, which step is safe, the exit status, the final
line); ``messages.py`` the drain's two store values (``launcher/keys.py`` names their keys); ``worker.py`` the
worker's side (the SIGTERM handler, the request's watcher, the agreement at a step boundary). The DeepSpeed part
(persisting the step through the tier-3 writer) is ``integrations/deepspeed/drain.py``; the launcher's part
``launcher/drain.py``.
"""
