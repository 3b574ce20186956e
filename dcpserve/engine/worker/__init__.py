"""The rank side: what runs a step on the model's TP ranks. The executor interface the core steps through
(executor.py: `Executor`, `create_executor`; in process at tp = 1) and the Ray worker group for tp > 1
(ray_executor.py: one actor per rank, steps over rank_channel.py's authenticated sockets, process groups from
parallel.py); on each rank the model runner (model_runner.py) with its persistent batch (input_batch.py), attention
inputs (attention_metadata.py), DCP exchange timer (step_timer.py), decode CUDA graphs (cuda_graphs.py), sampler
(sampler.py) and weight loading (loader.py). It may import engine's top-level modules, dcpserve.engine.layers,
dcpserve.engine.models and, of dcpserve.engine.core, the step messages (step.py, outputs.py) and the block arithmetic
(block_manager.py); never dcpserve.engine.frontend or dcpserve.engine.backends (tests/test_layering.py checks it).
"""
