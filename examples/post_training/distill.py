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
kd loss per token` line shows it, and the training log line the student's language-model loss (`lm loss`).
Checkpoints hold the student only. One pipeline stage (distillation across pipeline stages exchanges student and
teacher activations together, which the schedules here do not do).

Both models use this run's tokenizer (a teacher of another vocabulary is refused) and this run's vocabulary
padding. In the logits losses the teacher gives the padded entries (rows its checkpoint may not even hold)
probability 0, so the student learns to give them none either, as training on the labels teaches it.
"""

import copy
import os
import sys
from functools import partial

import torch
from torch.nn.modules.loss import _Loss

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


def check_modelopt_available():
    """Raise RuntimeError with the install command where nvidia-modelopt cannot be imported."""
    from megatron.core import optional_deps

    if not optional_deps.have_modelopt():
        raise RuntimeError("distill.py needs nvidia-modelopt (its Megatron distillation plugin builds the loss and "
                           "runs the teacher): pip install -e '.[modelopt]', which also brings the requests and "
                           "huggingface_hub packages modelopt imports")


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


def _check_same_vocabulary(teacher_load, teacher_vocab_size, student_vocab_size):
    if None not in (teacher_vocab_size, student_vocab_size) and teacher_vocab_size != student_vocab_size:
        raise ValueError(f"--export-kd-teacher-load {teacher_load}: the teacher's vocabulary has {teacher_vocab_size} "
                         f"tokens, the student's (this run's tokenizer) {student_vocab_size}; distillation compares "
                         "the two models over one vocabulary: give a teacher trained with this run's tokenizer")


def _check_dense_teacher(teacher_load, saved_args):
    """The teacher is built from TEACHER_ARCHITECTURE's flags: a dense GPT with standard attention."""
    kinds = [flag for flag, on in (("--num-experts", getattr(saved_args, "num_experts", None)),
                                   ("--multi-latent-attention", getattr(saved_args, "multi_latent_attention", False)),
                                   ("--mtp-num-layers", getattr(saved_args, "mtp_num_layers", None))) if on]
    if kinds:
        raise ValueError(f"--export-kd-teacher-load {teacher_load}: the teacher was trained with {', '.join(kinds)}; "
                         "distill.py builds dense GPT teachers with standard attention and no multi-token "
                         "prediction layers: distil from such a checkpoint")


class RealVocabularyLogitsLoss(_Loss):
    """A logits distillation loss (modelopt's `LogitsKLLoss` or `TopKLogitsKLLoss`) whose teacher distribution
    covers the real vocabulary only: the teacher's padded entries get a logit far below any real one, so it gives
    them probability 0 (whatever its checkpoint held there, or did not hold), and the KL divergence drives the
    student's probability of them to 0, as the language-model loss over the padded vocabulary does. (A `_Loss`, as
    modelopt's criterion must be, whose class name keeps "Logits": modelopt's loss balancer finds the logits loss
    by it.)"""

    PADDED_LOGIT = -1e30  # divided by any temperature up to 1e27, exp() of it is 0 in fp32; finite, so the KL
    # terms of the padded entries are 0 * finite = 0, not NaN

    def __init__(self, logits_loss, vocab_size):
        super().__init__()
        self.logits_loss, self.vocab_size = logits_loss, vocab_size

    def _mask_padding(self, output):
        logits, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, None)
        local_width = logits.shape[-1]  # this tensor-parallel rank's slice of the padded vocabulary
        first = parallel_state.get_tensor_model_parallel_rank() * local_width
        padded = torch.arange(first, first + local_width, device=logits.device) >= self.vocab_size
        logits = logits.float().masked_fill(padded, self.PADDED_LOGIT)
        return logits if rest is None else (logits, *rest)

    def forward(self, predictions, targets):
        return self.logits_loss(predictions, self._mask_padding(targets))


def teacher_arguments(args):
    """A copy of this run's arguments with the teacher checkpoint's architecture (and --load pointing at it)."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.checkpoint_directory import published_directory, read_tracker
    from megatron.training.arguments import build_parser
    from megatron.training.checkpoint_args import saved_true_vocab_size, true_vocab_size
    from megatron.training.checkpoint_state import VOCAB_SIZE_KEY

    root = args.export_kd_teacher_load
    iteration = read_tracker(root)
    if iteration is None:
        raise FileNotFoundError(f"--export-kd-teacher-load {root}: no complete checkpoint (no tracker file)")
    directory, _ = published_directory(root, iteration)
    common = serialization.read_objects(directory, ["common"])["common"]
    saved_args = common.get("args")
    if saved_args is None:
        raise ValueError(f"--export-kd-teacher-load {root}: the checkpoint holds no arguments to build the teacher "
                         "from")
    _check_same_vocabulary(root, saved_true_vocab_size(common.get(VOCAB_SIZE_KEY), saved_args), true_vocab_size(args))
    _check_dense_teacher(root, saved_args)
    teacher_args = copy.copy(args)
    parser = build_parser()
    for name in TEACHER_ARCHITECTURE:
        # A flag the teacher's checkpoint predates was at its default when the teacher trained.
        setattr(teacher_args, name, getattr(saved_args, name, parser.get_default(name)))
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
    check_modelopt_available()
    import modelopt.torch.distill as mtd
    from modelopt.torch.distill.plugins.megatron import LogitsKLLoss, setup_distillation_config

    from megatron.training.checkpoint_args import true_vocab_size

    args = get_args()
    _check_arguments(args)
    student = pretrain_gpt.model_provider(pre_process, post_process)
    teacher = build_teacher(args)
    distill_cfg = setup_distillation_config(args.export_kd_cfg, student.config, teacher.config)
    real_vocab_size = true_vocab_size(args) or args.padded_vocab_size
    criterion = {layers: RealVocabularyLogitsLoss(loss, real_vocab_size) if isinstance(loss, LogitsKLLoss) else loss
                 for layers, loss in distill_cfg.criterion.items()}
    kd_config = {"teacher_model": teacher, "criterion": criterion,
                 "loss_balancer": distill_cfg.loss_balancer}
    return mtd.convert(student, mode=[("kd_loss", kd_config)])


def _masked_sum(loss_mask, loss_and_flags):
    """A distillation loss `[b, s]` summed over the unmasked tokens (and over tensor-parallel ranks when each
    holds a part of the vocabulary's sum)."""
    loss, tp_reduce, _ = loss_and_flags if isinstance(loss_and_flags, tuple) else (loss_and_flags, False, False)
    total = torch.sum(loss.float().reshape(-1) * loss_mask.float().reshape(-1))
    if tp_reduce and parallel_state.get_tensor_model_parallel_world_size() > 1:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        total = torch.distributed.nn.functional.all_reduce(total, group=tp_group)
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

    check_modelopt_available()  # before Megatron starts up
    return pretrain(pretrain_gpt.train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                    forward_step, extra_args_provider=add_distillation_arguments, argv=argv)


if __name__ == "__main__":
    main()
