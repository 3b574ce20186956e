"""The native engine's fronts over the engine core: `LLM` (llm.py), the vLLM-shaped batch API that drives an
`LLMEngine` in the caller's thread (or, with backend="vllm", the vLLM adapter), and `AsyncEngine` (async_engine.py),
the asyncio front a serving replica uses, which talks to the `EngineCore` thread only through its typed messages. It
may import engine's top-level modules, dcpserve.engine.core and (llm.py, lazily) dcpserve.engine.backends.vllm; never
dcpserve.engine.worker: steps reach the ranks only through the core (tests/test_layering.py checks it).
"""
