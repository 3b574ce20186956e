"""The local tooling: the whole system on one machine. `make serve` (serve.py: a Ray head with logical GPUs and the
tiny model), `make cluster` (nodes.py: ray_cluster.yaml's cluster with Ray's real autoscaler, provider.py its node
provider, head_keeper.py its supervised head with GCS fault tolerance), `make observe` (observe.py: Prometheus on
loopback) and the Debian packages they install (debian.py). Above deployments/ (it checks a serve config's layout with
the app's own argument parser), beside the simulator: nothing of the product imports it."""
