"""Knowledge distillation with nvidia-modelopt through pretrain(): the student (the model the pretrain_gpt.py
flags describe) learns from a teacher loaded from a checkpoint.

    torchrun --nproc-per-node N examples/post_training/distill.py <the student's pretrain_gpt.py flags> \
        --export-kd-teacher-load TEACHER [--export-kd-cfg distill.yaml] --save STUDENT ...

The teacher's architecture comes from the arguments saved in its torch_dist checkpoint (`--export-kd-teacher-load`,
any layout), the parallel layout from this run. modelopt's Megatron distillation plugin builds the criterion
(`setup_distillation_config`: by default a logits KL divergence between `output_layer` outputs, temperature 1,
vocabulary-parallel over the tensor-parallel group; `--export-kd-cfg` is its YAML file: `logit_layers`,
`intermediate_layer_pairs`, `skip_lm_loss`, `kd_loss_scale`, `logit_kl_temperature`) and `mtd.convert` wraps
the student in a `DistillationModel` that runs the frozen teacher first. The loss backpropagated is the
balancer's `kd_loss` summed over the unmasked tokens; every --log-interval iterations a `distillation | ... |
kd loss per token` line shows it, and the training log line the student's language-model loss (`lm loss`). Checkpoints hold the student only. One pipeline stage (distillation across pipeline
stages exchanges student and teacher activations together, which the schedules here do not do).
"""

import copy
import os
import sys
from functools import partial

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import pretrain_gpt  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training.global_vars import get_args  # noqa: E402

# The teacher's architecture flags, taken from the arguments saved with its checkpoint.
TEACHER_ARCHITECTURE = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "group_query_attention",
    "kv_channels", "normalization", "swiglu", "squared_relu", "add_bias_linear", "qk_layernorm",
    "untie_embeddings_and_output_weights", "position_embedding_type", "rotary_percent", "rotary_base",
    "use_rope_scaling", "rope_scaling_factor", "apply_layernorm_1p", "layernorm_epsilon", "max_position_embeddings",
)


def add_distillation_arguments(parser):
    group = parser.add_argument_group("knowledge distillation")
    group.add_argument("--export-kd-teacher-load", default=None,
                       help="torch_dist checkpoint of the teacher model (its architecture is read from it).")
    group.add_argument("--export-kd-cfg", default=None,
                       help="YAML file of modelopt's DistillationConfig; default: logits KL divergence only.")
    return parser


def _check_arguments(args):
    if args.export_kd_teacher_load is None:
        raise ValueError("distill.py needs --export-kd-teacher-load: the teacher's torch_dist checkpoint")
    if args.export_kd_cfg is not None and not os.path.isfile(args.export_kd_cfg):
        raise FileNotFoundError(f"--export-kd-cfg {args.export_kd_cfg}: no such file (a YAML file of modelopt's "
                                "DistillationConfig; drop the flag for the default logits KL divergence)")
    if args.pipeline_model_parallel_size != 1:
        raise ValueError("distill.py runs with --pipeline-model-parallel-size 1 (student and teacher activations "
                         "are not exchanged between pipeline stages here)")
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        raise ValueError("distill.py runs under Megatron DDP (drop --use-megatron-fsdp / --use-torch-fsdp2): the FSDP "
                         "wrappers would shard the frozen teacher with the student")


def teacher_arguments(args):
    """A copy of this run's arguments with the teacher checkpoint's architecture (and --load pointing at it)."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.checkpoint_directory import published_directory, read_tracker

    root = args.export_kd_teacher_load
    iteration = read_tracker(root)
    if iteration is None:
        raise FileNotFoundError(f"--export-kd-teacher-load {root}: no complete checkpoint (no tracker file)")
    directory, _ = published_directory(root, iteration)
    saved_args = serialization.read_objects(directory, ["common"])["common"].get("args")
    if saved_args is None:
        raise ValueError(f"--export-kd-teacher-load {root}: the checkpoint holds no arguments to build the teacher from")
    teacher_args = copy.copy(args)
    for name in TEACHER_ARCHITECTURE:
        if hasattr(saved_args, name):
            setattr(teacher_args, name, getattr(saved_args, name))
    teacher_args.load, teacher_args.finetune, teacher_args.no_load_rng = root, True, True
    return teacher_args


def build_teacher(args):
    """The teacher GPTModel with its checkpoint's weights, frozen and in eval mode."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training import checkpointing
    from megatron.training.model_config import core_transformer_config_from_args

    teacher_args = teacher_arguments(args)
    teacher = GPTModel(
        config=core_transformer_config_from_args(teacher_args),
        vocab_size=teacher_args.padded_vocab_size,
        max_sequence_length=teacher_args.max_position_embeddings,
        share_embeddings_and_output_weights=not teacher_args.untie_embeddings_and_output_weights,
        position_embedding_type=teacher_args.position_embedding_type,
        rotary_percent=teacher_args.rotary_percent,
        rotary_base=teacher_args.rotary_base,
        rope_scaling=teacher_args.use_rope_scaling,
        rope_scaling_factor=teacher_args.rope_scaling_factor,
    ).to(args.device)
    checkpointing.load_checkpoint([teacher], None, None, teacher_args)
    return teacher.eval().requires_grad_(False)


