"""GPT: embedding -> transformer block -> final norm -> vocab-parallel output layer -> per-token loss.

One instance is one pipeline stage: the first stage (`pre_process`) owns the embedding, the last
(`post_process`) the output layer and the loss, and every stage only its own layers. Activations inside are
`[s, b, h]`; the public inputs and outputs are batch-first (`[b, s]` ids, `[b, s]` loss, `[b, s, vocab]` logits).

With tied embeddings (`share_embeddings_and_output_weights`) a single-stage model multiplies by the word
embedding itself. When first and last stage are different processes the last stage keeps its own copy: it is
made equal to the embedding at construction (zero-filled, then summed with the first stage's weight over the
embedding group), and both copies carry `shared_embedding=True` so gradient finalisation all-reduces their
gradients over the embedding group, keeping them equal.

With multi-token prediction (`config.mtp_num_layers`, see `multi_token_prediction`) the last stage also runs the
MTP depths, which read the word embedding: a last stage that is not first keeps a copy of the whole embedding
module (`embedding`, rope only, so just the word embeddings), synchronised with the first stage's like the tied
copy above (and with tied weights it is that copy: the output layer then multiplies by it). `forward` with labels
returns `(loss, mtp_losses)` there.

Initial weights depend only on the base init seed (`config.init_seed`, else the default generator's seed when the
model is built) and on each module's identity in the whole model (`init_seeds`): a stage built alone draws the
same weights for its modules as a single-stage model does, and a tied output layer draws the embedding's.
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.inference.model_checks import check_inference_supported
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
    word_embedding_init_seed,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding,
    local_rotary_angles,
    rotary_angles,
)
from megatron.core.models.gpt.gpt_layer_specs import check_layer_spec, check_mtp_block_spec
from megatron.core.packed_sequences import (
    check_packed_model_support,
    context_parallel_size_and_rank,
    packed_rows,
    shift_left_within_sequences,
)
from megatron.core.transformer.context_parallel import local_token_indices
from megatron.core.transformer.attention import is_dynamic_batching
from megatron.core.transformer.init_seeds import build_with_init_seed, derive_init_seed, resolve_base_init_seed
from megatron.core.transformer.module import ShardedStateModule
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    context_parallel_group_or_none,
    shift_left,
)
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "none")


def _check_tensor_parallel_size(config):
    """The attention heads are split by the config's tensor-parallel size, the linear layers by the group's."""
    if not parallel_state.model_parallel_is_initialized():
        return
    group_size = parallel_state.get_tensor_model_parallel_world_size()
    if config.tensor_model_parallel_size != group_size:
        raise ValueError(
            f"TransformerConfig(tensor_model_parallel_size={config.tensor_model_parallel_size}) differs from the "
            f"initialised tensor-parallel group ({group_size} ranks): build the config with "
            f"tensor_model_parallel_size={group_size} (and pipeline_model_parallel_size likewise)"
        )


def _check_vp_stage(config, vp_stage):
    """`vp_stage` names one of the config's virtual stages per pipeline rank, and the chunk being built if one is
    set."""
    if vp_stage is None:
        return
    num_chunks = getattr(config, "virtual_pipeline_model_parallel_size", None) or 1
    if not 0 <= vp_stage < num_chunks:
        raise ValueError(
            f"GPTModel(vp_stage={vp_stage}) names a model chunk, but the config has {num_chunks} virtual "
            "stage(s) per pipeline rank (--num-virtual-stages-per-pipeline-rank): pass vp_stage in "
            f"0..{num_chunks - 1}, or None without an interleaved pipeline"
        )
    building = parallel_state.get_virtual_pipeline_model_parallel_rank()
    if building is not None and building != vp_stage:
        raise ValueError(
            f"GPTModel(vp_stage={vp_stage}) while model chunk {building} is being built "
            "(set_virtual_pipeline_model_parallel_rank): pass the chunk get_model builds, or vp_stage=None"
        )


def _refuse_unsupported_forward_inputs(extra_block_kwargs):
    if extra_block_kwargs:
        raise ValueError(f"GPTModel.forward(extra_block_kwargs={sorted(extra_block_kwargs)}) is not supported: "
                         "the decoder takes only the attention mask and rotary embeddings; drop them")


def _check_loss_mask(loss_mask, labels):
    if loss_mask is not None and loss_mask.shape != labels.shape:
        raise ValueError(f"GPTModel.forward: loss_mask has shape {tuple(loss_mask.shape)} but labels have "
                         f"{tuple(labels.shape)}: pass the batch's [b, s] loss_mask, one entry per label")


class GPTModel(ShardedStateModule):
    """Decoder-only language model (one pipeline stage of it).

    Args:
        config: the transformer config.
        transformer_layer_spec: upstream's layer spec or decoder block spec (`get_gpt_decoder_block_spec`: one
            layer spec per layer of this stage), or None; the layers are built from the config, and a spec asking
            for other layers is refused.
        vocab_size: padded vocabulary size (a multiple of the tensor-parallel size).
        max_sequence_length: `--max-position-embeddings`, rows of the learned position embedding.
        pre_process: this stage holds the embedding (first pipeline stage).
        post_process: this stage holds the output layer and computes the loss (last pipeline stage).
        fp16_lm_cross_entropy: upstream's switch (`--fp16-lm-cross-entropy`); the loss works in fp32 whatever
            its value, as Megatron-Core's does.
        parallel_output: without labels, return this tensor-parallel rank's vocabulary slice of the logits,
            `[b, s, vocab / tp]` (True, upstream's default), or the logits gathered over the tensor-parallel ranks,
            `[b, s, vocab]` (False). `forward(..., runtime_gather_output=...)` overrides it per call; the loss
            does not depend on it.
        share_embeddings_and_output_weights: tie the output layer to the word embedding (default False, as
            upstream's GPTModel; pretrain_gpt.py ties unless --untie-embeddings-and-output-weights).
        position_embedding_type: "learned_absolute", "rope", "yarn" (RoPE with YaRN's frequencies and cos / sin
            factor, shaped by the config's `yarn_*` fields), or "none" (no position information: causal attention
            over the word embeddings alone, NoPE).
        rotary_percent, rotary_base: fraction of each head rotated and the RoPE base (rope and yarn).
        seq_len_interpolation_factor: RoPE positions are divided by it (rope only; None: the config's
            `rotary_seq_len_interpolation_factor`). `config.rotary_interleaved` picks the pair layout.
        rope_scaling, rope_scaling_factor: Llama 3.1's scaling of the RoPE frequencies by the factor (rope only;
            `--use-rope-scaling`, `--rope-scaling-factor`).
        scatter_embedding_sequence_parallel: with --sequence-parallel, scatter the embedding output over the
            tensor-parallel ranks (True, the default). False, as upstream: `self.embedding(...)` returns the whole
            `[s, b, h]` for a caller that combines it with other inputs and passes the scattered result as
            `decoder_input`; `forward` without `decoder_input` scatters the embedding itself. Refused with
            multi-token prediction; without sequence parallelism there is nothing to scatter.
        mtp_block_spec: upstream's multi-token-prediction block spec (`get_gpt_mtp_block_spec`). The depths are
            built from `config.mtp_num_layers` on the last stage: None builds what the config asks for, and a
            spec must describe the same (it is refused when the config has no `mtp_num_layers`).
        vp_stage: with an interleaved pipeline, the model chunk this is (virtual stage `vp_stage * p + pipeline
            rank`), as upstream's `get_model` passes it; None: the virtual pipeline rank being built
            (`parallel_state.set_virtual_pipeline_model_parallel_rank`, which `get_model` sets). `pre_process` and
            `post_process` are still the caller's.
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec=None,
        vocab_size: int = None,
        max_sequence_length: int = None,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None,
        mtp_block_spec=None,
        vp_stage: Optional[int] = None,
    ):
        super().__init__()
        check_layer_spec(transformer_layer_spec, config, vp_stage)
        check_mtp_block_spec(mtp_block_spec, config)
        if vocab_size is None or max_sequence_length is None:
            raise TypeError("GPTModel needs vocab_size and max_sequence_length")
        _check_tensor_parallel_size(config)
        _check_vp_stage(config, vp_stage)
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"--position-embedding-type must be one of {POSITION_EMBEDDING_TYPES}, got {position_embedding_type!r}"
            )
        if vocab_size % config.tensor_model_parallel_size != 0:
            raise ValueError(
                f"vocabulary size {vocab_size} must be divisible by --tensor-model-parallel-size "
                f"({config.tensor_model_parallel_size}); pad it with --make-vocab-size-divisible-by"
            )
        self.config = config
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.vp_stage = vp_stage
        self.mtp_num_layers = config.mtp_num_layers or 0
        if rope_scaling and position_embedding_type != "rope":
            raise ValueError(f"--use-rope-scaling scales rotary position embeddings: it needs "
                             f"--position-embedding-type rope, got {position_embedding_type!r}")
        self._check_yarn_fields(config, position_embedding_type, seq_len_interpolation_factor)
        if self.mtp_num_layers and position_embedding_type not in ("rope", "none"):
            raise ValueError(
                "--mtp-num-layers needs --position-embedding-type rope or none (as upstream), got "
                f"{position_embedding_type!r}: the prediction depths embed shifted tokens with the word embedding alone"
            )
        # This stage runs the multi-token-prediction depths (the last one) and so needs the word embedding.
        self.mtp_process = post_process and self.mtp_num_layers > 0
        if not scatter_embedding_sequence_parallel and config.sequence_parallel and self.mtp_process:
            raise ValueError(
                "GPTModel(scatter_embedding_sequence_parallel=False) leaves the embedding output unscattered, which "
                "the multi-token-prediction depths (--mtp-num-layers) cannot take: with --sequence-parallel keep "
                "scatter_embedding_sequence_parallel=True (the default)"
            )
        self.scatter_embedding_sequence_parallel = scatter_embedding_sequence_parallel

        self.base_init_seed = resolve_base_init_seed(config)
        if pre_process or self.mtp_process:
            self.embedding = LanguageModelEmbedding(
                config,
                vocab_size,
                max_sequence_length,
                position_embedding_type=position_embedding_type,
                base_init_seed=self.base_init_seed,
                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel,
            )
        self.rotary_pos_emb = None
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, rotary_percent=rotary_percent, rotary_base=rotary_base,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=(seq_len_interpolation_factor
                                              or config.rotary_seq_len_interpolation_factor),
                rope_scaling=rope_scaling, rope_scaling_factor=rope_scaling_factor,
                cp_group=context_parallel_group_or_none(config),
            )
        elif position_embedding_type == "yarn":
            # The attention layers multiply cos and sin by config.yarn_cos_sin_scale.
            self.rotary_pos_emb = YarnRotaryEmbedding(
                config.kv_channels, rotary_percent=rotary_percent, rotary_base=rotary_base,
                rotary_interleaved=config.rotary_interleaved, scaling_factor=config.yarn_rotary_scaling_factor,
                original_max_position_embeddings=config.yarn_original_max_position_embeddings,
                beta_fast=config.yarn_beta_fast, beta_slow=config.yarn_beta_slow, mscale=config.yarn_mscale,
                mscale_all_dim=config.yarn_mscale_all_dim,
                correction_range_round_to_int=config.yarn_correction_range_round_to_int,
                cp_group=context_parallel_group_or_none(config),
            )
        self.decoder = TransformerBlock(
            config, spec=transformer_layer_spec, pre_process=pre_process, post_process=post_process,
            base_init_seed=self.base_init_seed, vp_stage=vp_stage,
        )
        self.mtp = MultiTokenPredictionBlock(config, self.base_init_seed) if self.mtp_process else None
        self.output_layer = None
        if post_process:
            # A single stage with tied weights multiplies by the embedding's own weight (passed to forward). A
            # last stage's tied copy draws from the word embedding's seed with its init method, so both copies
            # start equal (also when materialised from the meta device).
            if share_embeddings_and_output_weights:
                output_seed = word_embedding_init_seed(self.base_init_seed)
                output_init_method = config.embedding_init_method
            else:
                output_seed = derive_init_seed(self.base_init_seed, "output_layer")
                output_init_method = config.init_method
            self.output_layer = build_with_init_seed(
                output_seed,
                lambda: tensor_parallel.ColumnParallelLinear(
                    config.hidden_size,
                    vocab_size,
                    config=config,
                    init_method=output_init_method,
                    bias=False,
                    gather_output=False,
                    skip_weight_param_allocation=(pre_process or self.mtp_process)
                    and share_embeddings_and_output_weights,
                ),
            )
        self._setup_embeddings_and_output_layer()

    @staticmethod
    def _check_yarn_fields(config, position_embedding_type, seq_len_interpolation_factor):
        """The config's yarn_* fields shape --position-embedding-type yarn only (the attention layers read the
        cos / sin factor from them whatever the model's position embedding)."""
        from megatron.core.transformer.yarn_config import YARN_FIELDS

        if position_embedding_type != "yarn":
            changed = [flag for name, (flag, default) in YARN_FIELDS.items() if getattr(config, name) != default]
            if changed:
                raise ValueError(f"{', '.join(changed)} shape(s) YaRN rotary embeddings: they need "
                                 f"--position-embedding-type yarn, got {position_embedding_type!r}")
            return
        if config.multi_latent_attention:
            raise ValueError("--position-embedding-type yarn is standard attention's YaRN; --multi-latent-attention "
                             "rotates with its own (--rope-type yarn): use --position-embedding-type rope")
        if (seq_len_interpolation_factor or config.rotary_seq_len_interpolation_factor) is not None:
            raise ValueError("--rotary-seq-len-interpolation-factor does not combine with --position-embedding-type "
                             "yarn, which scales the frequencies itself (--yarn-rotary-scaling-factor): drop it")

    # ----------------------------------------------------------------------------------------------------
    # Tied embedding bookkeeping
    # ----------------------------------------------------------------------------------------------------

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The word-embedding weight on a stage that holds the embedding (the first, or with multi-token
        prediction the last), else the output-layer weight (None on middle stages)."""
        if self.pre_process or self.mtp_process:
            return self.embedding.word_embeddings.weight
        if self.output_layer is not None:
            return self.output_layer.weight
        return None

    def _setup_embeddings_and_output_layer(self):
        if self.pre_process or self.mtp_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.output_layer is not None and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        # With untied weights the last stage still keeps a copy of the word embedding for the MTP depths.
        mtp_copy_elsewhere = self.mtp_num_layers > 0 and not (self.pre_process and self.post_process)
        if not (self.share_embeddings_and_output_weights or mtp_copy_elsewhere):
            return
        weight = self.shared_embedding_or_output_weight()
        if weight is None:  # a middle pipeline stage holds neither copy
            return
        weight.shared_embedding = True
        # A last stage's tied copy is the embedding: same weight decay as the first stage's (see
        # LanguageModelEmbedding), or the two copies would drift apart.
        weight.is_embedding_parameter = True
        if self.pre_process and self.post_process:
            return  # one process holds the only copy
        if not self.pre_process:
            weight.shared = True
            with torch.no_grad():
                weight.zero_()
        # Parameters on the meta device are synchronised after materialisation, by whoever materialises them.
        if not weight.is_meta and dist.is_initialized() and parallel_state.is_rank_in_embedding_group():
            with torch.no_grad():
                dist.all_reduce(weight.data, group=parallel_state.get_embedding_group())

    # ----------------------------------------------------------------------------------------------------
    # Forward
    # ----------------------------------------------------------------------------------------------------

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Checkpoint entries of this stage (see `ShardedStateModule`), keyed by their names in the logical model
        (`dist_checkpointing.logical_names`): this stage's decoder layer `i` is `decoder.layers.{first layer +
        i}`, an expert is named by its global index, and a later stage's tied output-layer copy is
        `embedding.word_embeddings.weight`. Pipeline stages and expert-parallel ranks thus never write under each
        other's keys, and the names are those of pretrain_gpt's checkpoints. `load_state_dict` takes these names
        as well as the local ones. The output layer carries no extra state: quantizer state of a
        modelopt-quantized model travels in modelopt's own state instead."""
        sharded_state_dict = super().sharded_state_dict("", sharded_offsets, metadata)
        output_layer_extra_state = sharded_state_dict.pop("output_layer._extra_state", None)
        assert not output_layer_extra_state, f"unexpected output layer extra state: {output_layer_extra_state}"
        logical = self._logical_names()
        renamed = {}
        for key, value in sharded_state_dict.items():
            renamed.setdefault(f"{prefix}{logical.get(key, key)}", value)  # a tied copy: the first one named
        return renamed

    def _logical_names(self):
        """{local state-dict name: its name in the logical model} (see `sharded_state_dict`)."""
        from megatron.core.dist_checkpointing.logical_names import (
            current_tensor_parallel_rank,
            layer_offset_of,
            logical_name,
            placement_of,
        )

        tp, offset = current_tensor_parallel_rank(), layer_offset_of(self)
        params = dict(self.named_parameters(remove_duplicate=False))
        names = {}
        for name, value in self.state_dict(keep_vars=True).items():
            if torch.is_tensor(value):
                names[name] = placement_of(name, value, offset, tp, params.get(name)).logical_name
            else:
                names[name] = logical_name(name, offset)
        return names

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Load a state dict keyed by this stage's own names (`state_dict()`) or by the logical names of
        `sharded_state_dict()`, which is what `dist_checkpointing.load(model.sharded_state_dict(), ...)`
        returns."""
        local_to_logical = self._logical_names()
        keys = set(state_dict)
        if not keys <= set(local_to_logical):
            logical_to_local = {}
            for local, logical in local_to_logical.items():
                logical_to_local.setdefault(logical, []).append(local)
            translate_all = keys <= set(logical_to_local)
            translated = type(state_dict)()
            for key, value in state_dict.items():
                if key in logical_to_local and (translate_all or key not in local_to_logical):
                    for local in logical_to_local[key]:
                        translated[local] = value
                else:
                    translated[key] = value
            state_dict = translated
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def set_input_tensor(self, input_tensor):
        """The previous pipeline stage's output `[s, b, h]` (a tensor, a one-element list, or None)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel takes one input tensor per stage, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def _check_decoder_input(self, decoder_input, input_ids, inference_context):
        """`decoder_input` must be the embedding output this stage would compute: `[s, b, h]`, `[s / tp, b, h]`
        with sequence parallelism; only the first stage embeds, and decoding embeds its tokens itself."""
        fix = ("decoder_input replaces the embedding output [s, b, h] on the first pipeline stage (as upstream, it "
               "is forward's fourth positional argument; pass labels by keyword: model(tokens, position_ids, "
               "attention_mask, labels=labels))")
        if not self.pre_process:
            raise ValueError(f"GPTModel.forward: this pipeline stage is not the first; {fix}")
        if inference_context is not None:
            raise ValueError("GPTModel.forward: decoding (inference_context) embeds the input_ids; pass them "
                             "instead of decoder_input")
        if decoder_input.dim() != 3 or decoder_input.shape[2] != self.config.hidden_size:
            raise ValueError(f"GPTModel.forward: decoder_input has shape {tuple(decoder_input.shape)}, not "
                             f"[s, b, {self.config.hidden_size}]: {fix}")
        if input_ids is not None:
            seq_len = input_ids.shape[1]
            if self.config.sequence_parallel:
                seq_len //= self.config.tensor_model_parallel_size
            if tuple(decoder_input.shape[:2]) != (seq_len, input_ids.shape[0]):
                raise ValueError(f"GPTModel.forward: decoder_input has shape {tuple(decoder_input.shape)} but "
                                 f"input_ids {tuple(input_ids.shape)} embed to [{seq_len}, {input_ids.shape[0]}, "
                                 f"{self.config.hidden_size}] on this rank: {fix}")

    def _batch_and_sequence(self, input_ids, decoder_input=None):
        """(batch, this rank's sequence length before sequence parallelism's split, device) of the forward."""
        if input_ids is not None:
            return input_ids.shape[0], input_ids.shape[1], input_ids.device
        # [s, b, h], or [s / tp, b, h] with sequence parallelism
        received = decoder_input if decoder_input is not None else self.decoder.input_tensor
        seq_len = received.shape[0]
        if self.config.sequence_parallel:
            seq_len *= self.config.tensor_model_parallel_size
        return received.shape[1], seq_len, received.device

    def _packed_rows(self, packed_seq_params, input_ids, decoder_input, inference_context):
        """The `PackedRows` of a packed-sequence forward (megatron/core/packed_sequences.py), None without."""
        if packed_seq_params is None:
            return None
        where = "GPTModel.forward"
        check_packed_model_support(where, self.config, inference_context is not None, runs_mtp=self.mtp_process)
        batch, seq_len, device = self._batch_and_sequence(input_ids, decoder_input)
        return packed_rows(where, packed_seq_params, seq_len, batch, device,
                           *context_parallel_size_and_rank(self.config))

    def _rotary_angles(self, input_ids, decoder_input=None, packed=False):
        if self.rotary_pos_emb is None:
            return None
        _, seq_len, device = self._batch_and_sequence(input_ids, decoder_input)
        cp_size = self.config.context_parallel_size
        if packed:  # the angles of positions 0 .. t - 1 (upstream's packed_seq=True): attention picks each row's
            return rotary_angles(self.rotary_pos_emb, seq_len * cp_size, device=device)
        if cp_size == 1:  # every position, whatever parallel_state's context-parallel group is (the config decides)
            return rotary_angles(self.rotary_pos_emb, seq_len, device=device)
        # This rank holds two chunks of the sequence: asked for the whole sequence, the module (built over the
        # context-parallel group) returns the angles of their global positions.
        return local_rotary_angles(self.rotary_pos_emb, seq_len * cp_size, device=device)

    def _decoding_rotary_angles(self, input_ids, inference_context, position_ids):
        """The angles of the positions this decoding step fills (offset .. offset + s - 1; under continuous
        batching each token's own position, `position_ids` `[1, T]`)."""
        if self.rotary_pos_emb is None:
            return None
        if is_dynamic_batching(inference_context):
            positions = position_ids[0]
            angles = rotary_angles(self.rotary_pos_emb, int(positions.max()) + 1, device=input_ids.device)
            return angles.index_select(0, positions.to(angles.device))
        return rotary_angles(self.rotary_pos_emb, input_ids.shape[1], device=input_ids.device,
                             offset=inference_context.sequence_len_offset)

    def _decoding_position_ids(self, input_ids, position_ids, inference_context):
        """`position_ids`, or the positions offset .. offset + s - 1 of every row when None; checked against
        --max-position-embeddings for learned absolute position embeddings."""
        batch, seq_len = input_ids.shape
        if is_dynamic_batching(inference_context):  # each token at its position in its own request
            if batch != 1:
                raise ValueError("GPTModel.forward: continuous batching (DynamicInferenceContext) runs the step's "
                                 f"tokens as one row [1, T], got input_ids of shape {tuple(input_ids.shape)}")
            position_ids = inference_context.token_positions(input_ids.device)[None]
            last = int(position_ids.max()) + 1
        else:
            offset = inference_context.sequence_len_offset
            if position_ids is None:
                position_ids = torch.arange(offset, offset + seq_len, device=input_ids.device).expand(batch, seq_len)
            last = offset + seq_len
        if self.position_embedding_type == "learned_absolute" and last > self.max_sequence_length:
            raise ValueError(
                f"decoding position {last - 1} is past the learned position embedding's "
                f"{self.max_sequence_length} rows (--max-position-embeddings): generate fewer tokens "
                "(--num-tokens-to-generate) or use shorter prompts"
            )
        return position_ids

    def _vocab_parallel_logits(self, hidden_states):
        """`[s, b, h]` -> this rank's vocabulary slice of the logits, `[s, b, vocab / tp]`."""
        tied_weight = self.shared_embedding_or_output_weight() if self.output_layer.weight is None else None
        logits, _ = self.output_layer(hidden_states, weight=tied_weight)
        return logits

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor] = None,
        decoder_input: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
        extra_block_kwargs: Optional[dict] = None,
        runtime_gather_output: Optional[bool] = None,
        *,
        inference_params=None,
        loss_mask: Optional[torch.Tensor] = None,
    ):
        """Returns the per-token loss `[b, s]` (fp32) when `labels` are given, else the logits: this rank's
        vocabulary slice `[b, s, vocab / tp]`, or with `runtime_gather_output=True` (None: `not parallel_output`)
        all of them, `[b, s, vocab]`.

        `inference_context` (a `StaticInferenceContext`; `inference_params` is upstream's older name for it):
        decode `input_ids`, the positions offset .. offset + s - 1 of each row, through the context's key/value
        cache, and return their logits (as without labels: gathered when `runtime_gather_output`, else by
        `parallel_output`); the caller then advances the offset. `position_ids` may then be None (those
        positions). Context and sequence parallelism are refused (`inference.model_checks`); a pipeline stage
        decodes through `inference.pipeline_decoding`.

        A stage that is not last returns its hidden states `[s, b, h]` for the next stage. `attention_mask` is
        None (causal) or a bool tensor broadcastable to `[b, heads, s, s]`, True where attention is masked.
        With multi-token prediction and `labels`, the last stage returns `(loss, mtp_losses)`: `mtp_losses`
        `[N, b, s]` (fp32) holds depth k's per-token loss against the labels shifted left by k in row k - 1,
        zero where the shifted label falls off the end (the MTP depths do not run without labels).

        `loss_mask` (`[b, s]`, like `labels`; upstream's keyword): as upstream, the main per-token loss is returned
        unmasked (the loss function applies the mask), and depth k's MTP losses are multiplied by the mask shifted
        left by k. It is ignored without labels. The parameters are upstream's, in its positional order
        (`decoder_input` fourth, `labels` fifth). `decoder_input`, as upstream, replaces the embedding on the
        first stage: its output `[s, b, h]` (`[s / tp, b, h]` with sequence parallelism); `input_ids` may then be
        None unless multi-token prediction runs. `extra_block_kwargs` must be None.

        `packed_seq_params` (a `PackedSeqParams`, upstream's 'thd' layout): `input_ids` `[1, t]` hold several
        sequences back to back; each token attends within its own sequence and its positions (rotary, and the
        learned embedding when `position_ids` is None) restart at each sequence start, so each sequence's
        per-token loss is the one it has alone (megatron/core/packed_sequences.py); multi-token prediction shifts
        within each sequence. Under context parallelism `input_ids` are this rank's rows of upstream's THD split
        (`get_thd_batch_on_this_cp_rank`) and `packed_seq_params` describe the whole row. Not with decoding, nor
        with multi-token prediction under context parallelism (refused by name)."""
        _refuse_unsupported_forward_inputs(extra_block_kwargs)
        if inference_params is not None:
            if inference_context is not None and inference_context is not inference_params:
                raise ValueError("GPTModel.forward: pass inference_context or its older name inference_params, "
                                 "not two different contexts")
            inference_context = inference_params
        if decoder_input is not None:
            self._check_decoder_input(decoder_input, input_ids, inference_context)
        rows = self._packed_rows(packed_seq_params, input_ids, decoder_input, inference_context)
        if rows is not None and position_ids is None:
            position_ids = rows.positions[None]  # each sequence's own positions, for a learned position embedding
        if inference_context is not None:
            return self._decode(input_ids, position_ids, attention_mask, labels, inference_context,
                                runtime_gather_output)
        if not self.pre_process and self.decoder.input_tensor is None:
            raise RuntimeError("a pipeline stage that is not first needs set_input_tensor() before forward")
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids, position_ids)
            if self.config.sequence_parallel and not self.scatter_embedding_sequence_parallel:
                decoder_input = tensor_parallel.scatter_to_sequence_parallel_region(decoder_input)
        rotary_angles = self._rotary_angles(input_ids, decoder_input, packed=rows is not None)
        hidden_states = self.decoder(decoder_input, attention_mask=attention_mask, rotary_pos_emb=rotary_angles,
                                     packed_seq_params=packed_seq_params)
        if not self.post_process:
            return hidden_states

        logits = self._vocab_parallel_logits(hidden_states)
        if labels is None:
            return self._batch_first_logits(logits, runtime_gather_output)
        _check_loss_mask(loss_mask, labels)
        loss = self._per_token_loss(logits, labels)
        if not self.mtp_process:
            return loss
        del logits
        return loss, self._mtp_losses(input_ids, position_ids, hidden_states, labels, attention_mask, rotary_angles,
                                      loss_mask, packed_seq_params, rows)

    def _batch_first_logits(self, logits, runtime_gather_output):
        """This rank's logits `[s, b, vocab / tp]` -> `[b, s, vocab / tp]`, or gathered `[b, s, vocab]`."""
        gather = not self.parallel_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        return logits.transpose(0, 1).contiguous()

    def _decode(self, input_ids, position_ids, attention_mask, labels, inference_context, runtime_gather_output):
        """The forward of one decoding step through `inference_context`'s cache -> logits (see `forward`)."""
        check_inference_supported(self.config, self.pre_process, self.post_process)
        if labels is not None:
            raise ValueError("GPTModel.forward: decoding (inference_context) returns logits; compute a loss "
                             "without an inference context")
        if input_ids is None:
            raise ValueError("GPTModel.forward: decoding (inference_context) needs the input_ids")
        position_ids = self._decoding_position_ids(input_ids, position_ids, inference_context)
        hidden_states = self.decoder(self.embedding(input_ids, position_ids), attention_mask=attention_mask,
                                     rotary_pos_emb=self._decoding_rotary_angles(input_ids, inference_context,
                                                                                 position_ids),
                                     inference_context=inference_context)
        return self._batch_first_logits(self._vocab_parallel_logits(hidden_states), runtime_gather_output)

    def _per_token_loss(self, logits, labels):
        """Vocab-parallel logits `[s, b, vocab / tp]` and labels `[b, s]` -> per-token loss `[b, s]` (fp32)."""
        labels = labels.transpose(0, 1).contiguous()
        if self.config.cross_entropy_loss_fusion:
            from megatron.core.tensor_parallel.fused_cross_entropy import fused_vocab_parallel_cross_entropy

            loss = fused_vocab_parallel_cross_entropy(logits, labels)
        else:
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels)
        return loss.transpose(0, 1).contiguous()

    def _mtp_losses(self, input_ids, position_ids, hidden_states, labels, attention_mask, rotary_angles,
                    loss_mask=None, packed_seq_params=None, rows=None):
        """`[N, b, s]`: each MTP depth's per-token loss (see `forward`), logits from the shared output layer."""
        if input_ids is None:
            raise RuntimeError("the multi-token-prediction depths on the last stage need the input ids: pass the "
                               "tokens to forward() on every pipeline stage")
        depth_states = self.mtp(input_ids, position_ids, hidden_states, self.embedding,
                                attention_mask=attention_mask, rotary_pos_emb=rotary_angles,
                                packed_seq_params=packed_seq_params)
        if rows is not None:
            return self._packed_mtp_losses(depth_states, labels, loss_mask, rows)
        cp_size = self.config.context_parallel_size
        seq_len = labels.shape[1] * cp_size
        if cp_size == 1:
            positions = torch.arange(seq_len, device=labels.device)
        else:  # the global positions of this rank's two chunks
            positions = local_token_indices(seq_len, cp_size, parallel_state.get_context_parallel_rank(),
                                            device=labels.device)
        cp_group = context_parallel_group_or_none(self.config)
        losses = []
        for depth, states in enumerate(depth_states, start=1):
            shifted_labels = shift_left(labels, depth, cp_group=cp_group)
            loss = self._per_token_loss(self._vocab_parallel_logits(states), shifted_labels)
            loss = torch.where(positions < seq_len - depth, loss, torch.zeros_like(loss))
            if loss_mask is not None:
                loss = loss * shift_left(loss_mask, depth, cp_group=cp_group).to(loss.dtype)
            losses.append(loss)
        return torch.stack(losses)

    def _packed_mtp_losses(self, depth_states, labels, loss_mask, rows):
        """`_mtp_losses` on packed sequences: the labels and loss mask shift within each sequence, and depth k's
        loss is zero where the shifted label falls past the end of its sequence (as for each sequence alone)."""
        losses = []
        for depth, states in enumerate(depth_states, start=1):
            shifted_labels, valid = shift_left_within_sequences(labels, depth, rows.segments)
            loss = self._per_token_loss(self._vocab_parallel_logits(states), shifted_labels)
            loss = torch.where(valid, loss, torch.zeros_like(loss))
            if loss_mask is not None:
                loss = loss * shift_left_within_sequences(loss_mask, depth, rows.segments)[0].to(loss.dtype)
            losses.append(loss)
        return torch.stack(losses)
