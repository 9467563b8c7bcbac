"""Memory and communication of a pipeline stage under Megatron-FSDP: regathering each unit per microbatch
(ZeRO-3, `optim_grads_params`) versus keeping the stage's weights gathered (ZeRO-2, `optim_grads`).

    torchrun --nproc-per-node 4 -m examples.megatron_fsdp.pipeline_gather_cost [--microbatches 8]

Trains a GPT split over 2 pipeline stages x 2 data-parallel ranks with the 1F1B schedule for a few steps and
prints, per strategy, the bytes this rank sent per step by collective kind and the bytes it held (persistent
state and the peak of transient gathered weights / gradient buffers), from Megatron-FSDP's own counters.
"""

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist


def _train(strategy, args):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel, finalize_model_grads
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                               hidden_dropout=0.0, attention_dropout=0.0, pipeline_model_parallel_size=2, init_seed=1)
    model = GPTModel(config, vocab_size=1024, max_sequence_length=args.seq,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(), share_embeddings_and_output_weights=True)
    chunk = FullyShardedDataParallel(config, DistributedDataParallelConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
        data_parallel_sharding_strategy=strategy), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4), [chunk])
    chunk.config = dataclasses.replace(chunk.config, no_sync_func=chunk.no_sync,
                                       finalize_model_grads_func=finalize_model_grads)
    generator = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        output = model(tokens[:, :-1], torch.arange(args.seq).expand(tokens.shape[0], -1), labels=tokens[:, 1:])
        return output, lambda loss: (loss.sum(), loss.numel() * torch.ones(()), {"lm loss": loss.detach().mean()})

    for step in range(args.steps + 1):
        if step == 1:  # the first step's counters include nothing special, but skip it as warm-up
            chunk.module.reset_communication_counters()
            chunk.module.schedule.peak_transient_bytes = 0
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        batches = [torch.randint(0, 1024, (2, args.seq + 1), generator=generator) for _ in range(args.microbatches)]
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[chunk],
                                    num_microbatches=args.microbatches, seq_length=args.seq, micro_batch_size=2)
        optimizer.step()
    traffic = chunk.communication_report()
    memory = chunk.module.memory_report()
    parallel_state.destroy_model_parallel()
    return {kind: value / args.steps for kind, value in traffic.items() if kind != "steps"}, memory


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun (PP=2 x DP=2): "
                         "torchrun --nproc-per-node 4 -m examples.megatron_fsdp.pipeline_gather_cost")
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    rows = []
    for strategy in ("optim_grads", "optim_grads_params"):
        traffic, memory = _train(strategy, args)
        rows.append((strategy, traffic, memory))
    if dist.get_rank() == 0:
        mib = 1 << 20
        print(f"stage 0 of PP=2 x DP=2, {args.layers} layers, hidden {args.hidden}, {args.microbatches} microbatches")
        print("| strategy | all-gather MiB/step | reduce-scatter MiB/step | persistent MiB | transient peak MiB |")
        print("|---|---|---|---|---|")
        for strategy, traffic, memory in rows:
            print(f"| {strategy} | {traffic['all_gather'] / mib:.2f} | {traffic['reduce_scatter'] / mib:.2f} | "
                  f"{memory['total_persistent'] / mib:.2f} | {memory['transient_peak'] / mib:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
