"""The dcpserve command line (dcpserve/cli.py): the top of the package table, above the simulator."""
