"""What training reports: Megatron's log line, throughput and memory lines, TensorBoard / W&B scalars and a
JSON-lines metrics file (one record per iteration, read by the functional tests).

The log line and the metrics file are written by the last rank, which holds the loss (every rank computes the
same reported loss, averaged over data-parallel ranks, so any rank would do).
"""

import json
import math
import os

import torch

from megatron.core.distributed.data_parallel_base import (
    DataParallelWrapper,
    parameter_and_grad_bytes,
    storage_key,
    tensor_bytes,
)
from megatron.core.ssm.mamba_config import mamba_heads
from megatron.training import accelerator
from megatron.training.energy_monitor import EnergyMonitor, energy_and_power_per_gpu
from megatron.training.expert_memory import expert_memory_usage, format_expert_memory
from megatron.training.global_state import set_energy_monitor, set_scalar_writers
from megatron.training.host_memory import format_host_memory, host_offload_bytes, offload_copy_bytes
from megatron.training.scalar_writers import ScalarWriters, build_scalar_writers

# Timers reported at each log interval (those above --timing-log-level never run and are left out).
TIMERS_TO_LOG = (
    "forward-backward",
    "forward-compute",
    "backward-compute",
    "batch-generator",
    "forward-recv",
    "forward-send",
    "backward-recv",
    "backward-send",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "all-grads-sync",
    "params-all-gather",
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer",
)

# --log-memory-to-tensorboard: `memory_usage` key -> scalar name (upstream's names for allocated and peak bytes, as
# in the metrics file).
TENSORBOARD_MEMORY_KEYS = (
    ("params_bytes", "mem-params-bytes"),
    ("grads_bytes", "mem-grads-bytes"),
    ("optimizer_state_bytes", "mem-optimizer-state-bytes"),
    ("allocated_bytes", "mem-allocated-bytes"),
    ("peak_bytes", "mem-max-allocated-bytes"),
)

# --moe-per-layer-logging: upstream's TensorBoard tags for each MoE layer's losses, `moe/<name>_layer_<i>`.
MOE_PER_LAYER_PREFIX = "moe/"


def counts_as_nan_iteration(loss, skipped: bool) -> bool:
    """Whether an iteration counts in the log line's "number of nan iterations": as upstream, one whose update was
    skipped (fp16 overflow) and whose loss is NaN or infinite. A non-finite loss of an applied update is not
    counted (the loss check, --check-for-nan-in-loss-and-grad, is what reports it), nor is a batch without a loss
    (None: every token masked)."""
    return skipped and loss is not None and not math.isfinite(loss)


def reported_learning_rates(param_groups):
    """(learning rate, decoupled learning rate or None) of the optimizer's groups, as upstream logs them: the first
    group without a learning rate of its own (`max_lr`, set for --decoupled-lr's groups) and the first with one."""
    decoupled = [group["lr"] for group in param_groups if "max_lr" in group]
    regular = [group["lr"] for group in param_groups if "max_lr" not in group]
    learning_rate = regular[0] if regular else param_groups[0]["lr"]
    return learning_rate, (decoupled[0] if decoupled else None)


