"""Knowledge distillation through pretrain() (examples/post_training/distill.py, 2 ranks): a 2-layer student
learns from a 4-layer teacher loaded from its torch_dist checkpoint. In every microbatch the loss
backpropagated equals KL(teacher || student) of the two models' logits summed over the unmasked tokens, the
teacher's distribution over the real vocabulary, computed here independently from the teacher and student of that
step. The teacher was saved with another vocabulary padding (121 rows) than the student's (128): its padded
entries, random, must get probability 0, and the student's distribution keeps every entry."""

import os

import pytest
import torch
import torch.nn.functional as F

from megatron.core.optional_deps import modelopt_installed
from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain, tiny_gpt_argv
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.post_training.modelopt_plugins import import_modelopt_plugins

needs_modelopt = pytest.mark.skipif(
    not modelopt_installed(), reason="nvidia-modelopt is not installed (pip install -e '.[modelopt]')"
)

# Sums over 2 x 16 tokens of a KL divergence between 121-way distributions, in fp32.
REL_TOLERANCE = 1e-5
# NullTokenizer --vocab-size 120 of tiny_gpt_argv: the text ids 0..119 and the eod 120; padded to 128 rows by
# --make-vocab-size-divisible-by 64
REAL_VOCAB_SIZE = 120 + 1

_records = []


def _reference_kd_loss_sums(model, batch):
    """KL(teacher || student) per token summed over the unmasked tokens (no gradients): the teacher's
    distribution over the real vocabulary, and over every padded logit (what a loss that does not mask the
    teacher's padding gives); the student's over every logit."""
    from megatron.core.distributed.data_parallel_base import unwrap_model

    module = unwrap_model(model)
    with torch.no_grad():
        teacher_logits = module.teacher_model(batch["tokens"], batch["position_ids"])
        with module.only_student_forward():
            student_logits = type(module).forward(module, batch["tokens"], batch["position_ids"])
        assert teacher_logits.shape[-1] == student_logits.shape[-1] == 128
        sums = []
        for width in (REAL_VOCAB_SIZE, 128):
            teacher_log_probs = F.log_softmax(teacher_logits[..., :width].float(), dim=-1)
            student_log_probs = F.log_softmax(student_logits.float(), dim=-1)[..., :width]
            per_token = (teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(dim=-1)
            sums.append((per_token * batch["loss_mask"].float()).sum().item())
        return sums


def _recording_forward_step(data_iterator, model):
    import pretrain_gpt
    from examples.post_training import distill

    batch = pretrain_gpt.get_batch(data_iterator)
    output_tensor, loss_func = distill.forward_step(iter([batch]), model)

    def recording_loss_func(output):
        loss_sum, num_tokens, reports = loss_func(output)
        reference, with_padding = _reference_kd_loss_sums(model, batch)
        _records.append({"kd": loss_sum.item(), "reference": reference, "with_padding": with_padding,
                         "reported_kd": reports["kd loss"][0].item(), "tokens": num_tokens.item()})
        return loss_sum, num_tokens, reports

    return output_tensor, recording_loss_func


def _distill(workdir):
    import pretrain_gpt
    from examples.post_training import distill
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    import_modelopt_plugins()
    teacher = os.path.join(workdir, "teacher")
    teacher_losses = run_pretrain(workdir, f"--train-iters 4 --save {teacher} --save-interval 4 "
                                  "--ckpt-format torch_dist --make-vocab-size-divisible-by 1")
    _records.clear()
    argv = tiny_gpt_argv(f"--num-layers 2 --train-iters 2 --export-kd-teacher-load {teacher}").split()
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, distill.model_provider, ModelType.encoder_or_decoder,
             _recording_forward_step, extra_args_provider=distill.add_distillation_arguments, argv=argv)
    return {"teacher_losses": teacher_losses, "records": list(_records)}


@needs_modelopt
def test_distillation_step_backpropagates_the_kl_divergence_to_the_teacher(tmp_path):
    for result in run_on_ranks(2, _distill, str(tmp_path)):
        records = result["records"]
        assert len(records) == 2 * 2  # 2 iterations x (global batch 8 / (micro batch 2 x DP2)) microbatches
        for record in records:
            assert record["tokens"] == 2 * 16
            assert record["kd"] > 0.01 * record["tokens"]  # a 2-layer student is not its 4-layer teacher
            assert abs(record["kd"] - record["reference"]) <= REL_TOLERANCE * record["reference"], record
            assert abs(record["with_padding"] - record["reference"]) > 0.01 * record["reference"], record
            assert record["reported_kd"] == record["kd"]
        assert records[0]["kd"] != records[-1]["kd"]


