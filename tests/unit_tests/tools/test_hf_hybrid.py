"""tools/checkpoint --from hf / --to hf with hybrid Mamba models: NemotronHForCausalLM (Mamba, attention and MLP
layers, pattern M*M-; with a Mixture-of-Experts block, M*E-) and Mamba2ForCausalLM (Mamba layers only, tied
embeddings, no conv biases).

The models are tiny ones transformers builds in fp32 (hidden 64, 8 Mamba heads of 16 channels in 2 groups, state 8,
121 tokens) with random weights; their scan runs in chunks of 8 over 16 positions, ours in one chunk of 128 (the same
sums in another order). Our model, built from the flags the import prints and loaded from the converted checkpoint,
computes transformers' logits; written back, the directory holds the same tensors and config.
"""

import json
import os

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.tools.hf_conversion_helpers import (
    assert_exports_back_bit_for_bit,
    assert_logits_close,
    import_hf,
    load_and_forward,
    read_config,
    train_save_and_forward,
    ungated_training_state,
)

VOCAB, PADDED_VOCAB, SEQUENCE = 121, 128, 16  # TINY_GPT: NullTokenizer --vocab-size 120, divisible by 64
MIXER = dict(hidden_size=64, n_groups=2, chunk_size=8, vocab_size=VOCAB)
NEMOTRON_H = dict(MIXER, layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
                  mamba_head_dim=16, ssm_state_size=8, max_position_embeddings=SEQUENCE, tie_word_embeddings=False)
# 4 experts in 2 groups, the best group's two chosen (the group-limited choice matters), weights scaled by 2.5
NEMOTRON_H_EXPERTS = dict(layers_block_type=["linear_attention", "full_attention", "moe", "mlp"], n_routed_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                          n_group=2, topk_group=1, routed_scaling_factor=2.5)
MAMBA2 = dict(MIXER, num_hidden_layers=3, num_heads=8, head_dim=16, expand=2, state_size=8, tie_word_embeddings=True,
              use_conv_bias=False)
NEMOTRON_H_FLAGS = ("--num-layers 4 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 "
                    "--group-query-attention --num-query-groups 2 --max-position-embeddings 16 "
                    "--position-embedding-type none --normalization RMSNorm --norm-epsilon 1e-05 --squared-relu "
                    "--untie-embeddings-and-output-weights --disable-bias-linear --hybrid-override-pattern M*M- "
                    "--mamba-state-dim 8 --mamba-head-dim 16 --mamba-num-groups 2 --mamba-num-heads 8 "
                    "--mamba-dt-limit 0.001 inf")  # transformers' default time_step_min clamps each step
EXPERT_FLAGS = ("--num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-layer-freq [0,0,1,0] "
                "--moe-shared-expert-intermediate-size 48 --hybrid-override-pattern M*E-",
                "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 2 "
                "--moe-router-group-topk 1 --moe-router-topk-scaling-factor 2.5")
MAMBA2_FLAGS = ("--hybrid-override-pattern MMM --mamba-state-dim 8 --mamba-head-dim 16 --mamba-num-groups 2 "
                "--mamba-num-heads 8")
# Relative to the largest logit, fp32 on CPU: the scans sum in other orders (chunks of 8 against one of 128).
LOGITS_TOLERANCE = 1e-5


def _tokens():
    return torch.randint(0, VOCAB, (3, SEQUENCE), generator=torch.Generator().manual_seed(1234))


