"""Cluster-level planning and placement: capacity plans across TP x DCP layouts (no Ray needed for planning)."""