def format_log_line(
    iteration,
    train_iters,
    consumed_samples,
    elapsed_ms_per_iteration,
    learning_rate,
    global_batch_size,
    losses,
    loss_scale,
    grad_norm,
    num_zeros,
    skipped_iterations,
    nan_iterations,
    params_norm=None,
    decoupled_learning_rate=None,
    max_attention_logit=None,
    throughput_tflops_per_gpu=None,
    energy=None,
    skipped_samples=0,
):
    """Megatron's training log line: `iteration 10/ 100 | consumed samples: 320 | ... | number of nan
    iterations: 0 |`, its fields in upstream's order, each loss as `1.034E+01`. `losses` maps a name ("lm loss")
    to its value (empty when every iteration of the interval was skipped: no loss is shown, as upstream);
    `grad_norm` / `num_zeros` / `params_norm` may be None. `throughput_tflops_per_gpu` (--log-throughput) and `energy`
    (--log-energy: joules per iteration and watts, per GPU) follow the iteration time when given;
    `skipped_samples` (the batches --iterations-to-skip dropped, counted among the consumed ones) follows the
    consumed samples once it is not 0, as upstream.
    """
    fields = [f"iteration {iteration}/ {train_iters}", f"consumed samples: {consumed_samples}"]
    if skipped_samples:
        fields.append(f"skipped samples: {skipped_samples}")
    fields.append(f"elapsed time per iteration (ms): {elapsed_ms_per_iteration:.1f}")
    if throughput_tflops_per_gpu is not None:
        fields.append(f"throughput per GPU (TFLOP/s/GPU): {throughput_tflops_per_gpu:.1f}")
    if energy is not None:
        joules_per_iteration, watts = energy
        fields += [f"energy per GPU (J/iter/GPU): {joules_per_iteration:.1f}", f"power per GPU (W/GPU): {watts:.1f}"]
    fields.append(f"learning rate: {learning_rate:.6E}")
    if decoupled_learning_rate is not None:
        fields.append(f"decoupled learning rate: {decoupled_learning_rate:.6E}")
    fields += [
        f"global batch size: {global_batch_size}",
    ]
    fields += [f"{name}: {value:.3E}" for name, value in losses.items()]
    fields.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        fields.append(f"grad norm: {grad_norm:.3f}")
    if num_zeros is not None:
        fields.append(f"num zeros: {num_zeros:.1f}")
    if params_norm is not None:
        fields.append(f"params norm: {params_norm:.3f}")
    if max_attention_logit is not None:
        fields.append(f"max attention logit: {max_attention_logit:.3f}")
    fields.append(f"number of skipped iterations: {skipped_iterations}")
    fields.append(f"number of nan iterations: {nan_iterations}")
    return " | ".join(fields) + " |"


def format_throughput_line(tokens_per_second, num_ranks, tflops_per_rank):
    return (
        f"throughput | tokens/s: {tokens_per_second:.1f} | tokens/s per rank: {tokens_per_second / num_ranks:.1f} "
        f"| estimated TFLOP/s per rank: {tflops_per_rank:.4f} |"
    )


def format_memory_line(rank, memory):
    peak_name = "max allocated" if memory["on_gpu"] else "peak RSS"
    return (
        f"memory (rank {rank}) | params: {memory['params_bytes']} bytes | grads: {memory['grads_bytes']} bytes "
        f"| optimizer state: {memory['optimizer_state_bytes']} bytes | {peak_name}: {memory['peak_bytes']} bytes |"
        + format_expert_memory(memory)
        + format_host_memory(memory)
    )


def training_flops_per_iteration(args, global_batch_size):
    """Estimated matmul FLOPs of one iteration over all ranks, as upstream's `num_floating_point_operations`
    counts them: each matmul runs three times (forward, then the data and weight gradients), causal attention
    multiplies half of the score matrix, MoE routers are not counted, and neither is activation recompute."""
    hidden, layers, seq = args.hidden_size, args.num_layers, args.seq_length
    heads_width = args.kv_channels * args.num_attention_heads
    key_value_width = args.kv_channels * getattr(args, "num_query_groups", args.num_attention_heads)
    mlp_matrices = 3 if args.swiglu or getattr(args, "quick_geglu", False) else 2  # gated: gate, up, down
    attention = (
        2 * hidden * (heads_width + 2 * key_value_width)  # QKV projection (fewer key/value heads with GQA)
        + 2 * heads_width * hidden  # attention output projection
        + 2 * seq * heads_width  # scores and weighted sum over the sequence, halved by the causal mask
    )
    if getattr(args, "attention_output_gate", False):
        attention += 2 * hidden * heads_width  # the gate's rows of the QKV projection, one per query channel
    if getattr(args, "multi_latent_attention", False):
        from megatron.training.argument_groups.mla import attention_flops_per_token

        attention = attention_flops_per_token(args)
    heterogeneous_layers = getattr(args, "heterogeneous_layers_config_encoded_json", None)
    if heterogeneous_layers is not None:  # each layer with its own query groups and MLP width, or neither
        layer_flops = _heterogeneous_layer_flops(args, heterogeneous_layers, mlp_matrices)
        return 3 * (sum(layer_flops) + 2 * hidden * args.padded_vocab_size) * seq * global_batch_size
    mlp_per_layer = _mlp_flops_per_layer(args, mlp_matrices)
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern is not None:  # a hybrid model: each layer is a Mamba, an attention, an MLP or a MoE layer
        mamba = _mamba_flops_per_token(args)
        layer_flops = [mamba if symbol == "M" else attention if symbol == "*" else mlp_per_layer[index]
                       for index, symbol in enumerate(pattern)]
        return 3 * (sum(layer_flops) + 2 * hidden * args.padded_vocab_size) * seq * global_batch_size
    per_token_forward = (layers * attention + sum(mlp_per_layer)
                         + 2 * hidden * args.padded_vocab_size)  # logits
    mtp_depths = getattr(args, "mtp_num_layers", None) or 0
    # Each multi-token prediction depth: its three norms (counted as upstream does, 2 FLOPs per element), the
    # projection of [embedding, hidden] (2h -> h), one layer of the decoder's last layer's kind, and its own logits.
    per_token_forward += mtp_depths * (2 * 3 * hidden + 2 * 2 * hidden * hidden + attention + mlp_per_layer[-1]
                                       + 2 * hidden * args.padded_vocab_size)
    return 3 * per_token_forward * seq * global_batch_size