def _save_hf_model(directory, architecture, **changes):
    """transformers' model with random weights (0.2 x N(0, 1) added; expert biases 0.1 x N(0, 1)) saved in
    `directory`; its logits on _tokens(). Nemotron-H keeps transformers' default time_step_min 0.001, which clamps
    some steps (--mamba-dt-limit)."""
    import transformers

    torch.manual_seed(0)
    config_class = transformers.NemotronHConfig if architecture == "NemotronHForCausalLM" else transformers.Mamba2Config
    defaults = NEMOTRON_H if architecture == "NemotronHForCausalLM" else MAMBA2
    model = transformers.AutoModelForCausalLM.from_config(config_class(**{**defaults, **changes})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
        logits = model(_tokens()).logits
    model.save_pretrained(str(directory))
    return model, logits


def _training_state(flags):
    """TINY_GPT without its --swiglu (the hybrid MLP layers are --squared-relu) + `flags`, as pretrain() builds it;
    tied embeddings unless `flags` untie them."""
    from tests.unit_tests.dist_checkpointing import pretrain_helpers

    tied = "" if "--untie-embeddings-and-output-weights" in flags else f" {pretrain_helpers.TIED}"
    return ungated_training_state(flags + tied)


def _load_and_forward(flags, root):
    """On one rank: our model of `flags`, loaded from `root` as training loads it; its logits."""
    return load_and_forward(_training_state(f"{flags} --load {root} --finetune --ckpt-format torch_dist"), _tokens())


def _train_save_and_forward(flags, root):
    """On one rank: our model of `flags` after one step, its weights perturbed, saved in `root`; its logits."""
    return train_save_and_forward(_training_state(f"{flags} --ckpt-format torch_dist"), root, _tokens(), 0.2)


def _assert_config_written_back(before_dir, back_dir, minimum_keys):
    before, after = read_config(before_dir), read_config(back_dir)
    keys = set(before) - {"transformers_version"}
    assert len(keys) >= minimum_keys
    for key in keys:
        assert after.get(key, "MISSING") == before[key], (key, after.get(key, "MISSING"), before[key])


@pytest.mark.world_size(1)
def test_nemotron_h_computes_transformers_logits_and_round_trips(tools, tmp_path, capsys):
    import transformers
    from megatron.core.dist_checkpointing import offline
    from megatron.training.arguments import build_parser
    from megatron.training.checkpoint_args import architecture_differences

    convert_checkpoint, _ = tools
    original, theirs = _save_hf_model(tmp_path / "hf", "NemotronHForCausalLM")
    flags = import_hf(convert_checkpoint, tmp_path / "hf", tmp_path / "ours", capsys)
    assert NEMOTRON_H_FLAGS in flags, flags
    recorded = offline.read_checkpoint(os.path.join(tmp_path, "ours", "iter_0000000"))["common"]["args"]
    assert architecture_differences(recorded, build_parser().parse_args(flags.split())) == []
    assert recorded.is_hybrid_model and recorded.hybrid_override_pattern == "M*M-"

    ours = run_on_ranks(1, _load_and_forward, flags, str(tmp_path / "ours"))[0]
    assert ours.shape == (3, SEQUENCE, PADDED_VOCAB)
    assert_logits_close(theirs, ours, "Nemotron-H", LOGITS_TOLERANCE * theirs.abs().max().item())

    before, _ = assert_exports_back_bit_for_bit(convert_checkpoint, tmp_path / "ours", tmp_path / "hf",
                                                tmp_path / "back")
    assert {"backbone.layers.0.mixer.conv1d.bias", "backbone.layers.1.mixer.k_proj.weight",
            "backbone.layers.3.mixer.up_proj.weight", "lm_head.weight"} <= set(before)
    _assert_config_written_back(tmp_path / "hf", tmp_path / "back", 50)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    assert type(back) is type(original)
    with torch.no_grad():
        assert torch.equal(back(_tokens()).logits, theirs)


@pytest.mark.world_size(1)
@pytest.mark.parametrize("latent", [None, 16])
def test_nemotron_h_experts_compute_transformers_logits_and_round_trip(tools, tmp_path, capsys, latent):
    """A 'moe' block (sigmoid router with expert bias, group-limited choice, scaled weights, squared-ReLU experts
    and a shared expert) is our 'E' layer; with moe_latent_size 16 (Nemotron-3's latent experts) our layer with
    --moe-latent-size 16, the experts working in 16 of the 64 hidden channels."""
    import transformers

    convert_checkpoint, _ = tools
    changes = dict(NEMOTRON_H_EXPERTS, moe_latent_size=latent)
    original, theirs = _save_hf_model(tmp_path / "hf", "NemotronHForCausalLM", **changes)
    flags = import_hf(convert_checkpoint, tmp_path / "hf", tmp_path / "ours", capsys)
    assert ("--moe-latent-size 16" in flags) == (latent is not None), flags
    assert all(expected in flags.replace(" --moe-latent-size 16", "") for expected in EXPERT_FLAGS), flags
    ours = run_on_ranks(1, _load_and_forward, flags, str(tmp_path / "ours"))[0]
    assert_logits_close(theirs, ours, "Nemotron-H experts", LOGITS_TOLERANCE * theirs.abs().max().item())

    before, _ = assert_exports_back_bit_for_bit(convert_checkpoint, tmp_path / "ours", tmp_path / "hf",
                                                tmp_path / "back")
    assert {"backbone.layers.2.mixer.gate.weight", "backbone.layers.2.mixer.experts.3.up_proj.weight",
            "backbone.layers.2.mixer.shared_experts.down_proj.weight"} <= set(before)
    assert before["backbone.layers.2.mixer.experts.3.up_proj.weight"].shape == (32, latent or 64)
    assert before["backbone.layers.2.mixer.shared_experts.up_proj.weight"].shape == (48, 64)
    if latent is not None:
        assert before["backbone.layers.2.mixer.fc1_latent_proj.weight"].shape == (16, 64)
        assert before["backbone.layers.2.mixer.fc2_latent_proj.weight"].shape == (64, 16)
    assert torch.count_nonzero(before["backbone.layers.2.mixer.gate.e_score_correction_bias"]) == 4
    _assert_config_written_back(tmp_path / "hf", tmp_path / "back", 50)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    assert type(back) is type(original)
    with torch.no_grad():
        assert torch.equal(back(_tokens()).logits, theirs)


@pytest.mark.world_size(1)
@pytest.mark.parametrize("step_limit", [None, (0.05, 0.3)])
def test_mamba2_computes_transformers_logits_and_round_trips(tools, tmp_path, capsys, step_limit):
    """Without a step limit, and with one that clamps steps from both sides (--mamba-dt-limit)."""
    import transformers

    convert_checkpoint, _ = tools
    changes = {} if step_limit is None else {"time_step_limit": step_limit}
    original, theirs = _save_hf_model(tmp_path / "hf", "Mamba2ForCausalLM", **changes)
    flags = import_hf(convert_checkpoint, tmp_path / "hf", tmp_path / "ours", capsys)
    assert MAMBA2_FLAGS in flags and "--untie-embeddings-and-output-weights" not in flags, flags
    assert ("--mamba-dt-limit" in flags) == (step_limit is not None), flags
    ours = run_on_ranks(1, _load_and_forward, flags, str(tmp_path / "ours"))[0]
    assert_logits_close(theirs, ours, "Mamba2", LOGITS_TOLERANCE * theirs.abs().max().item())

    before, _ = assert_exports_back_bit_for_bit(convert_checkpoint, tmp_path / "ours", tmp_path / "hf",
                                                tmp_path / "back")
    assert "lm_head.weight" not in before and "backbone.layers.2.mixer.in_proj.weight" in before  # tied
    assert "backbone.layers.2.mixer.conv1d.bias" not in before  # use_conv_bias false: ours are zeros
    _assert_config_written_back(tmp_path / "hf", tmp_path / "back", 25)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    assert type(back) is type(original)
    with torch.no_grad():
        assert torch.equal(back(_tokens()).logits, theirs)


def test_mixer_rows_go_group_major_and_back(tools):
    """HF's in_proj rows [z | x | B | C | dt] (each kind group after group) become ours [z_g, x_g, B_g, C_g, dt_g] per
    group g, its conv1d channels [x | B | C] ours [x_g, B_g, C_g]; and back."""
    import hf_layouts

    _, hf_mapping = tools
    shape = hf_mapping.ModelShape(num_layers=1, hidden_size=8, num_attention_heads=1, num_query_groups=1,
                                  kv_channels=8, ffn_hidden_size=8, vocab_size=4, padded_vocab_size=4,
                                  max_position_embeddings=4, hybrid_layer_pattern="M", mamba_state_dim=2,
                                  mamba_head_dim=2, mamba_num_groups=2, mamba_num_heads=4)
    # inner 8: per kind z, x 8 rows, B, C 2 x 2, dt 4; rows labelled kind * 100 + index within the kind
    kinds = [8, 8, 4, 4, 4]
    hf_rows = torch.cat([kind * 100 + torch.arange(width) for kind, width in enumerate(kinds)]).float()
    ours = hf_layouts.mamba_rows(hf_rows, shape, to_hf=False)
    assert ours.tolist() == [0, 1, 2, 3, 100, 101, 102, 103, 200, 201, 300, 301, 400, 401,
                             4, 5, 6, 7, 104, 105, 106, 107, 202, 203, 302, 303, 402, 403]
    assert torch.equal(hf_layouts.mamba_rows(ours, shape, to_hf=True), hf_rows)
    channels = torch.arange(16.0)  # x 0..7, B 8..11, C 12..15
    ours = hf_layouts.mamba_rows(channels, shape, to_hf=False, with_gate_and_step=False)
    assert ours.tolist() == [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15]
    assert torch.equal(hf_layouts.mamba_rows(ours, shape, to_hf=True, with_gate_and_step=False), channels)


def _write_config(directory, architecture, **changes):
    os.makedirs(directory)
    config = {**(NEMOTRON_H if architecture == "NemotronHForCausalLM" else MAMBA2), "architectures": [architecture],
              "model_type": "nemotron_h" if architecture == "NemotronHForCausalLM" else "mamba2"}
    if architecture == "NemotronHForCausalLM":
        config["time_step_min"] = 0.0
    with open(os.path.join(directory, "config.json"), "w") as stream:
        json.dump({**config, **changes}, stream)
    return str(directory)


IMPORT_REFUSALS = [
    ("NemotronHForCausalLM", dict(conv_kernel=3), "conv_kernel 3: our Mamba mixer's convolution is 4 wide"),
    ("NemotronHForCausalLM", dict(use_bias=True), "use_bias true: our Mamba mixer's in_proj and out_proj have no"),
    ("NemotronHForCausalLM", dict(mlp_bias=True), "mlp_bias true: our MLP layers and experts have biases only with"),
    ("NemotronHForCausalLM", dict(layer_norm_epsilon=1e-6), "layer_norm_epsilon 1e-06: it is also the Mamba mixer's "
     "gated-norm epsilon, which ours fixes at 1e-05"),
    ("NemotronHForCausalLM", dict(NEMOTRON_H_EXPERTS, moe_latent_size=0), r"config.json's moe_latent_size \(0\) "
     "must be a positive integer or null"),
    ("NemotronHForCausalLM", dict(NEMOTRON_H_EXPERTS, norm_topk_prob=False), "norm_topk_prob False with "
     "num_experts_per_tok 2: our sigmoid router renormalises the chosen scores exactly when"),
    ("NemotronHForCausalLM", dict(NEMOTRON_H_EXPERTS, num_experts_per_tok=1), "norm_topk_prob True with "
     "num_experts_per_tok 1"),
    ("NemotronHForCausalLM", dict(NEMOTRON_H_EXPERTS, n_routed_experts=8, num_experts_per_tok=3),
     "n_group 2 with topk_group 1 and num_experts_per_tok 3: HF scores each group by its best two experts"),
    ("NemotronHForCausalLM", dict(NEMOTRON_H_EXPERTS, n_group=3), "n_group 3 with topk_group 1: HF's router needs "
     "n_routed_experts 4 in n_group equal groups"),
    ("NemotronHForCausalLM", dict(NEMOTRON_H_EXPERTS, layers_block_type=["linear_attention", "moe"],
                                  mlp_hidden_act="silu"), "mlp_hidden_act 'silu': our non-gated MLP and experts"),
    ("NemotronHForCausalLM", dict(mamba_hidden_act="gelu"), "mamba_hidden_act 'gelu': our Mamba mixer applies silu"),
    ("NemotronHForCausalLM", dict(mlp_hidden_act="silu"), "mlp_hidden_act 'silu': our non-gated MLP and experts are "
     "squared ReLU"),
    ("NemotronHForCausalLM", dict(num_nextn_predict_layers=1), "num_nextn_predict_layers 1: our hybrid model has no "
     "multi-token prediction layers"),
    ("NemotronHForCausalLM", dict(mamba_num_heads=6, n_groups=4), "mamba_num_heads 6 is not a multiple of n_groups 4"),
    ("Mamba2ForCausalLM", dict(expand=3), "expand 3 x hidden_size 64 differs from num_heads 8 x head_dim 16"),
    ("Mamba2ForCausalLM", dict(hidden_act="relu"), "hidden_act 'relu': our Mamba mixer applies silu"),
]


@pytest.mark.parametrize("architecture,changes,message", IMPORT_REFUSALS)
def test_hybrid_configs_we_cannot_compute_are_refused_naming_the_key(tools, tmp_path, architecture, changes,
                                                                     message):
    convert_checkpoint, _ = tools
    directory = _write_config(tmp_path / "hf", architecture, **changes)
    with pytest.raises(SystemExit, match=message):
        convert_checkpoint.from_hf(directory, str(tmp_path / "unused"))
    assert not os.path.exists(tmp_path / "unused")


def test_older_nemotron_h_config_names_read_as_the_current_ones(tools):
    _, hf_mapping = tools
    current = dict(NEMOTRON_H, architectures=["NemotronHForCausalLM"], time_step_min=0.0)
    older = {key: value for key, value in current.items() if key not in ("layers_block_type", "n_groups")}
    older.update(hybrid_override_pattern="M*M-", mamba_n_groups=2, mamba_dt_min=0.0, num_hidden_layers=4)
    del older["time_step_min"]
    assert hf_mapping.shape_from_hf_config(older, "DIR", None, PADDED_VOCAB, False) == \
        hf_mapping.shape_from_hf_config(current, "DIR", None, PADDED_VOCAB, False)


def _hybrid_shape(hf_mapping, **flags):
    values = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                  ffn_hidden_size=96, vocab_size=VOCAB, padded_vocab_size=PADDED_VOCAB, max_position_embeddings=16,
                  position_embedding_type="none", normalization="RMSNorm", squared_relu=True, add_bias_linear=False,
                  hybrid_layer_pattern="M*M-", mamba_state_dim=8, mamba_head_dim=16, mamba_num_groups=2)
    return hf_mapping.ModelShape(**{**values, **flags})


