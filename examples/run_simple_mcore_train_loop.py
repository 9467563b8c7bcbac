"""A training loop of your own over Megatron-Core's pieces, without pretrain_gpt.py.

    torchrun --nproc-per-node 2 examples/run_simple_mcore_train_loop.py                      # TP2
    torchrun --nproc-per-node 2 examples/run_simple_mcore_train_loop.py --pipeline-model-parallel-size 2 \
        --tensor-model-parallel-size 1                                                      # PP2

The steps of Megatron-Core's simple training loop, with its API names: set up the process groups and the
model-parallel random streams, build a tiny GPT, read mock data through `BlendedMegatronDatasetBuilder` and a torch
DataLoader, train with `get_forward_backward_func()` and a plain `torch.optim.Adam`, then save the model with
`dist_checkpointing.save` and load it back. It runs on CPU with gloo (the default without GPUs) and on GPUs with
NCCL; the device follows the backend. Each function is importable (the unit tests drive them).
"""

import argparse
import os
import tempfile
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import compile_helpers
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.tokenizer.tokenizer import _NullTokenizer

SEQUENCE_LENGTH = 64
VOCAB_SIZE = 100


def device():
    """The device of this rank's tensors: the accelerator under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, backend=None):
    """Join the launched world (torchrun's environment; NCCL with GPUs, else gloo) unless already in one, and
    build the model-parallel groups."""
    parallel_state.destroy_model_parallel()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)


def model_provider(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
    """A 2-layer GPT with hidden size 12 and 4 heads: this rank's pipeline stage of it.

    Dropout is off so that runs at different layouts can be compared loss for loss; the output layer has its own
    weight (upstream GPTModel's default), so pipeline stages need no shared-embedding synchronisation.
    """
    config = TransformerConfig(
        num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size, hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQUENCE_LENGTH, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(), share_embeddings_and_output_weights=False,
    )
    return model.to(device())


def get_train_data_iterator(micro_batch_size=8, num_samples=1000, seed=0):
    """Batches of mock token ids, in the same shuffled order on every rank."""
    if dist.is_initialized():
        if dist.get_rank() == 0:
            compile_helpers()
        dist.barrier()
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=SEQUENCE_LENGTH, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, tokenizer=_NullTokenizer(vocab_size=64),
    )
    train, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [num_samples, None, None], lambda: True,
                                                config).build()
    loader = DataLoader(train, batch_size=micro_batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    return iter(loader)


def loss_func(loss_mask, output_tensor):
    """Mean per-token loss over the unmasked tokens."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask) / loss_mask.sum()
    return loss, {"lm loss": loss}


def forward_step_func(data_iterator, model):
    data = next(data_iterator)
    on_device = {name: tensor.to(device()) for name, tensor in data.items()}
    output_tensor = model(on_device["tokens"], on_device["position_ids"], on_device["attention_mask"],
                          labels=on_device["labels"])
    return output_tensor, partial(loss_func, on_device["loss_mask"])


def train(model, data_iterator, iterations, micro_batch_size=8, num_microbatches=1, lr=1e-3):
    """`iterations` steps of Adam at learning rate `lr`; returns the mean 'lm loss' of each step on the last
    pipeline stage (an empty list on the other stages)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    forward_backward_func = get_forward_backward_func()
    losses = []
    for _ in range(iterations):
        optimizer.zero_grad()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, seq_length=SEQUENCE_LENGTH, micro_batch_size=micro_batch_size,
            decoder_seq_length=SEQUENCE_LENGTH, forward_only=False,
        )
        optimizer.step()
        if losses_reduced:
            losses.append(sum(float(entry["lm loss"].detach()) for entry in losses_reduced) / len(losses_reduced))
    return losses


def save_distributed_checkpoint(checkpoint_path, gpt_model):
    dist_checkpointing.save(sharded_state_dict=gpt_model.sharded_state_dict(prefix=""), checkpoint_dir=checkpoint_path)


def load_distributed_checkpoint(checkpoint_path, gpt_model):
    state_dict = dist_checkpointing.load(sharded_state_dict=gpt_model.sharded_state_dict(prefix=""),
                                         checkpoint_dir=checkpoint_path)
    gpt_model.load_state_dict(state_dict)
    return gpt_model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensor-model-parallel-size", type=int, default=2)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--train-iters", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--num-microbatches", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None)
    parser.add_argument("--save", default=None, help="checkpoint directory (default: a new temporary one)")
    args = parser.parse_args()

    initialize_distributed(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                           args.distributed_backend)
    model_parallel_cuda_manual_seed(123)
    gpt_model = model_provider(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    losses = train(gpt_model, get_train_data_iterator(args.micro_batch_size), args.train_iters,
                   args.micro_batch_size, args.num_microbatches, args.lr)
    for iteration, loss in enumerate(losses, start=1):
        print(f"rank {dist.get_rank()} iteration {iteration} lm loss {loss:.6f}", flush=True)

    checkpoint_path = args.save
    if checkpoint_path is None:
        checkpoint_path = [tempfile.mkdtemp(prefix="simple_mcore_ckpt_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(checkpoint_path, src=0)
        checkpoint_path = checkpoint_path[0]
    save_distributed_checkpoint(checkpoint_path=checkpoint_path, gpt_model=gpt_model)
    load_distributed_checkpoint(checkpoint_path=checkpoint_path, gpt_model=gpt_model)
    if dist.get_rank() == 0:
        print(f"saved and loaded the model: {checkpoint_path}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
