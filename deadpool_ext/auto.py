"""``import deadpool_ext.auto``: the one line for launches that do not go through ``python -m deadpool_ext.run``
or ``deadpool-run``. From then on every ``deepspeed.initialize`` whose config has a ``"deadpool"`` section
attaches the extension (``integrations/deepspeed_hook.py``); DeepSpeed is hooked when it is imported (now, if
it already is). Importing ``deadpool_ext`` itself never does this.
"""
from __future__ import annotations

import os

from .integrations import lightning, transformers_trainer
from .integrations.deepspeed_hook import default_extensions_dir, install
from .logs import configure_logging

configure_logging("info")
default_extensions_dir(os.environ)
install(lazy=True)
transformers_trainer.install(lazy=True)
lightning.install(lazy=True)