EXPORT_REFUSALS = [
    (dict(position_embedding_type="rope"), "--position-embedding-type rope: NemotronHForCausalLM's attention has no "
     r"position embedding \(--position-embedding-type none\)"),
    (dict(position_embedding_type="learned_absolute"), "NemotronHForCausalLM has no position embedding table"),
    (dict(squared_relu=False, swiglu=True), "--swiglu: NemotronHForCausalLM's MLP layers and experts apply squared "
     "ReLU"),
    (dict(add_bias_linear=True), r"linear biases \(no --disable-bias-linear, or --add-qkv-bias\)"),
    (dict(qk_layernorm=True), "--qk-layernorm: NemotronHForCausalLM's attention does not normalise"),
    (dict(norm_epsilon=1e-6), "--norm-epsilon 1e-06: NemotronHForCausalLM's one layer_norm_epsilon is also its "
     "Mamba mixers' gated-norm epsilon"),
    (dict(normalization="LayerNorm"), "--normalization LayerNorm: NemotronHForCausalLM normalises with RMSNorm"),
]


@pytest.mark.parametrize("flags,message", EXPORT_REFUSALS)
def test_hybrid_export_names_the_flags_hf_cannot_compute(tools, flags, message):
    _, hf_mapping = tools
    assert hf_mapping.architecture_for(_hybrid_shape(hf_mapping)) == "NemotronHForCausalLM"
    with pytest.raises(hf_mapping.ConversionError, match=message):
        hf_mapping.architecture_for(_hybrid_shape(hf_mapping, **flags))