def _heterogeneous_layer_flops(args, config_text, mlp_matrices):
    """Forward FLOPs of one token in each layer of a heterogeneous model: its attention with its own key/value
    heads, its MLP of its own width, a linear stand-in (hidden x hidden) for either, nothing for a dropped one."""
    import json

    from megatron.core.transformer.heterogeneous.block_configs import parse_block_configs

    hidden, heads_width = args.hidden_size, args.kv_channels * args.num_attention_heads
    blocks = parse_block_configs(json.loads(config_text)["block_configs"], hidden_size=hidden,
                                 num_attention_heads=args.num_attention_heads, source="the heterogeneous layers")
    linear = 2 * hidden * hidden
    flops = []
    for block in blocks:
        attention = mlp = 0
        if block.attention.is_attention:
            key_value_width = args.kv_channels * block.attention.num_query_groups
            attention = (2 * hidden * (heads_width + 2 * key_value_width) + 2 * heads_width * hidden
                         + 2 * args.seq_length * heads_width)
        elif block.attention.replace_with_linear:
            attention = linear
        if block.mlp.is_mlp:
            mlp = 2 * mlp_matrices * hidden * block.mlp.ffn_hidden_size
        elif block.mlp.replace_with_linear:
            mlp = linear
        flops.append(attention + mlp)
    return flops


def _mamba_flops_per_token(args):
    """Forward FLOPs of one token in a Mamba layer: the input projection (z, x, B, C, dt), the scan (7 x inner
    width x state size) and the output projection."""
    heads = mamba_heads(args.hidden_size, args.mamba_head_dim, args.mamba_num_heads)
    inner = heads * args.mamba_head_dim
    in_proj = 2 * args.hidden_size * (2 * inner + 2 * args.mamba_num_groups * args.mamba_state_dim + heads)
    return in_proj + 7 * inner * args.mamba_state_dim + 2 * inner * args.hidden_size


def _mlp_flops_per_layer(args, mlp_matrices):
    """Forward MLP FLOPs of one token in each decoder layer: dense MLPs, and on MoE layers the top-k experts it
    goes through and the shared experts (not the router, as upstream). Under --moe-latent-size the experts read
    and write the latent width, and the two latent projections (hidden -> latent -> hidden) count once per token."""
    dense = 2 * mlp_matrices * args.hidden_size * args.ffn_hidden_size
    if getattr(args, "num_experts", None) is None:
        return [dense] * args.num_layers
    from megatron.core.transformer.moe.moe_config import layer_pattern_from_freq

    expert_width = (args.moe_ffn_hidden_size or args.ffn_hidden_size) * args.moe_router_topk
    latent = getattr(args, "moe_latent_size", None)
    moe = (2 * mlp_matrices * (latent or args.hidden_size) * expert_width
           + 2 * mlp_matrices * args.hidden_size * (args.moe_shared_expert_intermediate_size or 0))
    if latent:
        moe += 2 * 2 * args.hidden_size * latent
    pattern = layer_pattern_from_freq(args.moe_layer_freq, args.num_layers)
    return [moe if is_moe else dense for is_moe in pattern]