def model_provider(pre_process=True, post_process=True):
    """The student (pretrain_gpt's model) wrapped by modelopt for distillation from the teacher."""
    import modelopt.torch.distill as mtd
    from modelopt.torch.distill.plugins.megatron import setup_distillation_config

    args = get_args()
    _check_arguments(args)
    student = pretrain_gpt.model_provider(pre_process, post_process)
    teacher = build_teacher(args)
    distill_cfg = setup_distillation_config(args.export_kd_cfg, student.config, teacher.config)
    kd_config = {"teacher_model": teacher, "criterion": distill_cfg.criterion,
                 "loss_balancer": distill_cfg.loss_balancer}
    return mtd.convert(student, mode=[("kd_loss", kd_config)])


def _masked_sum(loss_mask, loss_and_flags):
    """A distillation loss `[b, s]` summed over the unmasked tokens (and over tensor-parallel ranks when each
    holds a part of the vocabulary's sum)."""
    loss, tp_reduce, _ = loss_and_flags if isinstance(loss_and_flags, tuple) else (loss_and_flags, False, False)
    total = torch.sum(loss.float().reshape(-1) * loss_mask.float().reshape(-1))
    if tp_reduce and parallel_state.get_tensor_model_parallel_world_size() > 1:
        total = torch.distributed.nn.functional.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    return total


class _KdLossLog:
    """Prints the distillation loss per token every --log-interval training iterations (the training log line
    shows the student's lm loss), summed over the data-parallel ranks."""

    def __init__(self):
        self.sums = torch.zeros(2, dtype=torch.float64)
        self.microbatches = 0

    def add(self, kd_loss_sum, num_tokens):
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        args = get_args()
        self.sums += torch.stack([kd_loss_sum.detach().double().cpu(), num_tokens.detach().double().cpu()])
        self.microbatches += 1
        per_iteration = get_num_microbatches()
        if self.microbatches % (per_iteration * args.log_interval):
            return
        totals = self.sums.to(args.device)
        torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            print(f"distillation | iteration {self.microbatches // per_iteration} | kd loss per token "
                  f"{(totals[0] / totals[1]).item():.6f}", flush=True)
        self.sums.zero_()


_kd_loss_log = _KdLossLog()


def loss_func(loss_mask, model, output_tensor):
    """(distillation loss sum, token count, reports of the lm and kd losses)."""
    from megatron.core.distributed.data_parallel_base import unwrap_model

    lm_loss_sum, num_tokens, reports = pretrain_gpt.loss_func(loss_mask, output_tensor)
    distillation_model = unwrap_model(model)
    losses = distillation_model.compute_kd_loss(student_loss=lm_loss_sum,
                                                loss_reduction_fn=partial(_masked_sum, loss_mask))
    kd_loss_sum = losses["kd_loss"]
    reports["kd loss"] = torch.stack([kd_loss_sum.detach(), reports["lm loss"][1]])
    if distillation_model.training:
        _kd_loss_log.add(kd_loss_sum, num_tokens)
    return kd_loss_sum, num_tokens, reports


def forward_step(data_iterator, model):
    batch = pretrain_gpt.get_batch(data_iterator)
    output_tensor = model(batch["tokens"], batch["position_ids"], attention_mask=batch.get("attention_mask"),
                          labels=batch["labels"])
    return output_tensor, partial(loss_func, batch["loss_mask"], model)


def main(argv=None):
    from megatron.training.training import pretrain

    return pretrain(pretrain_gpt.train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                    forward_step, extra_args_provider=add_distillation_arguments, argv=argv)


if __name__ == "__main__":
    main()