def test_our_flags_pick_the_hybrid_architecture_and_refuse_the_others(tools):
    _, hf_mapping = tools
    mamba_only = _hybrid_shape(hf_mapping, hybrid_layer_pattern="MMMM")
    assert hf_mapping.architecture_for(mamba_only) == "Mamba2ForCausalLM"
    assert hf_mapping.architecture_for(mamba_only, "NemotronHForCausalLM") == "NemotronHForCausalLM"
    # 6 heads of 16 channels (96) are no whole multiple of hidden 64: Mamba2's expand cannot say it
    odd_width = _hybrid_shape(hf_mapping, hybrid_layer_pattern="MMMM", mamba_num_heads=6)
    assert hf_mapping.architecture_for(odd_width) == "NemotronHForCausalLM"
    with pytest.raises(hf_mapping.ConversionError, match="is not a multiple of --hidden-size 64: Mamba2ForCausalLM"):
        hf_mapping.architecture_for(odd_width, "Mamba2ForCausalLM")
    with pytest.raises(hf_mapping.ConversionError, match="--hybrid-override-pattern M\\*M-: every Mamba2ForCausalLM "
                       "layer is a Mamba layer"):
        hf_mapping.architecture_for(_hybrid_shape(hf_mapping), "Mamba2ForCausalLM")
    with pytest.raises(hf_mapping.ConversionError, match="LlamaForCausalLM .*only NemotronHForCausalLM and "
                       "Mamba2ForCausalLM have Mamba, attention and MLP layers"):
        hf_mapping.architecture_for(_hybrid_shape(hf_mapping), "LlamaForCausalLM")
    gpt = _hybrid_shape(hf_mapping, hybrid_layer_pattern=None, position_embedding_type="rope", swiglu=True)
    with pytest.raises(hf_mapping.ConversionError, match="no --hybrid-override-pattern: NemotronHForCausalLM's"):
        hf_mapping.architecture_for(gpt, "NemotronHForCausalLM")
    assert "--hybrid-override-pattern=-M*M" in _hybrid_shape(hf_mapping, hybrid_layer_pattern="-M*M").training_flags()


