"""The engine core: one replica's engine state and the one thread that owns it. `EngineCore` (core.py) drives
`LLMEngine` (engine.py: step() = schedule -> execute -> update, detokenization, the KV ledger), which owns the
scheduler (scheduler.py), the KV block manager (block_manager.py) and the prefix cache's content addresses and reports
(prefix_cache.py) over `Request`s (request.py); step.py and outputs.py are the step messages between the core and the
ranks (`SchedulerOutput` out, `ModelRunnerOutput` back). It may import engine's top-level modules (config, protocol,
sampling_params, tokenizer, ...) and, of dcpserve.engine.worker, only the executor interface
(dcpserve.engine.worker.executor: `Executor`, `create_executor`), never the model runner or other rank-side code;
nothing of dcpserve.engine.frontend or dcpserve.engine.backends (tests/test_layering.py checks it).
"""
