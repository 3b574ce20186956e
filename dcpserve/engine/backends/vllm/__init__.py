"""The vLLM backend: vLLM's AsyncLLM behind the engine protocol (engine.py: `VllmEngine`), EngineArgs turned into
vLLM's arguments and checked before deploy (args.py), the prefix cache as the app sees it from vLLM's KV cache events
(prefix.py), vLLM's stat-logger hook feeding EngineStats (stats.py), and the watcher that ends vLLM's engine core
processes with the replica (reaper.py, run as a script: the standard library only). engine.py, args.py, prefix.py and
stats.py are the only modules of the project that import vllm. They may import engine's top-level modules and the
native engine's shared rules from dcpserve.engine.core (block arithmetic, prefix hashes, prompt token ids); never
dcpserve.engine.worker or dcpserve.engine.frontend (tests/test_layering.py checks it).
"""