def _torch_optimizers(optimizer):
    """The torch.optim optimizers inside Megatron's wrappers (chained or not)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    found = []
    for chained in getattr(optimizer, "chained_optimizers", []) or []:
        found += _torch_optimizers(chained)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        found += _torch_optimizers(inner)
    return found


def _optimizer_state_bytes(optimizer, model_params):
    """Bytes of the torch optimizers' state tensors plus their parameters that are not model parameters (main
    fp32 copies, or shards of them). A parameter is a model parameter when it is one, or shares its memory with
    one (compared by the local tensor's storage, which also tells DTensors apart)."""
    model_param_ids = {id(param) for param in model_params}
    model_param_storages = {storage_key(param) for param in model_params} - {None}
    total = 0
    for torch_optimizer in _torch_optimizers(optimizer):
        for state in torch_optimizer.state.values():
            total += sum(tensor_bytes(v) for v in state.values() if torch.is_tensor(v))
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in model_param_ids and storage_key(param) not in model_param_storages:
                    total += tensor_bytes(param)
    return total


def memory_usage(model_chunks, optimizer, device):
    """Bytes this rank holds in parameters, gradients and optimizer state (incl. main parameter copies).

    A model chunk that shards its state (Megatron-FSDP, FSDP2) reports it through `chunk.state_bytes()`, a dict
    of this rank's persistent bytes: `params_bytes` (compute weights held between steps), `grads_bytes`
    (gradient buffers) and, when the wrapper knows it, `optimizer_state_bytes` (main weights that are not the
    compute weights plus the optimizer's state tensors); without that key the optimizer's bytes are counted from
    the torch optimizer. DDP chunks are counted from their parameters and `main_grad` buffers. With offloading on,
    `host_offload_bytes` is what it keeps in host memory (see host_memory.py); `--optimizer-cpu-offload`'s host
    gradients and host copies of main parameters are added to grads and optimizer state (`offload_copy_bytes`).
    """
    params_bytes = grads_bytes = 0
    optimizer_state_bytes = None
    for chunk in model_chunks:
        # A data-parallel wrapper accounts for its own state; a bare module is counted the way DDP counts itself.
        report = chunk.state_bytes() if isinstance(chunk, DataParallelWrapper) else parameter_and_grad_bytes(chunk)
        params_bytes += report["params_bytes"]
        grads_bytes += report["grads_bytes"]
        if "optimizer_state_bytes" in report:
            optimizer_state_bytes = (optimizer_state_bytes or 0) + report["optimizer_state_bytes"]
    if optimizer_state_bytes is None:
        model_params = [param for chunk in model_chunks for param in chunk.parameters()]
        optimizer_state_bytes = _optimizer_state_bytes(optimizer, model_params)
    offload_copies = offload_copy_bytes(_torch_optimizers(optimizer))
    grads_bytes += offload_copies["grads_bytes"]
    optimizer_state_bytes += offload_copies["optimizer_state_bytes"]
    allocated = accelerator.allocated_memory_bytes(device)
    host_bytes = host_offload_bytes(model_chunks, _torch_optimizers(optimizer))
    return {
        "on_gpu": device.type == "cuda",
        "params_bytes": params_bytes,
        "grads_bytes": grads_bytes,
        "optimizer_state_bytes": optimizer_state_bytes,
        "allocated_bytes": allocated if allocated is not None else params_bytes + grads_bytes + optimizer_state_bytes,
        "peak_bytes": accelerator.peak_memory_bytes(device),
        # The part of the above that is Mixture-of-Experts experts (no keys without experts).
        **expert_memory_usage(model_chunks, _torch_optimizers(optimizer)),
        # Bytes offloading keeps in host memory (no key without offloading; host_memory.py).
        **({"host_offload_bytes": host_bytes} if host_bytes is not None else {}),
    }


def moe_aux_losses(args):
    """The MoE routers' auxiliary losses of the last iteration, {name: value}: each loss (e.g.
    `load_balancing_loss`) averaged over the MoE layers and microbatches, without its coefficient, and with
    --moe-per-layer-logging each MoE layer's value under upstream's TensorBoard tag `moe/<name>_layer_<i>` (i the
    0-based global layer index). Collective over the world when the model has experts; {} otherwise."""
    if getattr(args, "num_experts", None) is None:
        return {}
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer.moe import moe_utils

    names = moe_utils.tracked_aux_loss_names(args.moe_router_load_balancing_type, args.moe_aux_loss_coeff,
                                             args.moe_z_loss_coeff)
    num_layers, num_moe_layers = moe_utils.aux_loss_layer_counts(args.num_layers, args.moe_layer_freq,
                                                                 getattr(args, "mtp_num_layers", None))
    values = moe_utils.reduce_aux_losses_for_logging(names, num_layers, num_moe_layers, get_num_microbatches(),
                                                     args.data_parallel_size, args.device)
    return {key if key in names else f"{MOE_PER_LAYER_PREFIX}{key}": value for key, value in values.items()}


def mtp_losses(args):
    """Each multi-token-prediction depth's loss of the last iteration, {`mtp_{k} loss`: value} (token-weighted
    mean over microbatches and data-parallel ranks; upstream's names). Collective over the world with
    --mtp-num-layers; {} otherwise."""
    if not getattr(args, "mtp_num_layers", None):
        return {}
    from megatron.core.transformer.multi_token_prediction import reduce_mtp_losses_for_logging

    return reduce_mtp_losses_for_logging(args.mtp_num_layers, args.device)


def default_metrics_path(args):
    if args.metrics_file:
        return args.metrics_file
    directory = args.tensorboard_dir or args.save
    return os.path.join(directory, "metrics.jsonl") if directory else None


class TrainingLogger:
    """Collects per-iteration results and writes the log lines, TensorBoard scalars and metrics records."""

    def __init__(self, args, is_logging_rank, timers=None):
        self.args = args
        self.is_logging_rank = is_logging_rank
        self.timers = timers
        self._energy = EnergyMonitor.from_args(args)
        if self._energy is not None:
            set_energy_monitor(self._energy)  # get_energy_monitor(), while training runs
        self._interval_losses = {}  # sums over the interval's iterations whose update was applied
        self._interval_loss_counts = {}  # how many iterations each sum holds (a loss may be None: no token)
        self._interval_iterations = 0
        self._interval_time_s = 0.0
        self._skipped_iterations = 0
        self._nan_iterations = 0
        self._memory_line_printed = False
        self._metrics_stream = None
        self._tensorboard = None
        if not is_logging_rank:
            return
        metrics_path = default_metrics_path(args)
        if metrics_path:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_path)), exist_ok=True)
            # Appending lets a resumed run continue the record of the run it resumes.
            self._metrics_stream = open(metrics_path, "a")
        # TensorBoard and/or Weights & Biases, fed the same scalars (scalar_writers.py), and shared with scripts
        # through get_tensorboard_writer() / get_wandb_writer() while training runs.
        self._tensorboard = build_scalar_writers(args)
        if isinstance(self._tensorboard, ScalarWriters):
            set_scalar_writers(*self._tensorboard.shared_writers())

    def log_iteration(self, report):
        """`report`: iteration, losses (dict), learning_rate, loss_scale, grad_norm, num_zeros, skipped, nan,
        iteration_time_s, consumed_samples, global_batch_size, memory (`memory_usage`'s dict, or a function
        returning it, called only when this iteration reports memory), rank."""
        args = self.args
        iteration = report["iteration"]
        # Collectives: every rank logs.
        losses = {**report["losses"], **moe_aux_losses(args), **mtp_losses(args)}
        # As upstream, the per-layer MoE losses go to TensorBoard (and the metrics file), not to the log line.
        report["moe_per_layer_losses"] = {tag: value for tag, value in losses.items()
                                          if tag.startswith(MOE_PER_LAYER_PREFIX)}
        report["losses"] = {name: value for name, value in losses.items() if name not in report["moe_per_layer_losses"]}
        # As upstream, the log line's losses average the iterations whose update was applied: a skipped one (fp16
        # overflow) may have a non-finite loss, and its step changed nothing.
        # A loss of None (a global batch whose tokens were all masked) has no value to average: the line's mean
        # leaves that iteration out, and leaves the loss out when no iteration of the interval had one.
        if not report["skipped"]:
            for name, value in report["losses"].items():
                if value is not None:
                    self._interval_losses[name] = self._interval_losses.get(name, 0.0) + value
                    self._interval_loss_counts[name] = self._interval_loss_counts.get(name, 0) + 1
        self._interval_iterations += 1
        self._interval_time_s += report["iteration_time_s"]
        self._skipped_iterations += int(report["skipped"])
        self._nan_iterations += int(report["nan"])
        if callable(report["memory"]):
            report["memory"] = _Once(report["memory"])
        if self.is_logging_rank:
            self._write_metrics_record(report)
            self._write_tensorboard(report)
        timers_due = self.timers is not None and args.log_timers_to_tensorboard
        if timers_due and iteration % args.tensorboard_log_interval == 0:
            # Collective. The mean per iteration since the last log line, not reset: the log line reports it too.
            self.timers.write(TIMERS_TO_LOG, self._tensorboard, iteration, normalizer=self._interval_iterations,
                              reset=False)
        if iteration % args.log_interval != 0:
            return
        energy_joules = self._energy.lap() if self._energy is not None else None  # collective
        show_memory = args.log_memory_to_tensorboard or not self._memory_line_printed
        if show_memory and (self.is_logging_rank or report.get("print_memory_on_this_rank", False)):
            print(format_memory_line(report["rank"], _resolved(report["memory"])), flush=True)
        self._memory_line_printed = True
        if self.is_logging_rank:
            count = self._interval_iterations
            elapsed_s = self._interval_time_s / count
            tflops_per_rank = None
            if args.log_throughput:
                flops = training_flops_per_iteration(args, report["global_batch_size"])
                tflops_per_rank = flops / elapsed_s / args.world_size / 1e12
            energy = None
            if energy_joules is not None:
                energy = energy_and_power_per_gpu(energy_joules, count, args.world_size, elapsed_s)
            line = format_log_line(
                iteration=iteration,
                train_iters=args.train_iters,
                consumed_samples=report["consumed_samples"],
                skipped_samples=report.get("skipped_samples", 0),
                elapsed_ms_per_iteration=elapsed_s * 1000.0,
                learning_rate=report["learning_rate"],
                global_batch_size=report["global_batch_size"],
                losses={name: total / self._interval_loss_counts[name]
                        for name, total in self._interval_losses.items()},
                loss_scale=report["loss_scale"],
                grad_norm=report["grad_norm"],
                num_zeros=report["num_zeros"],
                skipped_iterations=self._skipped_iterations,
                nan_iterations=self._nan_iterations,
                params_norm=report.get("params_norm"),
                decoupled_learning_rate=report.get("decoupled_learning_rate"),
                max_attention_logit=report.get("max_attention_logit"),
                throughput_tflops_per_gpu=tflops_per_rank,
                energy=energy,
            )
            print(line, flush=True)
            if self._tensorboard is not None and getattr(args, "log_timers_to_tensorboard", False):
                self._tensorboard.add_scalar("iteration-time", elapsed_s, iteration)  # as upstream: the line's mean
            if energy is not None and self._tensorboard is not None:
                self._tensorboard.add_scalar("iter-energy/gpu", energy[0], iteration)  # upstream's keys
                self._tensorboard.add_scalar("power/gpu", energy[1], iteration)
            if args.log_throughput:
                tokens_per_second = report["global_batch_size"] * args.seq_length / elapsed_s
                print(format_throughput_line(tokens_per_second, args.world_size, tflops_per_rank), flush=True)
                if self._tensorboard is not None:
                    self._tensorboard.add_scalar("throughput-tokens-per-second", tokens_per_second, iteration)
                    self._tensorboard.add_scalar("throughput", tflops_per_rank, iteration)  # upstream's key
        if self.timers is not None:
            self.timers.log(TIMERS_TO_LOG, normalizer=self._interval_iterations)  # collective: every rank calls it
        self._interval_losses, self._interval_iterations, self._interval_time_s = {}, 0, 0.0
        self._interval_loss_counts = {}
        self._skipped_iterations, self._nan_iterations = 0, 0

    def log_evaluation(self, iteration, losses, prefix="validation", set_label=None, where=None,
                       write_to_tensorboard=True):
        """One "<prefix> loss at iteration N" block ("validation loss at iteration N on test set" for the test set, as
        upstream); `set_label` (--multiple-validation-sets) names the set:
        "validation (b_text_document) loss ...", TensorBoard "lm loss validation (b_text_document)", and a
        "validation-set" field in the metrics record (whose "split" stays `prefix`). `where` ("on validation
        set", "on test set": the evaluation after the last iteration) follows the iteration in the line and is
        the metrics record's "when". `write_to_tensorboard` False (--skip-train, as upstream) leaves the scalar
        writers out."""
        if not self.is_logging_rank:
            return
        shown = prefix if set_label is None else f"{prefix} ({set_label})"
        text = " | ".join(f"{name} value: {value:.6E} | {name} PPL: {_perplexity(value):.6E}" for name, value in
                          losses.items())
        at = f"iteration {iteration}" if where is None else f"iteration {iteration} {where}"
        # Upstream's line starts "validation loss at" for the test set too ("... at iteration N on test set"); the
        # TensorBoard tags and metrics records keep the split's own name.
        printed = "validation" if prefix == "test" else shown
        print(f"{printed} loss at {at} | {text} |", flush=True)
        if self._tensorboard is not None and write_to_tensorboard:
            samples = getattr(self.args, "consumed_train_samples", None)
            with_perplexity = getattr(self.args, "log_validation_ppl_to_tensorboard", False)
            for name, value in losses.items():
                scalars = [(f"{name} {shown}", value)]
                if with_perplexity:  # as upstream, the perplexity only on request
                    scalars.append((f"{name} {shown} ppl", _perplexity(value)))
                for key, scalar in scalars:
                    self._tensorboard.add_scalar(key, scalar, iteration)
                    if samples is not None:
                        self._tensorboard.add_scalar(f"{key} vs samples", scalar, samples)
        if self._metrics_stream is not None:
            record = {"iteration": iteration, "split": prefix}
            if set_label is not None:
                record["validation-set"] = set_label
            if where is not None:
                record["when"] = where
            record.update({f"{name}": value for name, value in losses.items()})
            self._metrics_stream.write(json.dumps(record) + "\n")
            self._metrics_stream.flush()

    def _write_metrics_record(self, report):
        if self._metrics_stream is None:
            return
        memory = _resolved(report["memory"])
        record = {
            "iteration": report["iteration"],
            "split": "train",
            **report["losses"],
            "grad norm": report["grad_norm"],
            "num-zeros": report["num_zeros"],
            "learning-rate": report["learning_rate"],
            **({"decoupled-learning-rate": report["decoupled_learning_rate"]}
               if report.get("decoupled_learning_rate") is not None else {}),
            "loss-scale": report["loss_scale"],
            "iteration-time": report["iteration_time_s"],
            "consumed-samples": report["consumed_samples"],
            "skipped": bool(report["skipped"]),
            "mem-allocated-bytes": memory["allocated_bytes"],
            "mem-max-allocated-bytes": memory["peak_bytes"],
            "params-bytes": memory["params_bytes"],
            "grads-bytes": memory["grads_bytes"],
            "optimizer-state-bytes": memory["optimizer_state_bytes"],
            **{key.replace("_", "-"): value for key, value in memory.items()
               if key.startswith("expert_") or key == "host_offload_bytes"},
            **report.get("moe_per_layer_losses", {}),  # TensorBoard's tags, `moe/<name>_layer_<i>`
        }
        if report.get("params_norm") is not None:
            record["params-norm"] = report["params_norm"]
        if report.get("max_attention_logit") is not None:
            record["max-attention-logit"] = report["max_attention_logit"]
        self._metrics_stream.write(json.dumps(record) + "\n")
        self._metrics_stream.flush()

    def _write_tensorboard(self, report):
        writer, args, iteration = self._tensorboard, self.args, report["iteration"]
        if writer is None or iteration % args.tensorboard_log_interval != 0:
            return

        def add_scalar_and_vs_samples(name, value):
            # As upstream: the scalar per iteration, and against the consumed samples for comparing runs whose
            # batch sizes differ.
            writer.add_scalar(name, value, iteration)
            writer.add_scalar(f"{name} vs samples", value, report["consumed_samples"])

        for name, value in report["losses"].items():
            if value is not None:  # None: every token masked, no loss to plot
                add_scalar_and_vs_samples(name, value)
        for tag, value in report.get("moe_per_layer_losses", {}).items():  # as upstream: per iteration only
            writer.add_scalar(tag, value, iteration)
        # Upstream's switches: learning rate and loss scale on unless turned off, batch and world size on request.
        if report.get("skipped_samples", 0) > 0:  # --iterations-to-skip, as upstream: once any batch was dropped
            writer.add_scalar("skipped-train-samples", report["skipped_samples"], iteration)
        if getattr(args, "log_learning_rate_to_tensorboard", True):
            add_scalar_and_vs_samples("learning-rate", report["learning_rate"])
            if report.get("decoupled_learning_rate") is not None:
                writer.add_scalar("decoupled-learning-rate", report["decoupled_learning_rate"], iteration)
        if getattr(args, "log_loss_scale_to_tensorboard", True):
            add_scalar_and_vs_samples("loss-scale", report["loss_scale"])
        if getattr(args, "log_batch_size_to_tensorboard", False):
            add_scalar_and_vs_samples("batch-size", report["global_batch_size"])
        if getattr(args, "log_world_size_to_tensorboard", False):
            add_scalar_and_vs_samples("world-size", args.world_size)
        if report["grad_norm"] is not None:
            add_scalar_and_vs_samples("grad-norm", report["grad_norm"])
        if report["num_zeros"] is not None:
            add_scalar_and_vs_samples("num-zeros", report["num_zeros"])
        if report.get("params_norm") is not None:
            add_scalar_and_vs_samples("params-norm", report["params_norm"])
        if report.get("max_attention_logit") is not None:
            writer.add_scalar("max-attention-logit", report["max_attention_logit"], iteration)
        if args.log_memory_to_tensorboard:
            memory = _resolved(report["memory"])
            for key, name in TENSORBOARD_MEMORY_KEYS:
                writer.add_scalar(name, memory[key], iteration)

    def close(self):
        if self._energy is not None:
            set_energy_monitor(None)
            self._energy.close()
            self._energy = None
        if self._metrics_stream is not None:
            self._metrics_stream.close()
            self._metrics_stream = None
        if self._tensorboard is not None:
            set_scalar_writers(None, None)
            self._tensorboard.flush()
            self._tensorboard.close()
            self._tensorboard = None


class _Once:
    """A function of no arguments whose result is computed on the first call and kept."""

    def __init__(self, compute):
        self._compute = compute
        self._result = None

    def __call__(self):
        if self._compute is not None:
            self._result, self._compute = self._compute(), None
        return self._result


def _resolved(memory):
    return memory() if callable(memory) else memory


def _perplexity(loss):
    """exp(loss), capped at exp(20) as upstream caps it; a NaN or infinite loss keeps its NaN or Inf."""
    if not math.isfinite(loss):
        return math.exp(loss)  # nan -> nan, inf -> inf, -inf -> 0
    return math.exp(min(20.0, loss))