def _assert_transformers_computes_it_and_it_imports_back(convert_checkpoint, tmp_path, ours, label, a_tensor):
    """The export in tmp_path/hf computes our logits `ours` under transformers, and its import gives back every
    tensor of tmp_path/ours (iteration 1) bit for bit, `a_tensor` among them."""
    import transformers
    from megatron.core.dist_checkpointing import offline

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(_tokens()).logits
    assert_logits_close(theirs, ours, label, LOGITS_TOLERANCE * theirs.abs().max().item())
    convert_checkpoint.from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    saved = offline.full_precision_model(offline.read_checkpoint(os.path.join(tmp_path, "ours", "iter_0000001")))
    back = offline.full_precision_model(offline.read_checkpoint(os.path.join(tmp_path, "back", "iter_0000001")))
    assert set(back) == set(saved) and a_tensor in back
    for name, tensor in saved.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.world_size(1)
def test_trained_hybrid_checkpoint_exports_and_imports_back_bit_for_bit(tools, tmp_path):
    """A hybrid checkpoint training wrote (--apply-layernorm-1p: norms stored as gamma - 1) exports as
    NemotronHForCausalLM with time_step_min 0, transformers computes its logits, and --from hf gives every model
    tensor back bit for bit."""
    convert_checkpoint, _ = tools
    flags = ("--untie-embeddings-and-output-weights --hidden-size 64 --position-embedding-type none "
             "--normalization RMSNorm --norm-epsilon 1e-5 --squared-relu --disable-bias-linear --apply-layernorm-1p "
             "--hybrid-override-pattern M-*M --mamba-state-dim 8 --mamba-head-dim 16 --mamba-num-groups 2")
    ours = run_on_ranks(1, _train_save_and_forward, flags, str(tmp_path / "ours"))[0]
    written = convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"))
    config = read_config(tmp_path / "hf")
    assert config["architectures"] == ["NemotronHForCausalLM"] and config["time_step_min"] == 0.0
    assert config["layers_block_type"] == ["linear_attention", "mlp", "full_attention", "linear_attention"]
    assert (config["mamba_num_heads"], config["n_groups"], config["ssm_state_size"]) == (8, 2, 8)
    assert written["backbone.layers.1.mixer.up_proj.weight"].shape == (256, 64)  # TINY_GPT's 4 x hidden
    _assert_transformers_computes_it_and_it_imports_back(convert_checkpoint, tmp_path, ours, "trained hybrid",
                                                         "decoder.layers.0.mixer.A_log")


