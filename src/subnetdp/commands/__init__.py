"""Subcommands of the ``subnetdp`` command line (each module: add_parser + run)."""
