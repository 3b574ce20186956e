"""Dispatch: a granted request sent to its replica, through the KV-aware request router, and its deltas streamed back
on the ingress' delta stream from that replica."""