def _experts_shape(hf_mapping, **flags):
    return _hybrid_shape(hf_mapping, **{**dict(hybrid_layer_pattern="M*E-", num_experts=4, moe_ffn_hidden_size=32,
                                               moe_layer_freq=[0, 0, 1, 0], moe_shared_expert_intermediate_size=48,
                                               moe_router_score_function="sigmoid"), **flags})


EXPERT_EXPORT_REFUSALS = [
    (dict(moe_router_score_function="softmax"), "--moe-router-score-function softmax: NemotronHForCausalLM's router "
     "scores experts by a sigmoid"),
    (dict(moe_shared_expert_intermediate_size=None), "no --moe-shared-expert-intermediate-size: every "
     "NemotronHForCausalLM 'moe' block adds a shared expert"),
    (dict(moe_shared_expert_gate=True), "--moe-shared-expert-gate: NemotronHForCausalLM's shared expert is not gated"),
    (dict(moe_router_topk=3, moe_router_num_groups=2, moe_router_group_topk=1), "--moe-router-topk 3 with "
     "--moe-router-group-topk 1: NemotronHForCausalLM scores each group by its best two experts"),
    (dict(squared_relu=False, swiglu=True), "--swiglu: NemotronHForCausalLM's MLP layers and experts apply squared"),
    (dict(moe_router_bias=True), "--moe-router-bias: NemotronHForCausalLM's router has no bias"),
]


