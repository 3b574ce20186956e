"""The `dcpserve` commands of the planner and the engine (dcpserve/cli.py assembles the command line from these and
the simulator's):

    dcpserve layout --tokens 9 --dcp 2 [--block-size 2] [--interleave 1]
        which DCP rank holds each token of a sequence, at which page and slot (docs/dcp.md)
    dcpserve tiny-model DIR [--seed 0] [--force] [--mla]
        write the embedded default model (tiny random Llama, one KV head, byte-level BPE tokenizer); --mla: a tiny
        random DeepSeek-V2 (MLA + MoE) with the same tokenizer
    dcpserve plan --model DIR --gpus-per-node 8 --gpu-memory 80GiB [--context 128k] [--weight-dtype auto] ...
        KV capacity and long-context sequences per replica and per node for every valid TP x DCP layout, for any
        config.json vLLM serves (GQA / MQA, MLA, sliding-window and hybrid layers, MoE); weights as the checkpoint
        ships them (its quantization_config) unless --weight-dtype names one dtype
        (with --trace, dcpserve/simulator/plan.py also ranks the layouts by simulated goodput on that trace)
    dcpserve generate --model DIR [--tp 2 --dcp 2] --prompt "..." [--max-tokens 32 --temperature 0 ...]
        run the engine on one or more prompts and print the completions (tp > 1 runs a Ray worker group)

Each command is one `_cmd_<name>` function and one add_parser block in add_commands. Keep transformers out of
the module-level imports (tiny_model imports it when writing weights), so `layout`, `plan` and `--help` stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from dcpserve.cluster.planner import PLAN_DTYPES, WEIGHT_DTYPES, PlanRequest, format_plan, plan_layouts
from dcpserve.cluster.published_models import PUBLISHED, model_spec
from dcpserve.cluster.tiny_model import write_tiny_mla_model, write_tiny_model
from dcpserve.engine.args import EngineArgs, cli_type, parse_bytes, parse_tokens
from dcpserve.engine.worker.pcp import rank_segments
from dcpserve.kernels import dcp_local_seq_lens, dcp_slot_mapping, dcp_token_owner
from dcpserve.kernels.layout import check_dcp_args


def layout_table(num_tokens: int, dcp_size: int, block_size: int, interleave: int, pcp_size: int = 1,
                 chunk: int | None = None) -> str:
    """A text table of the DCP layout of one sequence whose logical block i is page i on every rank. With
    pcp_size > 1 also the PCP rank that computes each position's query when the sequence prefills in chunks of
    `chunk` tokens (default: one chunk), and which PCP group each DCP rank is in."""
    check_dcp_args(dcp_size, 0, interleave, block_size)
    if pcp_size < 1 or (pcp_size > 1 and dcp_size > 1 and dcp_size % pcp_size):
        raise ValueError(f"dcp={dcp_size} with pcp={pcp_size}: dcp must be 1 or a multiple of pcp")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    tokens_per_block = block_size * dcp_size
    num_blocks = max(1, -(-num_tokens // tokens_per_block))
    table = torch.arange(num_blocks, dtype=torch.int32)[None, :]
    positions = torch.arange(num_tokens)
    seq_idx = torch.zeros(num_tokens, dtype=torch.int64)
    owners = dcp_token_owner(positions, dcp_size, interleave)
    slots = torch.stack(
        [dcp_slot_mapping(table, seq_idx, positions, block_size, dcp_size, r, interleave) for r in range(dcp_size)]
    )
    query_rank = [0] * num_tokens  # the PCP rank that computes each position's query
    if pcp_size > 1:
        step = chunk or max(1, num_tokens)
        for start in range(0, num_tokens, step):
            length = min(step, num_tokens - start)
            for q in range(pcp_size):
                for segment in rank_segments([length], pcp_size, q):
                    for i in range(segment.start, segment.start + segment.length):
                        query_rank[start + i] = q
    header = f"{num_tokens} tokens, dcp={dcp_size}, block_size={block_size}, interleave={interleave}"
    if pcp_size > 1:
        header += f", pcp={pcp_size}, prefill chunks of {chunk or max(1, num_tokens)}"
    lines = [
        f"{header}: logical blocks of {tokens_per_block} tokens; logical block i = page i on every rank",
        "",
        "position  rank  page  offset  slot" + ("  query on PCP rank" if pcp_size > 1 else ""),
    ]
    for p in range(num_tokens):
        rank = int(owners[p])
        slot = int(slots[rank, p])
        line = f"{p:>8}  {rank:>4}  {slot // block_size:>4}  {slot % block_size:>6}  {slot:>4}"
        lines.append(line + (f"  {query_rank[p]:>18}" if pcp_size > 1 else ""))
    lines.append("")
    lens = torch.tensor([num_tokens])
    within = dcp_size // pcp_size if pcp_size > 1 and dcp_size > 1 else dcp_size
    for r in range(dcp_size):
        local = int(dcp_local_seq_lens(lens, dcp_size, r, interleave)[0])
        held = [p for p in range(num_tokens) if int(owners[p]) == r]
        where = f" (PCP group {r // within}, TP rank {r % within} of its run)" if pcp_size > 1 and dcp_size > 1 else ""
        lines.append(f"rank {r}{where}: local_seq_len {local}, positions {held}")
    if pcp_size > 1:
        for q in range(pcp_size):
            computed = [p for p in range(num_tokens) if query_rank[p] == q]
            lines.append(f"PCP rank {q} computes the queries (and K/V) of positions {computed}")
        if dcp_size == 1:
            lines.append("dcp=1: every PCP group holds every token (the K/V each computes is gathered by all)")
    return "\n".join(lines)


def _cmd_layout(args: argparse.Namespace) -> int:
    if args.tokens < 0:
        raise SystemExit(f"--tokens must be >= 0, got {args.tokens}")
    try:
        print(layout_table(args.tokens, args.dcp, args.block_size, args.interleave, args.pcp, args.chunk))
    except ValueError as err:
        raise SystemExit(f"dcpserve layout: {err}") from err
    return 0


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    try:
        write = write_tiny_mla_model if args.mla else write_tiny_model
        write(args.directory, seed=args.seed, force=args.force, log=lambda line: print(line, flush=True))
    except (OSError, ValueError) as err:
        raise SystemExit(f"dcpserve tiny-model: {err}") from err
    return 0


def plan_request(args: argparse.Namespace) -> PlanRequest:
    """The PlanRequest of `dcpserve plan`'s arguments (raises ValueError); `plan --trace` (dcpserve/simulator/plan.py)
    plans with the same one. Without --context: the model's max_position_embeddings."""
    context = args.context or model_spec(args.model).max_position_embeddings
    return PlanRequest(
        gpus_per_node=args.gpus_per_node,
        gpu_memory_bytes=args.gpu_memory,
        context_len=context,
        dtype=args.dtype,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
        max_pcp=getattr(args, "pcp", 1),
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    try:
        model = model_spec(args.model)  # by name or config.json: the engine's, MLA or generic (model_specs.py)
        request = plan_request(args)
    except (OSError, ValueError) as err:
        raise SystemExit(f"dcpserve plan: {err}") from err
    print(format_plan(model, request, plan_layouts(model, request), model_name=args.model))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from dcpserve.engine.frontend.llm import LLM
    from dcpserve.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=args.sampling_seed,
            stop=tuple(args.stop) if args.stop else None,
        )
        engine_args = EngineArgs.from_cli_args(args)
        print(
            f"loading {engine_args.model} (backend={engine_args.backend}, tp={engine_args.tensor_parallel_size}, "
            f"dcp={engine_args.decode_context_parallel_size}, pcp={engine_args.prefill_context_parallel_size})...",
            file=sys.stderr, flush=True,
        )
        llm = LLM(**dataclasses.asdict(engine_args))
    except (OSError, ValueError, RuntimeError) as err:  # RuntimeError includes NotImplementedError
        raise SystemExit(f"dcpserve generate: {err}") from err
    with llm:
        print(f"KV capacity: {llm.kv_capacity_tokens} tokens per replica", file=sys.stderr, flush=True)
        try:
            outputs = llm.generate(args.prompt, params)
        except ValueError as err:
            raise SystemExit(f"dcpserve generate: {err}") from err
        for prompt, output in zip(args.prompt, outputs, strict=True):
            completion = output.outputs[0]
            print(f"--- prompt: {prompt!r}")
            print(f"{completion.text}")
            print(f"--- {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds layout, tiny-model, plan and generate to the dcpserve command line."""
    layout = commands.add_parser("layout", help="show which DCP rank holds each token of a sequence")
    layout.add_argument("--tokens", type=int, required=True, help="sequence length")
    layout.add_argument("--dcp", type=int, required=True, help="decode context parallel size N")
    layout.add_argument("--block-size", type=int, default=16, help="tokens per physical page on a rank (default 16)")
    layout.add_argument("--interleave", type=int, default=1, help="consecutive tokens per rank turn (default 1)")
    layout.add_argument("--pcp", type=int, default=1,
                        help="prefill context parallel size: also show which PCP rank computes each query (default 1)")
    layout.add_argument("--chunk", type=int, default=None,
                        help="with --pcp: the prefill chunk in tokens (default: the whole sequence in one chunk)")
    layout.set_defaults(func=_cmd_layout)

    tiny = commands.add_parser("tiny-model", help="write the embedded default model (tiny random Llama + tokenizer)")
    tiny.add_argument("directory", help="where to write it (created if missing)")
    tiny.add_argument("--seed", type=int, default=0,
                      help="weight seed; the same seed gives identical files (default 0)")
    tiny.add_argument("--force", action="store_true", help="overwrite model files in a non-empty directory")
    tiny.add_argument("--mla", action="store_true",
                      help="a tiny DeepSeek-V2 (multi-head latent attention + mixture of experts) instead of the Llama")
    tiny.set_defaults(func=_cmd_tiny_model)

    plan = commands.add_parser("plan", help="KV capacity of every valid TP x DCP layout for a model and GPU")
    plan.add_argument("--model", required=True,
                      help=f"a published config ({', '.join(PUBLISHED)}) or a model directory or its config.json")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="GPUs in one node (default 8)")
    plan.add_argument("--gpu-memory", type=cli_type(parse_bytes), required=True,
                      help="memory of one GPU: 80GiB, 80GB (10^9), 141G (= GiB) or bytes")
    plan.add_argument("--context", type=cli_type(parse_tokens), default=None,
                      help="tokens per sequence: 128k (= 131072), 1M or a number (default: the model's "
                           "max_position_embeddings)")
    plan.add_argument("--dtype", default="bfloat16", choices=sorted(PLAN_DTYPES),
                      help="weights and KV cache dtype (default bfloat16)")
    plan.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES,
                      help="weights: auto (default) as the checkpoint ships them, its quantization_config (fp8, awq, "
                           "gptq, mxfp4, compressed-tensors, ...) or, unquantized, --dtype; or every parameter in one "
                           "dtype")
    plan.add_argument("--kv-dtype", default=None, choices=sorted(PLAN_DTYPES),
                      help="KV cache dtype, e.g. float8 for vLLM's --kv-cache-dtype fp8 (default: --dtype)")
    plan.add_argument("--block-size", type=int, default=16, help="tokens per KV page on a rank (default 16)")
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                      help="fraction of GPU memory for weights + KV (default 0.9)")
    plan.add_argument("--pcp", type=int, default=1,
                      help="plan prefill context parallelism too: pcp = 1, 2, 4, ... up to this (default 1: none)")
    plan.set_defaults(func=_cmd_plan)

    gen = commands.add_parser("generate", help="generate completions with the engine (tp > 1 uses Ray)")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    sampling = gen.add_argument_group("sampling (each prompt's SamplingParams)")
    sampling.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    sampling.add_argument("--top-k", type=int, default=0, help="top-k filter, 0 = off (default 0)")
    sampling.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="per-request sampling seed")
    sampling.add_argument("--stop", action="append", help="a stop string; repeat for several")
    EngineArgs.add_cli_args(gen.add_argument_group("engine (EngineArgs, dcpserve/engine/args.py)"))
    gen.set_defaults(func=_cmd_generate)