@needs_modelopt
def test_distill_refuses_missing_teacher_or_kd_cfg_and_pipeline_parallelism(tmp_path):
    from types import SimpleNamespace

    from examples.post_training.distill import _check_arguments

    base = dict(export_kd_teacher_load="t", pipeline_model_parallel_size=1, use_megatron_fsdp=False,
                use_torch_fsdp2=False, export_kd_cfg=None)
    kd_cfg = tmp_path / "distill.yaml"
    kd_cfg.write_text("logit_layers: [output_layer, output_layer]\n")
    _check_arguments(SimpleNamespace(**{**base, "export_kd_cfg": str(kd_cfg)}))
    with pytest.raises(FileNotFoundError, match="--export-kd-cfg .*missing.yaml: no such file"):
        _check_arguments(SimpleNamespace(**{**base, "export_kd_cfg": str(tmp_path / "missing.yaml")}))
    with pytest.raises(ValueError, match="--export-kd-teacher-load"):
        _check_arguments(SimpleNamespace(**{**base, "export_kd_teacher_load": None}))
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 1"):
        _check_arguments(SimpleNamespace(**{**base, "pipeline_model_parallel_size": 2}))
    with pytest.raises(ValueError, match="--use-megatron-fsdp"):
        _check_arguments(SimpleNamespace(**{**base, "use_megatron_fsdp": True}))


def _teacher_arguments_from(monkeypatch, saved_args, saved_vocab_size, **student):
    """teacher_arguments() of a student run given by `student` over a checkpoint holding `saved_args` and
    `saved_vocab_size` (the checkpoint reading is stubbed: no files)."""
    from types import SimpleNamespace

    from examples.post_training.distill import TEACHER_ARCHITECTURE, teacher_arguments
    from megatron.core.dist_checkpointing import checkpoint_directory, serialization

    monkeypatch.setattr(checkpoint_directory, "read_tracker", lambda root: 4)
    monkeypatch.setattr(checkpoint_directory, "published_directory", lambda root, iteration: (root, None))
    common = {"args": saved_args, "vocab_size": saved_vocab_size}
    monkeypatch.setattr(serialization, "read_objects", lambda directory, keys: {"common": common})
    args = SimpleNamespace(**{name: f"student {name}" for name in TEACHER_ARCHITECTURE})
    args.__dict__.update(export_kd_teacher_load="teacher_dir", tokenizer_type="NullTokenizer", vocab_size=120,
                         **student)
    return teacher_arguments(args)


@needs_modelopt
def test_teacher_takes_defaults_for_flags_its_checkpoint_predates_and_refuses_another_vocabulary(monkeypatch):
    from types import SimpleNamespace

    from examples.post_training.distill import TEACHER_ARCHITECTURE

    predated = ("use_rope_scaling", "rope_scaling_factor")
    saved = SimpleNamespace(**{name: f"teacher {name}" for name in TEACHER_ARCHITECTURE if name not in predated})
    teacher = _teacher_arguments_from(monkeypatch, saved, 121, use_rope_scaling=True, rope_scaling_factor=32.0)
    assert teacher.use_rope_scaling is False and teacher.rope_scaling_factor == 8.0  # the flags' defaults
    assert teacher.num_layers == "teacher num_layers" and teacher.rotary_base == "teacher rotary_base"
    assert (teacher.load, teacher.finetune, teacher.no_load_rng) == ("teacher_dir", True, True)

    with pytest.raises(ValueError, match=r"--export-kd-teacher-load teacher_dir: the teacher's vocabulary has 100 "
                                         r"tokens, the student's \(this run's tokenizer\) 121"):
        _teacher_arguments_from(monkeypatch, saved, 100)
    for flag, name, value in (("--num-experts", "num_experts", 4), ("--mtp-num-layers", "mtp_num_layers", 1),
                              ("--multi-latent-attention", "multi_latent_attention", True)):
        with pytest.raises(ValueError, match=f"the teacher was trained with {flag}; distill.py builds dense GPT"):
            _teacher_arguments_from(monkeypatch, SimpleNamespace(**{**vars(saved), name: value}), 121)


@pytest.mark.parametrize("entry", ["main", "model_provider"])
def test_distill_without_modelopt_says_how_to_install_it(monkeypatch, entry):
    from examples.post_training import distill
    from megatron.core import optional_deps

    monkeypatch.setattr(optional_deps, "have_modelopt", lambda: False)  # as where nvidia-modelopt is missing
    with pytest.raises(RuntimeError, match=r"distill.py needs nvidia-modelopt.*pip install -e '.\[modelopt\]'"):
        getattr(distill, entry)()