@pytest.mark.parametrize("flags,message", EXPERT_EXPORT_REFUSALS)
def test_hybrid_experts_export_names_the_flags_hf_cannot_compute(tools, flags, message):
    _, hf_mapping = tools
    assert hf_mapping.architecture_for(_experts_shape(hf_mapping, moe_router_enable_expert_bias=True,
                                                      moe_router_num_groups=2, moe_router_group_topk=1,
                                                      moe_router_topk_scaling_factor=2.5)) == "NemotronHForCausalLM"
    with pytest.raises(hf_mapping.ConversionError, match=message):
        hf_mapping.architecture_for(_experts_shape(hf_mapping, **flags))


def test_hybrid_experts_router_flags_are_left_to_the_nemotron_h_checks(tools):
    """The sigmoid router's flags, which block other models with experts, are Nemotron-H's; the rest still block."""
    import argparse

    import hf_unsupported

    router = dict(num_experts=4, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5)
    assert hf_unsupported.hf_export_refusal(argparse.Namespace(**router, hybrid_override_pattern="M*E-")) is None
    assert "--moe-router-score-function sigmoid" in hf_unsupported.hf_export_refusal(argparse.Namespace(**router))
    blocked = hf_unsupported.hf_export_refusal(argparse.Namespace(**router, hybrid_override_pattern="M*E-",
                                                                  moe_expert_capacity_factor=1.0, mtp_num_layers=1))
    assert "--moe-expert-capacity-factor 1.0" in blocked and "--mtp-num-layers 1" in blocked
    assert "--moe-router-score-function" not in blocked


@pytest.mark.world_size(1)
def test_trained_hybrid_experts_checkpoint_exports_and_imports_back_bit_for_bit(tools, tmp_path):
    """A hybrid checkpoint with a Mixture-of-Experts layer (sigmoid router, expert bias, group-limited choice,
    scaled weights, a shared expert) exports as NemotronHForCausalLM with a 'moe' block, transformers computes its
    logits, and --from hf gives every model tensor back bit for bit."""
    convert_checkpoint, _ = tools
    flags = ("--untie-embeddings-and-output-weights --hidden-size 64 --position-embedding-type none "
             "--normalization RMSNorm --norm-epsilon 1e-5 --squared-relu --disable-bias-linear "
             "--hybrid-override-pattern M*E- --mamba-state-dim 8 --mamba-head-dim 16 --mamba-num-groups 2 "
             "--num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-shared-expert-intermediate-size 48 "
             "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 2 "
             "--moe-router-group-topk 1 --moe-router-topk-scaling-factor 2.5")
    ours = run_on_ranks(1, _train_save_and_forward, flags, str(tmp_path / "ours"))[0]
    written = convert_checkpoint.to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"))
    config = read_config(tmp_path / "hf")
    assert config["layers_block_type"] == ["linear_attention", "full_attention", "moe", "mlp"]
    assert (config["n_routed_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
            config["moe_shared_expert_intermediate_size"], config["n_group"], config["topk_group"],
            config["routed_scaling_factor"], config["norm_topk_prob"]) == (4, 2, 32, 48, 2, 1, 2.5, True)
    assert written["backbone.layers.2.mixer.experts.0.up_proj.weight"].shape == (32, 64)
    assert written["backbone.layers.2.mixer.gate.e_score_correction_bias"].dtype == torch.float32
    _assert_transformers_computes_it_and_it_imports_back(convert_checkpoint, tmp_path, ours, "trained hybrid experts",
                                                         "decoder.layers.2.mlp.router.expert_bias")


def test_latent_experts_export_as_nemotron_h_only(tools):
    """--moe-latent-size is Nemotron-H's moe_latent_size: a hybrid model's 'E' layers write it; a GPT model with
    latent experts has no Hugging Face counterpart (Mixtral's and Qwen-MoE's experts read the hidden state)."""
    import argparse

    import hf_unsupported

    _, hf_mapping = tools
    shape = _experts_shape(hf_mapping, moe_latent_size=16)
    assert hf_mapping.architecture_for(shape) == "NemotronHForCausalLM"
    assert "--moe-latent-size 16" in shape.training_flags()
    latent = dict(num_experts=4, moe_latent_size=16)
    assert hf_unsupported.hf_export_refusal(argparse.Namespace(**latent, hybrid_override_pattern="M*E-")) is None
    assert "--moe-latent-size 16: latent experts" in hf_unsupported.hf_export_refusal(argparse.Namespace(**latent))
