"""One replica's inference engine: configs, scheduling, KV blocks, model runner, and the dcpserve CLI."""
