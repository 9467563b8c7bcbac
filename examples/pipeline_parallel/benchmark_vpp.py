"""Pipeline bubble of the interleaved schedule (PP2 x VPP2) against plain 1F1B (PP2) on the same GPT, measured.

    python examples/pipeline_parallel/benchmark_vpp.py [--microbatches 8] [--write docs/benchmarks.md]

Two gloo ranks on the CPU (one thread each). For each layout: the step time of the schedule (median of
`--steps`), and the compute time of the same work without a pipeline (every forward and backward of this rank's
chunks, run back to back with no transfers). The bubble is (step - compute) / step on the slower rank; theory:
(p - 1) / m of the ideal step for 1F1B and (p - 1) / (v m) for the interleaved schedule, as a fraction of the
step that is (p - 1) / (v m + p - 1).
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PIPELINE_SIZE = 2
NUM_LAYERS, HIDDEN, HEADS, SEQ, MICRO_BATCH, VOCAB = 8, 256, 4, 128, 4, 512


def _config(num_chunks):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                             attention_dropout=0.0, pipeline_model_parallel_size=PIPELINE_SIZE,
                             virtual_pipeline_model_parallel_size=num_chunks if num_chunks > 1 else None)


def _batches(count):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (count, MICRO_BATCH, SEQ + 1), generator=generator)
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    return [{"tokens": t[:, :-1], "labels": t[:, 1:], "position_ids": positions} for t in tokens]


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    return output, lambda loss: (loss.mean(), {"lm loss": loss.mean().detach()})


def _build(num_chunks):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    chunks = []
    for chunk in range(num_chunks):
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk if num_chunks > 1 else None)
        chunks.append(GPTModel(_config(num_chunks), vocab_size=VOCAB, max_sequence_length=SEQ,
                               pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage(),
                               share_embeddings_and_output_weights=True))
    parallel_state.set_virtual_pipeline_model_parallel_rank(None)
    return chunks


def _step_time(chunks, num_microbatches):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dist.barrier()
    start = time.perf_counter()
    get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(_batches(num_microbatches)),
                                model=chunks, num_microbatches=num_microbatches, seq_length=SEQ,
                                micro_batch_size=MICRO_BATCH)
    return time.perf_counter() - start


def _compute_time(chunks, num_microbatches):
    """Every forward and backward of this rank's chunks for one batch, back to back, no transfers."""
    from megatron.core import parallel_state

    batches = _batches(num_microbatches)
    start = time.perf_counter()
    for index, chunk in enumerate(chunks):
        parallel_state.set_virtual_pipeline_model_parallel_rank(index if len(chunks) > 1 else None)
        for batch in batches:
            received = None
            if not chunk.pre_process:
                received = torch.randn(SEQ, MICRO_BATCH, HIDDEN, requires_grad=True)
            chunk.set_input_tensor(received)
            output = chunk(batch["tokens"], batch["position_ids"], labels=batch["labels"])
            if chunk.post_process:
                output.mean().backward()
            else:
                output.backward(torch.ones_like(output))
    parallel_state.set_virtual_pipeline_model_parallel_rank(None)
    return time.perf_counter() - start


def _worker(rank, init_file, num_microbatches, steps, queue):
    from megatron.core import parallel_state, tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=PIPELINE_SIZE)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PIPELINE_SIZE)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    models = {}
    for num_chunks in (1, 2):
        parallel_state.set_virtual_pipeline_model_parallel_world_size(num_chunks if num_chunks > 1 else None)
        models[num_chunks] = _build(num_chunks)
    samples = {num_chunks: ([], []) for num_chunks in models}
    # The layouts alternate, so that load from other processes on the machine affects both alike.
    for repetition in range(steps + 2):
        for num_chunks, chunks in models.items():
            parallel_state.set_virtual_pipeline_model_parallel_world_size(num_chunks if num_chunks > 1 else None)
            step = _step_time(chunks, num_microbatches)
            compute = _compute_time(chunks, num_microbatches)
            if repetition >= 2:  # the first two are warm-up
                samples[num_chunks][0].append(step)
                samples[num_chunks][1].append(compute)
    results = {num_chunks: (statistics.median(steps_s), statistics.median(computes_s))
               for num_chunks, (steps_s, computes_s) in samples.items()}
    parallel_state.destroy_model_parallel()
    queue.put((rank, results))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--write", default=None, help="replace the VPP section of this markdown file")
    options = parser.parse_args()
    handle, init_file = tempfile.mkstemp(prefix="vpp_bench_")
    os.close(handle)
    os.unlink(init_file)
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_worker, args=(rank, init_file, options.microbatches, options.steps, queue))
                 for rank in range(PIPELINE_SIZE)]
    for process in processes:
        process.start()
    per_rank = dict(queue.get(timeout=1200) for _ in processes)  # a crashed rank leaves the other waiting
    for process in processes:
        process.join()
    table = _table(per_rank, options.microbatches)
    print(table)
    if options.write:
        _write_section(options.write, table)


def _table(per_rank, m):
    p = PIPELINE_SIZE
    rows = ["| schedule | step (s) | compute (s) | measured bubble | theory bubble | step vs 1F1B |",
            "|---|---|---|---|---|---|"]
    base_step = max(per_rank[rank][1][0] for rank in per_rank)
    for v, name in ((1, f"1F1B, p={p}, m={m}"), (2, f"interleaved, p={p}, v=2, m={m}")):
        # step, compute and bubble all of the slower rank, so that the row reads bubble = (step - compute) / step
        step, compute = max((per_rank[rank][v] for rank in per_rank), key=lambda times: times[0])
        bubble = (step - compute) / step
        theory = (p - 1) / (v * m + p - 1)
        rows.append(f"| {name} | {step:.3f} | {compute:.3f} | {bubble:.1%} | {theory:.1%} "
                    f"((p-1)/(v m) = {(p - 1) / (v * m):.1%} of compute) | {step / base_step:.2f}x |")
    return "\n".join(rows)


def _write_section(path, table):
    heading = "## Interleaved pipeline (VPP)"
    section = (f"{heading}\n\nMeasured by `python examples/pipeline_parallel/benchmark_vpp.py --write {path}` (GPT, "
               f"{NUM_LAYERS} layers, hidden {HIDDEN}, sequence {SEQ}, micro-batch {MICRO_BATCH}; two gloo ranks on "
               "the CPU, one thread each). Bubble = (step - compute) / step on the slower rank, where compute runs the "
               "rank's forwards and backwards back to back without transfers; theory is (p-1)/(v m + p-1) of the "
               f"step.\n\n{table}\n")
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if heading in text:
        start = text.index(heading)
        # The section ends at the next heading of its level or above (a "# " part or a "## " section).
        ends = [index for index in (text.find(marker, start + len(heading)) for marker in ("\n# ", "\n## "))
                if index != -1]
        text = text[:start] + section + (text[min(ends) + 1:] if ends else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as stream:
        stream.write(text)


if __name__ == "__main__":
    main()
