"""Subcommands of the ``deadpool`` console script, one module each.

A command module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``; the
subcommand's name is the module's name with underscores as dashes. ``deadpool_ext.cli`` discovers them, so a
new command is a new file here and nothing else.
"""
