"""Ray Serve: the OpenAI ingress, the engine replica, KV-aware admission and routing, the autoscaling policy.

`dcpserve.deployments.app:build_app` is the import path `serve deploy` uses (see serve_config.yaml).
"""
